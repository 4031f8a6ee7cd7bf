"""What a process listens on, read from /proc (its socket descriptors matched against its net/tcp{,6}),
and which processes a launcher run left behind (found by a variable only that run's environment holds)."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])  # one little-endian word
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four little-endian words
    return socket.inet_ntop(socket.AF_INET6, words)


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` has in LISTEN state."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addr, port = fields[1].split(":")
                found.append((_address(addr), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def not_on_loopback(pid: int) -> list[tuple[str, int]]:
    """The listeners of ``pid`` that another host could reach (a wildcard address counts)."""
    return [(a, p) for a, p in listening(pid) if not is_loopback(a)]


def holding_env(assignment: str) -> list[int]:
    """Pids of the live processes whose environment holds ``NAME=value`` exactly (zombies have none)."""
    want = assignment.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if want in env.split(b"\0"):
            pids.append(int(entry.name))
    return pids
