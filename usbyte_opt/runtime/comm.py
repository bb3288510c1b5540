"""The collectives of the runtime: blocks issued in order, control messages, waits.

Averaging matches DDP: each gradient is multiplied by ``1 / world_size`` as it is put into the
flat buffer (:meth:`~usbyte_opt.runtime.buffers.FlatGrads.take`, DDP's
``mul_out(bucket_view, grad, 1/world_size)``), and blocks are summed; both produce the same
floating-point values.

Streams (NCCL on CUDA). ``dist.all_reduce(..., async_op=True)`` runs on the process group's own
stream, which first waits for the *current* stream, so a block must be final on the current
stream when it is issued. Blocks are issued from the post-accumulate-grad hook or from the
autograd final callback, where the current stream is the one autograd used; a block whose
tensors were finished on other streams makes the current stream wait for those first.
``work.wait()`` on NCCL makes the current stream wait for the collective (no host wait), so
work queued after it reads the reduced values. The flat buffers live as long as the
optimizer, so the caching allocator never hands their memory to anything else. NCCL timeouts
are left to the process group's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``); a host-side
timeout would need a blocking wait. On gloo, waits block the host and take the ``timeout``
given to :class:`~usbyte_opt.runtime.DistributedOptimizer`; a timeout or a lost peer becomes a
one-line :class:`~usbyte_opt.errors.DistributedError`.

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

Control messages (the per-step usage map) go through a gloo group of their own
(:meth:`Channel.control_all_reduce`) on host tensors: they never queue behind the blocks on
the NCCL stream, never move to the device, and are read on the host when needed.

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

import torch
import torch.distributed as dist

from ..errors import UsbyteError
from .checks import wait as _wait

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

    opts = dist.ProcessGroupGloo._Options()
    opts._threads = threads
    kind, names = gloo_address(os.environ, _host_address(), _store_host(), _route_to)
    create = dist.ProcessGroupGloo.create_device
    opts._devices = ([create(interface=i) for i in names] if kind == "interface" else
                     [create(hostname=a) for a in names] if kind == "hostname" else
                     [dist.ProcessGroupGloo.create_default_device()])
    opts._timeout = timeout if timeout is not None else c10d.default_pg_timeout
    name = "default" if group is None else c10d._get_process_group_name(group)
    store = dist.PrefixStore(f"usbyte-{tag}/{name}/{next(_SERIAL_IDS)}", c10d._get_default_store())
    return dist.ProcessGroupGloo(store, dist.get_rank(group), dist.get_world_size(group), opts)


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
    if serial is not None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return lambda x: serial.allreduce([x], opts)
    return lambda x: dist.all_reduce(x, group=group, async_op=True)


def block_issuer(group: dist.ProcessGroup | None, device: torch.device,
                 timeout: timedelta | None = None) -> tuple[Callable[[torch.Tensor], dist.Work], str]:
    """What the runtime's blocks of ``device`` tensors go through (:func:`sum_issuer`), and the
    channel's name: the profiler times this, so that the cost it fits is what a block costs
    the runtime. A collective call on gloo (it creates the one-thread group)."""
    if wants_serial(group, device):
        return sum_issuer(group, serial_group(group, timeout)), \
            "gloo, one collective at a time (runtime channel)"
    return sum_issuer(group), f"{backend_for(group, device)} process group"


def _closed(x: torch.Tensor) -> dist.Work:
    raise UsbyteError("all-reduce on a closed DistributedOptimizer: create a new one to train on")


class Channel:
    """Issues and waits for the collectives of one :class:`DistributedOptimizer`.

    A collective call on more than one rank: it creates the gloo groups below, so every rank
    of ``group`` constructs its channels in the same order.

    Args:
        group: the process group (``None``: the default group).
        device: the device of the gradients.
        timeout: host-side wait limit (gloo); ``None`` keeps the process group's own.
        serial: blocks one at a time through :func:`serial_group` (``None``: on gloo with more
            than one rank).
    """

    __slots__ = ("group", "rank", "world_size", "device", "cuda", "timeout", "host_timeout",
                 "serial", "control", "_issue")

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 timeout: timedelta | None, serial: bool | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.cuda = device.type == "cuda"
        # CUDA gradients: waits are stream waits, a host-side limit would turn them into host
        # waits (the backend may be "nccl" or "cpu:gloo,cuda:nccl"; either way the gradients'
        # device decides).
        self.timeout = None if self.cuda else timeout
        #: The limit of host waits on the gloo groups (control messages), on any device.
        self.host_timeout = timeout
        if serial is None:
            serial = wants_serial(group, device)
        #: The one-thread gloo group the blocks go through, or None (blocks on ``group``).
        self.serial = serial_group(group, timeout) if serial else None
        #: The gloo group of the control messages (host tensors), or None on one rank.
        self.control = (serial_group(group, timeout, threads=2, tag="control")
                        if self.world_size > 1 else None)
        self._issue = sum_issuer(group, self.serial)

    def all_reduce_block(self, view: torch.Tensor, streams: Sequence[torch.cuda.Stream] = ()) -> dist.Work:
        """Sum ``view`` over the ranks, asynchronously (its gradients are already scaled by
        ``1 / world_size``). ``streams``: CUDA streams the block's gradients were finished on,
        which the current stream waits for first."""
        if streams:
            cur = torch.cuda.current_stream(self.device)
            for s in streams:
                if s != cur:
                    cur.wait_stream(s)
        return self._issue(view)

    def control_all_reduce(self, t: torch.Tensor,
                           op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dist.Work | None:
        """Reduce a host tensor over the ranks (sum, or ``op``) on the control group (``None``
        on one rank)."""
        if self.control is None:
            return None
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.control.allreduce([t], opts)

    def control_broadcast(self, t: torch.Tensor) -> dist.Work | None:
        """Rank 0's host tensor to every rank, on the control group (``None`` on one rank)."""
        if self.control is None:
            return None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.control.broadcast([t], opts)

    def broadcast(self, t: torch.Tensor) -> dist.Work:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        return dist.broadcast(t, src, group=self.group, async_op=True)

    def close(self) -> None:
        """Release the gloo groups (their destructors join their worker threads): call once
        nothing is in flight. Later blocks raise :class:`~usbyte_opt.errors.UsbyteError`."""
        self._issue = _closed
        self.serial = None
        self.control = None

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` (a stream wait on NCCL, a host wait with timeout on gloo)."""
        _wait(work, what, self.rank, self.timeout)

    def wait_host(self, work: dist.Work, what: str) -> None:
        """Wait on the host for a control message (gloo, with the timeout)."""
        _wait(work, what, self.rank, self.host_timeout)
