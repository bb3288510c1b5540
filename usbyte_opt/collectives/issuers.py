"""Process groups and issuers of the blocks, shared by the profiler and the runtime: the
profiler times exactly what the runtime's blocks go through.

One block in flight (gloo). The schedule is an issue order for *one* channel
(docs/design.md §2), but ``ProcessGroupGloo`` runs collectives on two worker threads: a block
issued while another is on the wire starts at once and the two share the link, so an urgent
small block issued behind a big one finishes late (docs/bench.md). On gloo the blocks
therefore go through a second gloo group over the same ranks with a single worker thread
(:func:`serial_group`): blocks are still issued as soon as they are ready, and gloo runs them
one after another in issue order. NCCL serialises collectives on its stream already. The
price, on a rank with one core, is a few milliseconds per back-to-back small block, so the
profiler times this channel, in chains (:func:`block_issuer`), and the planner merges small
tensors accordingly.

Where those gloo groups listen (:func:`gloo_address`), also on an NCCL run:
``$GLOO_SOCKET_IFNAME`` when set (as torch's own gloo groups); else the address this host's
name resolves to, unless that is a loopback address (Debian and Ubuntu map the hostname to
127.0.1.1) while the rendezvous store is on another address: then the local address that
routes to the store's host, so ranks on other nodes can reach it. A job that spans nodes
(``WORLD_SIZE`` above ``LOCAL_WORLD_SIZE``) with nothing but a loopback address to offer is
refused with a one-line error naming ``GLOO_SOCKET_IFNAME``.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import UsbyteError

_SERIAL_IDS = itertools.count()


def serial_group(group: dist.ProcessGroup | None, timeout: timedelta | None = None,
                 threads: int = 1, tag: str = "serial") -> dist.ProcessGroup:
    """A gloo process group over the ranks of ``group`` that runs ``threads`` collectives at a
    time (default one: in issue order).

    A collective call: every rank of ``group`` must call it, in the same order relative to
    other calls of it (the runtime calls it once per :class:`DistributedOptimizer`, after the
    start-up checks). It rendezvouses through the default group's store under a prefix of its
    own; collectives are issued on it directly (``pg.allreduce``) and run in issue order on its
    one worker thread.

    Example (one rank)::

        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> pg = serial_group(None)
        >>> x = torch.ones(3); pg.allreduce([x]).wait()
        True
        >>> dist.destroy_process_group()
    """
    from torch.distributed import distributed_c10d as c10d

    name = "default" if group is None else c10d._get_process_group_name(group)
    return _gloo_group(f"usbyte-{tag}/{name}/{next(_SERIAL_IDS)}", dist.get_rank(group),
                       dist.get_world_size(group), timeout, threads)


def serial_subgroups(group: dist.ProcessGroup | None, members: Sequence[Sequence[int]],
                     timeout: timedelta | None = None, tag: str = "sub"
                     ) -> list[dist.ProcessGroup | None]:
    """One-thread gloo groups (as :func:`serial_group`'s) over subsets of the ranks of
    ``group``: per entry of ``members`` (ranks of ``group``), the group when this rank is one
    of them (its rank there: its place in the entry), else ``None``.

    A collective call: every rank of ``group`` calls it with the same ``members``, in the same
    order relative to :func:`serial_group`. The groups are built in list order, each by its
    members only; list them in rounds of disjoint subsets that cover every rank (the
    runtime's hierarchical groups: every node's, then every cross-node set, ...) so that
    every rank reaches each of its groups once the round before is built.

    Example (one rank)::

        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> [pg.size() for pg in serial_subgroups(None, [[0], [0]])]
        [1, 1]
        >>> dist.destroy_process_group()
    """
    from torch.distributed import distributed_c10d as c10d

    rank = dist.get_rank(group)
    name = "default" if group is None else c10d._get_process_group_name(group)
    base = f"usbyte-{tag}/{name}/{next(_SERIAL_IDS)}"
    return [_gloo_group(f"{base}/{i}", list(ranks).index(rank), len(ranks), timeout, 1)
            if rank in ranks else None for i, ranks in enumerate(members)]


def _gloo_group(prefix: str, rank: int, size: int, timeout: timedelta | None,
                threads: int) -> dist.ProcessGroup:
    """A gloo process group of ``size`` ranks with ``threads`` worker threads, rendezvousing
    under ``prefix`` in the default group's store, listening where :func:`gloo_address` says."""
    from torch.distributed import distributed_c10d as c10d

    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
    opts._threads = threads
    kind, names = gloo_address(os.environ, _host_address(), _store_host(), _route_to)
    create = dist.ProcessGroupGloo.create_device
    opts._devices = ([create(interface=i) for i in names] if kind == "interface" else
                     [create(hostname=a) for a in names] if kind == "hostname" else
                     [dist.ProcessGroupGloo.create_default_device()])
    opts._timeout = timeout if timeout is not None else c10d.default_pg_timeout
    store = dist.PrefixStore(prefix, c10d._get_default_store())
    # The stubs type it as a Backend only; it is a process group to every collective call.
    return dist.ProcessGroupGloo(store, rank, size, opts)  # type: ignore[return-value]


def _loopback(addr: str | None) -> bool:
    if not addr:
        return True
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False   # a name: not known to be loopback


def gloo_address(env: Mapping[str, str], host_addr: str | None, store_host: str | None,
                 route: Callable[[str], str | None]) -> tuple[str, list[str]]:
    """Where the runtime's gloo groups listen: ``("interface", names)`` from
    ``$GLOO_SOCKET_IFNAME``; ``("default", [])`` (torch's choice: the address the hostname
    resolves to) when that is not loopback, or when every rank is on this node as far as is
    known; ``("hostname", [addr])``, the local address ``route`` finds towards the store's
    host, when the hostname resolves to loopback and the store is elsewhere. A job spanning
    nodes with only loopback to offer raises :class:`UsbyteError`.

    Example::

        >>> no_route = lambda host: None
        >>> gloo_address({"GLOO_SOCKET_IFNAME": "eth0,eth1"}, "127.0.1.1", None, no_route)
        ('interface', ['eth0', 'eth1'])
        >>> gloo_address({}, "10.0.0.5", "10.0.0.1", no_route)
        ('default', [])
        >>> gloo_address({}, "127.0.1.1", "10.0.0.1", lambda host: "10.0.0.7")
        ('hostname', ['10.0.0.7'])
        >>> gloo_address({}, "127.0.1.1", "127.0.0.1", no_route)
        ('default', [])
    """
    ifnames = [i for i in env.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if ifnames:
        return "interface", ifnames
    if not _loopback(host_addr):
        return "default", []
    if store_host and not _loopback(store_host):
        addr = route(store_host)
        if addr and not _loopback(addr):
            return "hostname", [addr]
    try:
        spans = int(env.get("WORLD_SIZE", "0")) > int(env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE", "0"))
    except ValueError:
        spans = False
    if spans:
        raise UsbyteError(f"the runtime's gloo groups (control messages, also on NCCL) would listen "
                          f"on {host_addr or 'no address'} (this host's name resolves to loopback) "
                          "but the job spans nodes: set GLOO_SOCKET_IFNAME to the network "
                          "interface the nodes reach each other on (e.g. GLOO_SOCKET_IFNAME=eth0)")
    return "default", []


def _host_address() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def _store_host() -> str | None:
    """The host of the default group's TCP store (``MASTER_ADDR``), if it is one."""
    try:
        from torch.distributed import distributed_c10d as c10d

        store: object = c10d._get_default_store()
        for _ in range(8):
            inner = getattr(store, "underlying_store", None)
            if inner is None:
                break
            store = inner
        host = getattr(store, "host", None) if isinstance(store, dist.TCPStore) else None
    except Exception:  # noqa: BLE001 - no default store, an older torch: nothing known
        return None
    return host if isinstance(host, str) and host else None


def _route_to(host: str) -> str | None:
    """The local address the kernel would use to reach ``host`` (a UDP socket's connect:
    nothing is sent)."""
    try:
        info = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = info[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def backend_for(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend that all-reduces ``device`` tensors on ``group`` (``"nccl"``, ``"gloo"``,
    ...). A group made with ``"cpu:gloo,cuda:nccl"`` (what ``init_process_group()`` gives
    without a backend) reports both; the device decides."""
    name = str(dist.get_backend(group)).lower()
    if "," in name or ":" in name:
        pairs = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        name = pairs.get(device.type, next(iter(pairs.values()), name))
    return name


def wants_serial(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether blocks of ``device`` tensors go through :func:`serial_group`: CPU tensors on
    gloo with more than one rank."""
    return (device.type != "cuda" and dist.get_world_size(group) > 1
            and backend_for(group, device) == "gloo")


def sum_issuer(group: dist.ProcessGroup | None,
               serial: dist.ProcessGroup | None = None) -> Callable[[torch.Tensor], dist.Work]:
    """A function that starts one asynchronous sum all-reduce of a tensor and returns its
    work: on ``serial`` (a :func:`serial_group`) when given, else on ``group``."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # the stub says ReduceOp; it takes RedOpType
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    # Straight to the process group, as ``dist.all_reduce(x, group, async_op=True)`` ends up
    # doing for a dense real tensor outside a coalescing context: without its wrapper's
    # checks and logging, a few microseconds per block.
    pg = serial if serial is not None else (
        group if group is not None else dist.distributed_c10d._get_default_group())
    return lambda x: pg.allreduce([x], opts)


def reduce_scatter_issuer(group: dist.ProcessGroup | None, serial: dist.ProcessGroup | None = None
                          ) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """A function ``issue(output, input)`` that starts one asynchronous sum reduce-scatter and
    returns its work: ``input`` holds the whole block on every rank, ``output`` (``input``'s
    length over the world size) receives this rank's shard of the sum. On ``serial`` (a
    :func:`serial_group`) when given, else on ``group``.

    On gloo (torch 2.x, ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``) torch's own
    is a clone of the input, a whole all-reduce of it and a copy of the shard: it costs what
    an all-reduce costs, not half. So on gloo with 2 ranks and float32/float64 blocks it is an
    all-to-all instead (each rank sends the other its half) and one add when the work is
    waited for (:class:`SummedWork`): half the bytes on the wire, and the same sum, bitwise, as
    the all-reduce's (the two halves added once; addition commutes)."""
    pg = serial if serial is not None else group
    gloo = serial is not None or dist.get_backend(group) == "gloo"
    pairs = gloo and (pg.size() if pg is not None else dist.get_world_size()) == 2
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # as in sum_issuer
    # reduce_scatter_tensor's new name (torch 2.10+) where there is one: the old one warns.
    rs: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def torch_rs(out: torch.Tensor, x: torch.Tensor) -> Any:
        if serial is not None:
            return serial._reduce_scatter_base(out, x, opts)
        return rs(out, x, group=group, async_op=True)

    if not pairs:
        return torch_rs

    def issue(out: torch.Tensor, x: torch.Tensor) -> Any:
        if x.dtype not in (torch.float32, torch.float64):
            return torch_rs(out, x)
        parts = torch.empty_like(x)
        if serial is not None:
            work = serial.alltoall_base(parts, x, [], [], dist.AllToAllOptions())
        else:
            work = dist.all_to_all_single(parts, x, group=group, async_op=True)
        return SummedWork(work, out, parts.view(2, -1))

    return issue


class SummedWork:
    """The work of a reduce-scatter made of an all-to-all (:func:`reduce_scatter_issuer`):
    waiting for it adds the pieces the ranks sent into the output, once. ``is_completed`` and
    ``get_future`` are the all-to-all's (its completion is the wire's)."""

    __slots__ = ("work", "out", "parts", "summed")

    def __init__(self, work: dist.Work, out: torch.Tensor, parts: torch.Tensor):
        self.work, self.out, self.parts, self.summed = work, out, parts, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        if not self.summed:
            torch.add(self.parts[0], self.parts[1], out=self.out)
            self.summed = True
            self.parts = self.out  # the pieces' memory goes
        return bool(ok)

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def get_future(self) -> Any:
        return self.work.get_future()


def all_gather_issuer(group: dist.ProcessGroup | None, serial: dist.ProcessGroup | None = None
                      ) -> Callable[[torch.Tensor, torch.Tensor], dist.Work]:
    """A function ``issue(output, input)`` that starts one asynchronous all-gather and returns
    its work: every rank's ``input`` (a shard) lands, in rank order, in ``output`` (the whole
    block, world size times as long). On ``serial`` when given, else on ``group``."""
    if serial is not None:
        return lambda out, x: serial._allgather_base(out, x)
    ag: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return lambda out, x: ag(out, x, group=group, async_op=True)


#: The collectives a block can be, by name (the sweep's ``kind``), and their issuers.
ISSUERS: dict[str, Callable[..., Callable[..., dist.Work]]] = {
    "all-reduce": sum_issuer,
    "reduce-scatter": reduce_scatter_issuer,
    "all-gather": all_gather_issuer,
}


def block_issuers(group: dist.ProcessGroup | None, device: torch.device, kinds: Sequence[str],
                  timeout: timedelta | None = None) -> tuple[dict[str, Callable[..., dist.Work]], str]:
    """An issuer of each collective in ``kinds`` (names of :data:`ISSUERS`), all on the one
    channel the runtime's blocks go through, and the channel's name: on gloo one
    :func:`serial_group` shared by all of them (so a reduce-scatter and an all-gather run in
    issue order with the all-reduces, as a sharded runtime's blocks would). A collective call
    on gloo (it creates the one-thread group)."""
    unknown = [k for k in kinds if k not in ISSUERS]
    if unknown:
        raise UsbyteError(f"collective {unknown[0]!r}: expected one of {'|'.join(ISSUERS)}")
    if wants_serial(group, device):
        serial = serial_group(group, timeout)
        return {k: ISSUERS[k](group, serial) for k in kinds}, \
            "gloo, one collective at a time (runtime channel)"
    return {k: ISSUERS[k](group) for k in kinds}, f"{backend_for(group, device)} process group"


def block_issuer(group: dist.ProcessGroup | None, device: torch.device,
                 timeout: timedelta | None = None) -> tuple[Callable[[torch.Tensor], dist.Work], str]:
    """What the runtime's blocks of ``device`` tensors go through (:func:`sum_issuer`), and the
    channel's name: the profiler times this, so that the cost it fits is what a block costs
    the runtime. A collective call on gloo (it creates the one-thread group)."""
    issuers, channel = block_issuers(group, device, ("all-reduce",), timeout)
    return issuers["all-reduce"], channel
