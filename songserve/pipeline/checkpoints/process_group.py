"""torch.distributed for a world of one, with no port unless one is asked for, on loopback.

megatron-core needs a process group even for one rank. Started the usual way (a TCP store on a
fixed port, the reference's 8791) it makes two workers on one host collide on that port, and the
store listens on every interface, unauthenticated. One rank has nobody to meet, so by default the
store is an in-process ``HashStore``: no port at all. When MASTER_PORT is given (the reference's
launcher sets MASTER_ADDR and MASTER_PORT for each worker) the TCP store listens there, on
MASTER_ADDR only (127.0.0.1 unless told otherwise): the socket is bound here and handed to torch,
whose own store server would bind every interface.

The backends open sockets of their own: gloo a listener per device, NCCL a bootstrap listener.
Both pick the address the host name resolves to, often the LAN's; unless GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME say otherwise they are sent to the loopback interface here.

On the CPU the world's groups are gloo's, with one gloo device and one worker thread shared by all
of them (``SHARED_GLOO``). Stock gloo gives every group a device of its own, whose event loop wakes
every 10 ms, and two worker threads: megatron's twenty-odd groups made an idle CPU worker carry 21
such loops in 66 threads, 4 % of a core spent waking them (measured: 1.24 CPU-s in 30 s idle; 0.25
with one loop, in 22 threads). A world of one sends nothing between ranks, so sharing costs nothing;
the collectives are gloo's own.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

from songserve.errors import ConfigError

log = logging.getLogger(__name__)

STORE_TIMEOUT = datetime.timedelta(minutes=30)
SHARED_GLOO = "gloo_shared"  # gloo, one device and one thread for every group (registered on first use)


def start_world_of_one(backend: str, master_addr: str = "127.0.0.1", master_port: int = 0) -> str:
    """``init_process_group`` for rank 0 of 1; returns where its store is, for the log.

    ``master_port`` 0 = an in-process store; otherwise a TCP store on ``master_addr:master_port``
    (a port in use refuses with a ConfigError naming MASTER_PORT).
    """
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore, Store, TCPStore  # torch.distributed re-exports them untyped

    _backend_sockets_on_loopback()
    if backend == "gloo":
        backend = _shared_gloo()
    if master_port == 0:
        store: Store = HashStore()
        where = "an in-process store (no port)"
    else:
        sock = _listen(master_addr, master_port)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        # torch takes the descriptor over: detach, so that closing the Python object cannot close it
        store = TCPStore(master_addr, master_port, 1, True, timeout=STORE_TIMEOUT, master_listen_fd=sock.detach())
        where = f"a TCP store on {master_addr}:{master_port}"
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    return where


def _listen(addr: str, port: int) -> socket.socket:
    """A listening socket on exactly ``addr:port`` (not every interface), or a one-line refusal."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"MASTER_ADDR '{addr}' is no address of this host ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is still free
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"MASTER_PORT {port}: cannot listen on {addr} ({exc.strerror}); unset MASTER_PORT "
            "(a worker needs no port for its process group) or choose a free one"
        ) from None
    return sock


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), or None when neither exists."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _backend_sockets_on_loopback() -> None:
    """Point gloo's and NCCL's own listeners at loopback, unless the environment chose an interface."""
    if "GLOO_SOCKET_IFNAME" in os.environ and "NCCL_SOCKET_IFNAME" in os.environ:
        return
    lo = loopback_interface()
    if lo is None:
        log.warning("no loopback interface found: gloo and NCCL listen where the host name resolves")
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def _shared_gloo() -> str:
    """Register ``SHARED_GLOO`` (once per process): gloo process groups on one device and one thread.

    gloo's options object is the one way torch takes a device for a group; it is named ``_Options``
    in torch 2.x's bindings (the stubs omit it), and a torch without it keeps stock gloo."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import Store

    options_of = getattr(dist.ProcessGroupGloo, "_Options", None)
    if options_of is None:
        log.debug("torch's gloo takes no options here: each process group keeps a device of its own")
        return "gloo"
    if SHARED_GLOO in dist.Backend.backend_list:
        return SHARED_GLOO
    device: list[object] = []  # made with the first group, after _backend_sockets_on_loopback chose its interface

    def make(store: Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
        if not device:
            device.append(dist.ProcessGroupGloo.create_default_device())
        options = options_of()
        options._devices, options._threads, options._timeout = device, 1, timeout
        return dist.ProcessGroupGloo(store, rank, size, options)

    dist.Backend.register_backend(SHARED_GLOO, make, devices=["cpu"])
    return SHARED_GLOO
