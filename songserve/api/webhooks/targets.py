"""Where a webhook may be sent: ``WEBHOOK_ALLOW``, checked at submit and again at every try.

Why: a webhook URL is the client's, and the dispatcher sits inside a network; without a rule anyone
who may submit a job could make it call its own admin ports, a metadata service or a database
(server-side request forgery). So the URL's host is resolved and every address it has must be
allowed, at submit (a 422 naming ``webhook``) and at each try (a name may resolve elsewhere since),
and the try connects to the address that was checked, not to a second lookup (``Target``: the
request goes to the IP, with the name in ``Host`` and in TLS's SNI and certificate check).

``WEBHOOK_ALLOW`` unset: public addresses only (no loopback, private, link-local, shared,
multicast, reserved or unspecified ones). Set: a comma-separated list of what is allowed, each a
host name (matched exactly, whatever it resolves to), an address or a CIDR (``127.0.0.1/32``,
``10.0.0.0/8``, ``fd00::/8``), or ``public`` (the unset rule's addresses); only what it lists.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Net = ipaddress.IPv4Network | ipaddress.IPv6Network
RESOLVE_TIMEOUT_SEC = 5.0


class Refused(Exception):
    """A URL this dispatcher will not call; the message says why, for a 422 or the outbox's last error."""


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect (the URL with the checked address), and the name it stands for."""

    url: str  # the URL with the address in place of the host
    host: str  # the Host header (the name, and the port when the URL had one)
    sni: str | None  # https: the name TLS sends and checks the certificate against


def _kind(ip: IP) -> str | None:
    """Why an address is not public (None: it is)."""
    for kind in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-public"


def _address(ip: IP) -> IP:
    """An IPv4-mapped IPv6 address (``::ffff:127.0.0.1``) is its IPv4 address."""
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip


class WebhookPolicy:
    """``WEBHOOK_ALLOW`` read once; ``check`` answers a ``Target`` or raises ``Refused``."""

    def __init__(self, allow: str) -> None:
        items = [x.strip() for x in allow.split(",") if x.strip()]
        self.public = not items or "public" in items
        self.hosts: set[str] = set()
        self.nets: list[Net] = []
        for item in items:
            if item == "public":
                continue
            try:
                self.nets.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                if "/" in item or not item.replace("-", "").replace(".", "").isalnum():
                    raise ValueError(f"{item!r} is neither a host name, an address, a CIDR nor 'public'") from None
                self.hosts.add(item.lower().rstrip("."))

    def why_not(self, host: str, ip: IP) -> str | None:
        """None when ``host`` at ``ip`` may be called, else why not."""
        ip = _address(ip)
        if host in self.hosts or any(ip.version == n.version and ip in n for n in self.nets):
            return None
        kind = _kind(ip)
        if kind is None and self.public:
            return None
        what = f"a {kind} address" if kind else "an address"
        where = f"{ip} is" if host == str(ip) else f"{host} is {ip},"  # an address in the URL: said once
        return f"{where} {what} that WEBHOOK_ALLOW does not allow"

    async def check(self, url: str) -> Target:
        """Resolve ``url``'s host; every address must be allowed. The target is the first address."""
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        if parts.scheme not in ("http", "https") or not host:
            raise Refused("must be an http:// or https:// URL with a host")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_SEC):  # not wait_for: it can swallow a cancel on 3.11
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as exc:
            raise Refused(f"its host {host} cannot be resolved ({exc.strerror or 'no answer'})") from None
        ips = list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos))
        if not ips:
            raise Refused(f"its host {host} has no address")
        for ip in ips:
            if (why := self.why_not(host, ip)) is not None:
                raise Refused(why)
        return _target(parts, host, _address(ips[0]))


def _target(parts: SplitResult, host: str, ip: IP) -> Target:
    where = f"[{ip}]" if ip.version == 6 else str(ip)
    port = f":{parts.port}" if parts.port else ""
    url = parts._replace(netloc=f"{where}{port}").geturl()
    try:
        ipaddress.ip_address(host.strip("[]"))
        named = False  # the URL named an address: nothing to pin, no name for TLS
    except ValueError:
        named = True
    name = f"[{host}]" if ":" in host else host
    return Target(url, f"{name}{port}", host if parts.scheme == "https" and named else None)
