"""Checks made before any rendezvous, so that a world spanning nodes fails at once, in one
line, instead of waiting in ``init_process_group`` until its timeout.

gloo listens on the address this host's name resolves to, unless ``GLOO_SOCKET_IFNAME`` names
an interface. Debian and Ubuntu map the hostname to ``127.0.1.1`` in ``/etc/hosts``: a rank
there tells the ranks of the other nodes to connect to a loopback address, which they cannot
reach, and every rank waits. :func:`gloo_preflight` finds that case (the pieces are those
:func:`usbyte_opt.collectives.issuers.gloo_address` uses for the runtime's own groups) and
says the fix: ``GLOO_SOCKET_IFNAME`` set to the interface that reaches the other nodes (the one
``ip route get MASTER_ADDR`` names, which it looks up), or the hostname mapped to the node's
address. ``usbyte-opt profile`` (on gloo) and ``usbyte-opt launch`` run it on every node.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping

from .errors import UsbyteError


def spans_nodes(env: Mapping[str, str], nnodes: int | None = None) -> bool:
    """Whether the world spans nodes: ``nnodes`` above 1 (``--nnodes``, its maximum), or, in
    a rank, ``WORLD_SIZE`` above ``LOCAL_WORLD_SIZE``.

    Example::

        >>> spans_nodes({}, 2), spans_nodes({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
        (True, True)
        >>> spans_nodes({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, 1)
        False
    """
    if nnodes is not None and nnodes > 1:
        return True
    try:
        return int(env.get("WORLD_SIZE", "0")) > int(env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE", "0"))
    except ValueError:
        return False


def gloo_preflight(env: Mapping[str, str], *, nnodes: int | None = None, master: str | None = None,
                   host: str = "", host_addr: str | None = None,
                   route: Callable[[str], str | None] = lambda _: None,
                   interface: Callable[[str], str | None] = lambda _: None) -> str | None:
    """The one-line problem of a gloo world spanning nodes whose ranks on this host could not
    be reached, or ``None``.

    ``None`` when ``GLOO_SOCKET_IFNAME`` is set, the world is on one node
    (:func:`spans_nodes`), this host's name ``host`` resolves (``host_addr``) to an address
    that is not loopback, or the rendezvous host ``master`` (default ``MASTER_ADDR``) is
    loopback itself (every node is then this host). Else the line names the fix: the
    interface ``interface(route(master))`` (the local address towards the master and the
    interface that has it) when found.

    Example::

        >>> gloo_preflight({"GLOO_SOCKET_IFNAME": "eth0"}, nnodes=2, host_addr="127.0.1.1")
        >>> gloo_preflight({}, nnodes=2, master="10.0.0.1", host="gpu7", host_addr="10.0.0.7")
        >>> line = gloo_preflight({}, nnodes=2, master="10.0.0.1", host="gpu7",
        ...                       host_addr="127.0.1.1", route=lambda h: "10.0.0.7",
        ...                       interface=lambda a: "eth0")
        >>> line.split(": ")[0], "GLOO_SOCKET_IFNAME=eth0" in line
        ("this host's name gpu7 resolves to 127.0.1.1, a loopback address", True)
    """
    from .collectives.issuers import _loopback

    if [i for i in env.get("GLOO_SOCKET_IFNAME", "").split(",") if i]:
        return None
    if not spans_nodes(env, nnodes):
        return None
    if not _loopback(host_addr):
        return None
    master = master if master is not None else env.get("MASTER_ADDR")
    if master and _loopback(master):
        return None
    local = route(master) if master else None
    name = interface(local) if local and not _loopback(local) else None
    towards = f"`ip route get {master}`" if master else "`ip route get <master address>`"
    if name:
        fix = f"GLOO_SOCKET_IFNAME={name} (the interface of {local}, the one {towards} names)"
    else:
        fix = f"GLOO_SOCKET_IFNAME=<interface>, the one {towards} names"
    resolved = f"resolves to {host_addr}, a loopback address" if host_addr else "does not resolve"
    return (f"this host's name {host or '?'} {resolved}: a job spanning nodes on gloo would "
            "give the other nodes that address and wait in init_process_group until its "
            f"timeout; set {fix}, or map {host or 'the hostname'} to this node's address in "
            "/etc/hosts")


def interface_of(addr: str) -> str | None:
    """The name of the network interface that has the IPv4 address ``addr`` (Linux), or
    ``None``."""
    try:
        import fcntl
        import struct

        names = [n for _, n in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for n in names:
                try:
                    raw = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                      struct.pack("256s", n.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(raw[20:24]) == addr:
                    return n
    except (OSError, ImportError, AttributeError):
        return None
    return None


def check_gloo(where: str, env: Mapping[str, str] | None = None, *, nnodes: int | None = None,
               master: str | None = None) -> None:
    """Raise :class:`~usbyte_opt.errors.UsbyteError` ``WHERE: <problem>`` when
    :func:`gloo_preflight` finds one on this host (its name, the address it resolves to, the
    route towards ``master``)."""
    from .collectives.issuers import _host_address, _route_to

    env = os.environ if env is None else env
    line = gloo_preflight(env, nnodes=nnodes, master=master, host=socket.gethostname(),
                          host_addr=_host_address(), route=_route_to, interface=interface_of)
    if line:
        raise UsbyteError(f"{where}: {line}")


__all__ = ["check_gloo", "gloo_preflight", "interface_of", "spans_nodes"]
