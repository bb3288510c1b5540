"""The in-memory types of the two file formats: profiles and schedules (docs/design.md §4).

Frozen dataclasses with slots: the planner reads their attributes in hot loops, so they stay
plain. How a *file* maps to them, both ways, with what it may hold (types, bounds, the JSON
Schema), is defined once in :mod:`usbyte_opt.formats.schema`; objects built in code are
checked when they are written. Digests and fingerprints are computed here, digests from the
file value, which is built here too (:func:`profile_json`, :func:`schedule_json`; the schema
checks it when writing, :func:`~usbyte_opt.formats.schema.dump_profile`), so this module
imports nothing of the schema.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..errors import FormatError, MismatchError

PROFILE_FORMAT = "usbyte-profile"
SCHEDULE_FORMAT = "usbyte-schedule"
VERSION = 1

#: Bytes per element of the dtypes a gradient can have (names as ``str(torch.dtype)`` minus
#: the ``torch.`` prefix, so the runtime can compute the same fingerprint from a live model).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
}

COMM_BACKENDS = ("nccl", "gloo", "analytic", "mpi", "ucc")

class _FileValue(str, Enum):
    """A value of a file's field: the member is its string (``str(m)`` and ``f"{m}"`` give
    it), with a ``note`` that says what it means."""

    note: str

    def __new__(cls, value: str, note: str = "") -> _FileValue:
        member = str.__new__(cls, value)
        member._value_ = value
        member.note = note
        return member

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Mode(_FileValue):
    """How the runtime applies a schedule's updates.

    ``OVERLAP``: each tensor's update right before its first use in the next forward, so
    communication overlaps that forward. ``FENCE``: every block waited for, then every update,
    then the next forward, as DDP. ``SHARDED``: ZeRO-1, each block reduce-scattered instead of
    all-reduced, each rank steps its shard of every block (the optimizer state is sharded), and
    the updated shards are all-gathered from ``step()`` on, each tensor's waited for right
    before its first use in the next forward (docs/runtime.md); in the order and groups of
    :attr:`Schedule.gathers`. The planner models all three
    (:data:`usbyte_opt.planning.simulate.MODES`). A mode is its
    file value as a string (``Mode.FENCE == "fence"``, ``str(Mode.FENCE) == "fence"``), so
    that messages and files read alike. Each member is one line: its file value and its
    :attr:`note` (what the JSON Schema says of the mode); the modes a file may give are
    exactly these.

    Example::

        >>> Mode("fence") is Mode.FENCE, f"{Mode.OVERLAP}", [str(m) for m in Mode]
        (True, 'overlap', ['overlap', 'fence', 'sharded'])
        >>> Mode.FENCE.note
        'all blocks, then all updates (as DDP)'
    """

    OVERLAP = "overlap", "each update right before its first use in the next forward"
    FENCE = "fence", "all blocks, then all updates (as DDP)"
    SHARDED = "sharded", ("ZeRO-1: blocks reduce-scattered, each rank steps its shard, "
                          "parameters all-gathered, each before its first use in the next "
                          "forward")


#: The modes' file values, in :class:`Mode` order.
SCHEDULE_MODES = tuple(m.value for m in Mode)


class Runner(_FileValue):
    """What runs a schedule's blocks, and so what host cost it pays (docs/planner.md, "Host
    cost"): the usbyte-opt runtime (``RUNTIME``, the default: a file without ``runner`` is
    read as it) or torch DDP's reducer with the planned buckets (``DDP``: the schedule's blocks
    are DDP's buckets, given to DDP as :meth:`Schedule.bucket_cap_mb_list`). Only a schedule
    that DDP can express may name ``DDP`` (:func:`ddp_buckets`): fence mode, one buffer (one
    dtype), whole tensors, blocks in the buffer's (gradient-ready) order. A runner is its file
    value as a string, as :class:`Mode` is.

    Example::

        >>> Runner("ddp") is Runner.DDP, str(Runner.RUNTIME), [str(r) for r in Runner]
        (True, 'runtime', ['runtime', 'ddp'])
    """

    RUNTIME = "runtime", "the usbyte-opt runtime (DistributedOptimizer)"
    DDP = "ddp", ("torch DDP's reducer with the planned buckets (bucket_cap_mb_list): fence "
                  "mode, one dtype, whole tensors, blocks in the buffer's order")


#: The runners' file values, in :class:`Runner` order.
SCHEDULE_RUNNERS = tuple(r.value for r in Runner)
#: Bytes in a MiB, DDP's unit of ``bucket_cap_mb``.
MIB = 1 << 20


# --------------------------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One trainable tensor of a profile (docs/design.md §2.1, §4.1)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ready_ms: float
    """Offset from the start of backward at which ``p.grad`` is final."""
    need_ms: float
    """Offset from the start of forward at which the tensor is first used."""
    update_ms: float = 0.0
    """Optimizer step cost for this tensor."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """Fitted cost of one kind of collective other than all-reduce (reduce-scatter, all-gather)
    on the process group: ``c(b) = alpha_ms + b / (algbw_gbs * 1e6)``, where ``b`` is the whole
    (unsharded) block's bytes, as for all-reduce, so that the lines compare directly.

    Example::

        >>> CollectiveCost(0.4, 2.0).samples
        ()
    """

    alpha_ms: float
    algbw_gbs: float
    """Bytes of the whole block over time, GB/s."""
    samples: tuple[tuple[int, float], ...] = ()
    """Measured medians ``(bytes, ms)``, optional."""


@dataclass(frozen=True, slots=True)
class CommSpec:
    """All-reduce cost of the process group: ``c(b) = alpha_ms + b / (algbw_gbs * 1e6)``; and,
    optionally, the reduce-scatter and all-gather lines of sharded data parallel."""

    backend: str
    world_size: int
    alpha_ms: float
    algbw_gbs: float
    samples: tuple[tuple[int, float], ...] = ()
    """Raw measurements ``(bytes, ms)``, optional."""
    cpu_ms_per_block: float = 0.0
    """Training-thread time one all-reduce costs while compute runs (its hook, the issue, the
    backend's polling on a shared core), optional: the planner's compute-cost option."""
    cpu_ms_per_mb: float = 0.0
    """Training-thread time per MB all-reduced while compute runs, optional (same option)."""
    reduce_scatter: CollectiveCost | None = None
    """Measured reduce-scatter cost (``b`` bytes in, ``b / world_size`` out per rank), optional:
    ``None`` where not measured (every profile before sharded sweeps)."""
    all_gather: CollectiveCost | None = None
    """Measured all-gather cost (a shard in, ``b`` bytes out), optional as ``reduce_scatter``."""
    nodes: int = 1
    """Nodes the ranks are on (torchrun's ``--nnodes``), each with :attr:`ranks_per_node`
    ranks; ``1`` in every profile before topology was recorded (a single-node world)."""
    intra: CollectiveCost | None = None
    """All-reduce cost on the ranks of one node (``ranks_per_node`` of them), ``b`` the whole
    block's bytes; measured when there are several nodes of several ranks, else ``None``."""
    inter: CollectiveCost | None = None
    """All-reduce cost on one rank per node (``nodes`` of them), measured alone (the other
    ranks idle), as ``intra``."""

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node (``world_size // nodes``).

        Example::

            >>> CommSpec("nccl", 16, 1.0, 5.0, nodes=2).ranks_per_node
            8
        """
        return self.world_size // max(self.nodes, 1)

    @property
    def hierarchical(self) -> bool:
        """Whether a block can be all-reduced hierarchically: several nodes, several ranks on
        each (reduce-scatter inside the node, all-reduce across nodes, all-gather inside).

        Example::

            >>> CommSpec("nccl", 16, 1.0, 5.0, nodes=2).hierarchical
            True
            >>> CommSpec("nccl", 2, 1.0, 5.0, nodes=2).hierarchical   # one rank per node
            False
        """
        return self.nodes > 1 and self.ranks_per_node > 1


@dataclass(frozen=True, slots=True)
class HostCost:
    """What the host pays per iteration to run a plan, beyond the plain training loop, in µs
    (the profile's optional ``host`` section, docs/profiles.md): per trainable tensor and per
    block (all-reduce) of the usbyte-opt runtime, and per tensor and per bucket of torch DDP,
    measured by ``usbyte-opt profile`` on the profiling ranks
    (:mod:`usbyte_opt.profiler.host`); and whether the iteration is ``launch_bound`` (its
    host time at least its device time; always on CPU, where the host computes), i.e.
    whether the host's cost lies on the critical path. The planner charges it
    (docs/planner.md, "Host cost").

    A profile file without the section reads with :meth:`default` (``defaulted`` set), which
    is not written back, so such a profile keeps its bytes and its digest.

    Example::

        >>> h = HostCost.default("cuda (V100-class, rescaled)")
        >>> h.runtime_tensor_us > h.ddp_tensor_us, h.launch_bound, h.defaulted
        (True, False, True)
        >>> HostCost.default("cpu").launch_bound
        True
    """

    runtime_tensor_us: float
    """The runtime's host time per trainable tensor per iteration (its post-accumulate-grad
    hook and bookkeeping)."""
    runtime_block_us: float
    """The runtime's host time per block per iteration (issuing one asynchronous all-reduce,
    waiting for it)."""
    ddp_tensor_us: float
    """torch DDP's host time per trainable tensor per iteration (its C++ reducer's hook)."""
    ddp_bucket_us: float
    """torch DDP's host time per bucket per iteration."""
    launch_bound: bool
    """Whether the host's time is on the critical path: on CUDA, the real model's host time
    per iteration at least its GPU time; ``True`` on CPU."""
    method: str = ""
    """How it was measured."""
    defaulted: bool = False
    """Not measured: the documented defaults of a profile without the section
    (:meth:`default`); not written to a file."""

    @classmethod
    def default(cls, device: Any = None) -> HostCost:
        """The costs a profile without a ``host`` section is planned with: the runtime's and
        DDP's, as :mod:`usbyte_opt.profiler.host` measured them on this project's development
        machine (:data:`DEFAULT_HOST_US`: x86_64, 2 shared cores, gloo, torch 2.13, one rank,
        the median of 3 runs); ``launch_bound`` false on a profile of CUDA (its ``meta.device``
        starts with ``cuda``: the host runs ahead of the GPU), true otherwise."""
        on_cuda = isinstance(device, str) and device.startswith("cuda")
        return cls(**DEFAULT_HOST_US, launch_bound=not on_cuda,
                   method="defaults (no host section): usbyte_opt.profiler.host on the project's "
                          "2-core development CPU; launch_bound from meta.device",
                   defaulted=True)


#: The per-tensor and per-block costs (µs) of :meth:`HostCost.default`, measured by
#: :func:`usbyte_opt.profiler.host.host_cost` on this project's development machine (x86_64,
#: 2 shared cores, load average about 3, gloo, torch 2.13.0+cpu, one rank, one thread): the
#: median of 3 runs (runtime 10.4–11.8 µs per tensor and 30.8–34.7 µs per block, DDP
#: 5.3–8.1 µs per tensor and 21.2–22.6 µs per bucket).
DEFAULT_HOST_US: dict[str, float] = {
    "runtime_tensor_us": 10.5,
    "runtime_block_us": 34.0,
    "ddp_tensor_us": 7.4,
    "ddp_bucket_us": 22.1,
}


@dataclass(frozen=True, slots=True)
class Profile:
    """Per-tensor timing of one model on one cluster; the planner's only input."""

    name: str
    forward_ms: float
    backward_ms: float
    tensors: tuple[TensorSpec, ...]
    comm: CommSpec
    meta: Mapping[str, Any] = field(default_factory=dict)
    host: HostCost | None = None
    """The host's cost per tensor and per block of the runtime and of DDP. ``None`` (a
    profile built in code without it): none charged; a profile *file* without the section
    reads with :meth:`HostCost.default`."""

    def digest(self) -> str:
        """Content digest (16 hex digits) of the canonical JSON; schedules record it."""
        return _digest(profile_json(self))

    def fingerprint(self) -> str:
        """Digest of the sorted ``(name, shape, dtype)`` of the tensors (see :func:`fingerprint`)."""
        return fingerprint((t.name, t.shape, t.dtype) for t in self.tensors)

    def with_comm(self, comm: CommSpec) -> Profile:
        return Profile(self.name, self.forward_ms, self.backward_ms, self.tensors, comm, self.meta,
                       self.host)

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class Buffer:
    """One flat gradient buffer: its dtype and the tensors in layout order."""

    dtype: str
    tensors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Block:
    """A contiguous element range ``[start, end)`` of buffer ``buffer``: one all-reduce, flat
    on the whole group, or with ``hier`` hierarchical (reduce-scatter inside each node,
    all-reduce across the nodes, all-gather inside; :attr:`Schedule.nodes` says the nodes)."""

    buffer: int
    start: int
    end: int
    hier: bool = False


@dataclass(frozen=True, slots=True)
class Schedule:
    """A plan: buffer layout plus blocks in issue order (docs/design.md §4.2)."""

    strategy: str
    profile_name: str
    profile_digest: str
    fingerprint: str
    world_size: int
    buffers: tuple[Buffer, ...]
    blocks: tuple[Block, ...]
    predicted: Mapping[str, Any] = field(default_factory=dict)
    buffer_numel: tuple[int, ...] = ()
    """Total elements of each buffer (extra field, lets a schedule be checked on its own)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields the file has and this class does not (``comm``, ``info``, any unknown one),
    kept so that a round trip loses nothing."""
    mode: Mode = Mode.OVERLAP
    """How the runtime applies the updates (a file value such as ``"fence"`` is taken too)."""
    shapes: Mapping[str, tuple[int, ...]] | None = None
    """Every tensor's shape, by name (optional field ``shapes``), so that the runtime can name
    the exact tensor whose shape differs from the model's; ``None`` where a file has none."""
    gathers: tuple[tuple[int, ...], ...] | None = None
    """Sharded mode only (optional field ``gathers``): the all-gathers of the updated
    parameters in issue order, each the indices of the blocks whose shards it gathers together;
    every block in exactly one. ``None``: one all-gather per block, in reverse block order
    (:meth:`gather_groups`)."""
    model: str | None = None
    """The model it was planned for (optional field ``model``: the profile's ``meta.model``,
    else its name), so that a schedule given to another model says which it fits; ``None``
    where a file has none."""
    nodes: int = 1
    """Nodes of :attr:`world_size` ranks, ``world_size // nodes`` on each (optional field
    ``nodes``): what the hierarchical blocks (:attr:`Block.hier`) group ranks by. ``1``: one
    node, every block flat."""
    runner: Runner = Runner.RUNTIME
    """What runs it (optional field ``runner``, default ``"runtime"``): the usbyte-opt runtime,
    or torch DDP's reducer with the planned buckets (:class:`Runner`); a file naming ``"ddp"``
    also holds :meth:`bucket_cap_mb_list` as ``bucket_cap_mb_list``."""
    cut_pieces: tuple[int, ...] | None = None
    """Compiled training only (optional field ``cut_pieces``): the plan's pieces (tensors
    grouped by the first and last block holding them, numbered in issue order:
    :func:`usbyte_opt.planning.compiled.plan_pieces`) before which the runtime cuts a compiled
    graph; the others join the piece before them. ``None``: a cut before every piece."""
    path: str | None = field(default=None, compare=False, repr=False)
    """The file it was read from (:func:`~usbyte_opt.formats.load_schedule`), for messages;
    not part of the file."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "runner", Runner(self.runner))
        if self.gathers is not None:
            object.__setattr__(self, "gathers", tuple(tuple(int(k) for k in g)
                                                      for g in self.gathers))
        if self.cut_pieces is not None:
            object.__setattr__(self, "cut_pieces", tuple(int(k) for k in self.cut_pieces))

    def gather_groups(self) -> tuple[tuple[int, ...], ...]:
        """The all-gathers of sharded mode, in issue order: :attr:`gathers`, or by default one
        per block in reverse block order (blocks are issued in backward order, so the reverse
        is about the order the next forward needs them).

        Example::

            >>> s = Schedule("s", "p", "0" * 16, "f" * 16, 2, (Buffer("float32", ("a",)),),
            ...              (Block(0, 0, 4), Block(0, 4, 8)), mode="sharded")
            >>> s.gather_groups()
            ((1,), (0,))
        """
        if self.gathers is not None:
            return self.gathers
        return tuple((k,) for k in reversed(range(len(self.blocks))))

    def digest(self) -> str:
        """Digest of what every rank must agree on: layout and blocks (not predictions)."""
        d = schedule_json(self)
        agreed = {"buffers": d["buffers"], "blocks": d["blocks"], "fp": self.fingerprint}
        if self.mode is not Mode.OVERLAP:  # the default mode is left out: it adds nothing to agree on
            agreed["mode"] = str(self.mode)
        if "gathers" in d:
            agreed["gathers"] = d["gathers"]
        if self.hierarchical:  # left out without hierarchy: such a digest is as before
            agreed["nodes"] = self.nodes
        if self.runner is not Runner.RUNTIME:  # likewise: a runtime schedule's digest is as before
            agreed["runner"] = str(self.runner)
        return _digest(agreed)

    def bucket_cap_mb_list(self, source: str = "<schedule>") -> list[float]:
        """The ``bucket_cap_mb_list`` that makes torch DDP rebuild exactly this schedule's
        blocks as its buckets, in DDP's bucket order (the blocks' order): bucket ``i`` of
        ``S`` bytes gets a cap of ``S - 1/2`` bytes in MiB, which DDP reads as ``S - 1``
        bytes (``int(cap * 1024 * 1024)``), so it closes right after its last tensor and not
        before (a tensor is at least 2 bytes). A one-line
        :class:`~usbyte_opt.errors.FormatError` where DDP cannot express the schedule
        (:func:`ddp_buckets`).

        Example::

            >>> s = Schedule("t", "p", "0" * 16, "f" * 16, 2, (Buffer("float32", ("a", "b")),),
            ...              (Block(0, 0, 4), Block(0, 4, 12)), mode="fence",
            ...              shapes={"a": (4,), "b": (8,)}, runner="ddp")
            >>> [int(c * MIB) for c in s.bucket_cap_mb_list()]     # 16 and 32 bytes, less one
            [15, 31]
        """
        size = DTYPE_SIZES[self.buffers[0].dtype] if self.buffers else 4
        return [(nbytes - 0.5) / MIB for nbytes in
                (sum(_numel(self.shapes or {}, n) for n in names) * size
                 for names in ddp_buckets(self, source))]

    @property
    def hierarchical(self) -> bool:
        """Whether any block is hierarchical (:attr:`Block.hier`).

        Example::

            >>> s = Schedule("s", "p", "0" * 16, "f" * 16, 4, (Buffer("float32", ("a",)),),
            ...              (Block(0, 0, 4, hier=True), Block(0, 4, 8)), nodes=2)
            >>> s.hierarchical, s.ranks_per_node
            (True, 2)
        """
        return any(k.hier for k in self.blocks)

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node (``world_size // nodes``)."""
        return self.world_size // max(self.nodes, 1)


def _numel(shapes: Mapping[str, Sequence[int]], name: str) -> int:
    n = 1
    for d in shapes.get(name, ()):
        n *= int(d)
    return n


def ddp_buckets(schedule: Schedule, source: str = "<schedule>", field: str = "runner") -> list[list[str]]:
    """The schedule's blocks as torch DDP's buckets (tensor names, in gradient-ready order),
    or a one-line :class:`~usbyte_opt.errors.FormatError` naming ``source`` and the field
    that says why DDP cannot express it: DDP steps after its last bucket (fence mode), sizes
    every dtype's buckets with one list (one buffer), adds tensors whole and all-reduces its
    buckets in the order their gradients become ready (each block starts where the one
    before it ended, on a tensor boundary; the buffer holds its tensors in ready order). The
    errors of the mode and the buffers name ``field`` (the runner that asks for DDP).

    Example::

        >>> s = Schedule("t", "p", "0" * 16, "f" * 16, 2, (Buffer("float32", ("a", "b")),),
        ...              (Block(0, 0, 6), Block(0, 6, 12)), mode="fence",
        ...              shapes={"a": (4,), "b": (8,)})
        >>> ddp_buckets(s, "s.json")
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.FormatError: s.json: blocks[0]: expected whole tensors (DDP cannot ...), got [0, 6) ...
    """
    if schedule.mode != Mode.FENCE:
        raise FormatError(source, field, f"\"{Runner.RUNTIME}\" in {schedule.mode} mode (torch DDP "
                          "steps after its last bucket: fence mode only)", str(Runner.DDP))
    if len(schedule.buffers) != 1:
        raise FormatError(source, field, f"\"{Runner.RUNTIME}\" with {len(schedule.buffers)} buffers "
                          f"({', '.join(b.dtype for b in schedule.buffers)}): torch DDP sizes every "
                          "dtype's buckets with one list, so it runs one buffer", str(Runner.DDP))
    shapes = schedule.shapes
    if shapes is None:
        raise FormatError(source, "shapes", "the per-tensor shapes, which say where DDP's buckets "
                          "end (schedules written by `usbyte-opt optimize` record them)")
    buf = schedule.buffers[0]
    ends: dict[int, int] = {}     # element offset where each tensor ends -> its index
    starts: dict[int, int] = {}
    off = 0
    for i, name in enumerate(buf.tensors):
        starts[off] = i
        off += _numel(shapes, name)
        ends[off] = i
    pos = 0
    out: list[list[str]] = []
    for k, blk in enumerate(schedule.blocks):
        if blk.start != pos:
            raise FormatError(source, f"blocks[{k}]", f"a block starting at element {pos} (torch "
                              "DDP all-reduces its buckets in gradient-ready order, so blocks "
                              "follow the buffer's order)", _Raw(f"start {blk.start}"))
        if blk.start not in starts or blk.end not in ends:
            raise FormatError(source, f"blocks[{k}]", "whole tensors (DDP cannot cut a tensor)",
                              _Raw(f"[{blk.start}, {blk.end}) which cuts one"))
        if blk.hier:
            raise FormatError(source, f"blocks[{k}].hier", "false (torch DDP all-reduces its "
                              "buckets on the whole group)", True)
        out.append(list(buf.tensors[starts[blk.start]: ends[blk.end] + 1]))
        pos = blk.end
    return out


class _Raw(str):
    """A value shown in a :class:`~usbyte_opt.errors.FormatError` as it is (no quotes)."""

    def __repr__(self) -> str:
        return str(self)


def check_runner(schedule: Schedule, caps: Sequence[Any] | None, source: str) -> None:
    """A schedule that names torch DDP as its runner is one DDP can express
    (:func:`ddp_buckets`), and ``caps``, the file's ``bucket_cap_mb_list`` if it has one, gives
    DDP exactly its blocks: each cap, in bytes as DDP reads it (``int(cap * 1024 * 1024)``),
    at least the bucket's bytes less its last tensor's and below its bytes, so that the bucket
    closes after its last tensor and not before. ``caps`` without that runner is refused."""
    if schedule.runner is not Runner.DDP:
        if caps is not None:
            raise FormatError(source, "bucket_cap_mb_list", f"no bucket list unless runner is "
                              f"\"{Runner.DDP}\" (runner \"{schedule.runner}\")")
        return
    buckets = ddp_buckets(schedule, source)
    if caps is None:
        return
    if len(caps) != len(buckets):
        raise FormatError(source, "bucket_cap_mb_list", f"one cap per block ({len(buckets)})",
                          _Raw(f"{len(caps)} caps"))
    shapes = schedule.shapes or {}
    size = DTYPE_SIZES[schedule.buffers[0].dtype]
    for i, (cap, names) in enumerate(zip(caps, buckets)):
        nbytes = [_numel(shapes, n) * size for n in names]
        total = sum(nbytes)
        got = int(cap * MIB) if isinstance(cap, (int, float)) and math.isfinite(cap) else -1
        if not total - nbytes[-1] <= got < total:
            raise FormatError(source, f"bucket_cap_mb_list[{i}]", f"a cap that closes block {i} "
                              f"after its last tensor ({total - nbytes[-1]} to {total - 1} bytes, "
                              f"e.g. {(total - 0.5) / MIB!r})", cap)


# --------------------------------------------------------------------------------------------
# Digests
# --------------------------------------------------------------------------------------------


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(tensors: Iterable[tuple[str, Sequence[int], str]]) -> str:
    """Digest of the sorted ``(name, shape, dtype)`` triples: what a schedule was made for.

    The runtime computes the same value from ``model.named_parameters()``.

    Example::

        >>> fingerprint([("b", (2,), "float32"), ("a", [3, 4], "float32")]) == \\
        ...     fingerprint([("a", (3, 4), "float32"), ("b", [2], "float32")])
        True
    """
    rows = sorted((str(n), [int(s) for s in shape], str(dt)) for n, shape, dt in tensors)
    return _digest(rows)


# --------------------------------------------------------------------------------------------
# Checks across fields and files
# --------------------------------------------------------------------------------------------


def check_coverage(schedule: Schedule, buffer_numel: Sequence[int], source: str) -> None:
    """Raise :class:`FormatError` unless the blocks cover every buffer exactly once."""
    per: list[list[tuple[int, int, int]]] = [[] for _ in schedule.buffers]
    for i, k in enumerate(schedule.blocks):
        per[k.buffer].append((k.start, k.end, i))
    for b, spans in enumerate(per):
        spans.sort()
        pos = 0
        for s, e, i in spans:
            if s != pos:
                what = "overlaps the block before it" if s < pos else f"leaves [{pos}, {s}) uncovered"
                raise FormatError(source, f"blocks[{i}]", f"blocks covering buffer {b} exactly once; "
                                  f"this one starts at {s} and {what}")
            pos = e
        if pos != buffer_numel[b]:
            raise FormatError(source, f"buffers[{b}]", f"blocks covering all {buffer_numel[b]} "
                              f"elements; they cover [0, {pos})")


def check_against(schedule: Schedule, profile: Profile, source: str = "<schedule>") -> None:
    """Raise :class:`MismatchError` unless ``schedule`` was made for ``profile``'s tensors.

    Compares the fingerprints, then names the first differing tensor, then checks coverage
    of every buffer with the profile's sizes.
    """
    specs = {t.name: t for t in profile.tensors}
    listed = [n for b in schedule.buffers for n in b.tensors]
    for b_i, b in enumerate(schedule.buffers):
        for j, n in enumerate(b.tensors):
            if n not in specs:
                raise MismatchError(f"{source}: buffers[{b_i}].tensors[{j}]: tensor {n!r} is not "
                                    f"in profile {profile.name!r}")
            if specs[n].dtype != b.dtype:
                raise MismatchError(f"{source}: buffers[{b_i}].tensors[{j}]: tensor {n!r} has dtype "
                                    f"{specs[n].dtype} in the profile, buffer dtype is {b.dtype}")
    in_buffers = set(listed)
    missing = [n for n in specs if n not in in_buffers]
    if missing:
        raise MismatchError(f"{source}: buffers: profile tensor {missing[0]!r} is in no buffer "
                            f"({len(missing)} missing)")
    if schedule.fingerprint != profile.fingerprint():
        raise MismatchError(f"{source}: fingerprint: expected {profile.fingerprint()} (profile "
                            f"{profile.name!r}), got {schedule.fingerprint}: tensor shapes differ")
    numel = [sum(specs[n].numel for n in b.tensors) for b in schedule.buffers]
    if schedule.buffer_numel and tuple(numel) != tuple(schedule.buffer_numel):
        raise MismatchError(f"{source}: buffers: numel {list(schedule.buffer_numel)} does not match "
                            f"the profile's {numel}")
    check_coverage(schedule, numel, source)


# --------------------------------------------------------------------------------------------
# Objects as JSON values (what files hold and digests read; :mod:`.schema` checks and parses)
# --------------------------------------------------------------------------------------------


def profile_json(profile: Profile) -> dict[str, Any]:
    """The JSON value of a profile file holding ``profile``, unchecked: optional fields at
    their default are left out (:func:`usbyte_opt.formats.dump_profile` checks it too)."""
    c = profile.comm
    comm: dict[str, Any] = {"backend": c.backend, "world_size": c.world_size,
                            "alpha_ms": c.alpha_ms, "algbw_gbs": c.algbw_gbs}
    if c.samples:
        comm["samples"] = [{"bytes": b, "ms": ms} for b, ms in c.samples]
    if c.cpu_ms_per_block:
        comm["cpu_ms_per_block"] = c.cpu_ms_per_block
    if c.cpu_ms_per_mb:
        comm["cpu_ms_per_mb"] = c.cpu_ms_per_mb
    if c.nodes != 1:
        comm["nodes"] = c.nodes
    for key, cost in (("reduce_scatter", c.reduce_scatter), ("all_gather", c.all_gather),
                      ("intra", c.intra), ("inter", c.inter)):
        if cost is not None:
            comm[key] = _dump_collective(cost)
    tensors = []
    for t in profile.tensors:
        d: dict[str, Any] = {"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                             "ready_ms": t.ready_ms, "need_ms": t.need_ms}
        if t.update_ms:
            d["update_ms"] = t.update_ms
        tensors.append(d)
    out = {
        "format": PROFILE_FORMAT,
        "version": VERSION,
        "name": profile.name,
        "meta": dict(profile.meta),
        "forward_ms": profile.forward_ms,
        "backward_ms": profile.backward_ms,
        "tensors": tensors,
        "comm": comm,
    }
    h = profile.host
    if h is not None and not h.defaulted:   # defaults are not written: the file stays as read
        out["host"] = {"runtime_tensor_us": h.runtime_tensor_us,
                       "runtime_block_us": h.runtime_block_us, "ddp_tensor_us": h.ddp_tensor_us,
                       "ddp_bucket_us": h.ddp_bucket_us, "launch_bound": h.launch_bound,
                       **({"method": h.method} if h.method else {})}
    return out


def _dump_collective(cost: CollectiveCost) -> dict[str, Any]:
    out: dict[str, Any] = {"alpha_ms": cost.alpha_ms, "algbw_gbs": cost.algbw_gbs}
    if cost.samples:
        out["samples"] = [{"bytes": b, "ms": ms} for b, ms in cost.samples]
    return out


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    """The JSON value of a schedule file holding ``schedule``, unchecked: the known fields,
    then ``shapes`` where the schedule has them, then the fields of ``extra``
    (:func:`usbyte_opt.formats.dump_schedule` checks it too)."""
    buffers = []
    for i, b in enumerate(schedule.buffers):
        d: dict[str, Any] = {"dtype": b.dtype, "tensors": list(b.tensors)}
        if schedule.buffer_numel:
            d["numel"] = schedule.buffer_numel[i]
        buffers.append(d)
    out = {
        "format": SCHEDULE_FORMAT,
        "version": VERSION,
        "strategy": schedule.strategy,
        "profile": {"name": schedule.profile_name, "digest": schedule.profile_digest},
        **({"model": schedule.model} if schedule.model is not None else {}),
        "fingerprint": schedule.fingerprint,
        "world_size": schedule.world_size,
        **({"nodes": schedule.nodes} if schedule.nodes != 1 else {}),
        "mode": str(schedule.mode),
        "buffers": buffers,
        "blocks": [{"buffer": k.buffer, "start": k.start, "end": k.end,
                    **({"hier": True} if k.hier else {})} for k in schedule.blocks],
        "predicted": dict(schedule.predicted),
    }
    if schedule.shapes is not None:
        out["shapes"] = {n: list(s) for n, s in schedule.shapes.items()}
    if schedule.gathers is not None:
        out["gathers"] = [list(g) for g in schedule.gathers]
    if schedule.cut_pieces is not None:
        out["cut_pieces"] = list(schedule.cut_pieces)
    if schedule.runner is not Runner.RUNTIME:   # left out for the runtime: such a file is as before
        out["runner"] = str(schedule.runner)
        try:
            out["bucket_cap_mb_list"] = schedule.bucket_cap_mb_list()
        except FormatError:      # a schedule DDP cannot express: the check names it when written
            pass
    for k, v in schedule.extra.items():
        out.setdefault(k, v)
    return out
