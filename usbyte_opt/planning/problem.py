"""A profile compiled for planning: flat per-tensor arrays, buffer layouts, schedule building.

Strategies work on tensor indices and element ranges; this module turns those into the
schedule format and back. No torch import.

Example::

    >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
    >>> prof = Profile("toy", 2.0, 4.0, (TensorSpec("a", (10,), "float32", 1.0, 1.5),
    ...                                  TensorSpec("b", (5,), "float32", 3.0, 0.0)),
    ...                CommSpec("analytic", 2, 0.1, 1.0))
    >>> pb = Problem.from_profile(prof)
    >>> lay = pb.layout()
    >>> lay.pos[pb.index["b"]]          # ascending ready: a first, then b
    (0, 10, 15)
    >>> lay.tensors_of(0, 8, 12)        # a block across the boundary touches both
    [0, 1]
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from ..formats import Block, Buffer, Mode, Profile, Runner, Schedule, check_against, check_runner
from .cost import CostModel, cost_model


class UpdateRule(str, Enum):
    """Where the iteration model puts each tensor's optimizer update in overlap mode (fence
    mode runs the whole step on the training thread before the forward under both).

    ``AVAIL`` (the default, docs/design.md §2.5): the update delays its tensor's availability,
    ``avail_p = finish_p + update_p``, and costs nothing once the forward reaches p later.
    ``GATE``: as the runtime runs it, on the training thread in the forward pre-hook that
    first needs the tensor, together with every other pending tensor whose blocks have
    finished by then; the forward pays for every update at the gate where it runs. Under
    both, the compute cost of communication is read off the ``AVAIL`` timeline.

    Example::

        >>> UpdateRule("gate") is UpdateRule.GATE, str(UpdateRule.AVAIL)
        (True, 'avail')
    """

    AVAIL = "avail"
    GATE = "gate"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, profile: Profile) -> UpdateRule:
        """The rule the runtime follows on the ranks ``profile`` was taken on: ``GATE`` where
        it applies the updates on the host (a profile of CPU ranks, ``meta.device`` "cpu",
        or of CUDA tensors carried by gloo), ``AVAIL`` on NCCL, where a CUDA update stream
        waits for each block and the host never does, and on a profile that names no device
        (analytic and synthetic ones).

        Example::

            >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
            >>> prof = Profile("t", 2.0, 4.0, (TensorSpec("a", (10,), "float32", 1.0, 1.5),),
            ...                CommSpec("gloo", 2, 0.1, 1.0), {"device": "cpu"})
            >>> UpdateRule.of(prof), UpdateRule.of(dataclasses.replace(prof, meta={}))
            (<UpdateRule.GATE: 'gate'>, <UpdateRule.AVAIL: 'avail'>)
        """
        device = profile.meta.get("device")
        if not isinstance(device, str):
            return cls.AVAIL
        if device.startswith("cpu"):
            return cls.GATE
        if device.startswith("cuda") and profile.comm.backend == "gloo":
            return cls.GATE
        return cls.AVAIL


#: The strategies whose schedules torch DDP runs (:class:`Runner` ``DDP``).
DDP_STRATEGIES = ("ddp", "ddp-tuned")


def runner_of(strategy: str) -> Runner:
    """The :class:`~usbyte_opt.formats.Runner` of a strategy's plans (what runs the schedule,
    and so what host cost it pays, docs/planner.md "Host cost"): torch DDP's reducer for
    :data:`DDP_STRATEGIES` (stock DDP's buckets, and stock DDP with the planned buckets),
    else the usbyte-opt runtime (``best`` picks either and says which in its plan and
    schedule). ``Runner`` is the schedule format's, re-exported here.

    Example::

        >>> runner_of("ddp-tuned"), runner_of("best"), str(Runner.DDP)
        (<Runner.DDP: 'ddp'>, <Runner.RUNTIME: 'runtime'>, 'ddp')
    """
    return Runner.DDP if strategy in DDP_STRATEGIES else Runner.RUNTIME


@dataclass(frozen=True, slots=True)
class HostLine:
    """The host time one runner pays per iteration: ``tensor_ms`` per trainable tensor (its
    hook, in backward) and ``block_ms`` per block (the issue of its all-reduce), ms."""

    tensor_ms: float
    block_ms: float


@dataclass(slots=True)
class Layout:
    """Where every tensor lies: ``pos[i] = (buffer, start, end)`` in elements."""

    buffers: tuple[Buffer, ...]
    members: list[list[int]]
    """Tensor indices of each buffer, in layout order."""
    starts: list[list[int]]
    """Start offset of each member (same shape as ``members``)."""
    numel: list[int]
    itemsize: list[int]
    pos: list[tuple[int, int, int]]

    def tensors_of(self, buffer: int, start: int, end: int) -> list[int]:
        """Indices of the tensors that the element range ``[start, end)`` touches."""
        st = self.starts[buffer]
        lo = bisect_right(st, start) - 1
        hi = bisect_left(st, end)
        return self.members[buffer][max(lo, 0):hi]

    def whole(self, i: int) -> Block:
        b, s, e = self.pos[i]
        return Block(b, s, e)


#: Where NCCL's vectorised kernels want a buffer to start (bytes): the runtime puts every
#: tensor of a CUDA flat buffer there, and the planner cuts tensors on multiples of it.
NCCL_ALIGN_BYTES = 16


def align_cuts(layout: Layout, blocks: Sequence[Block], align_bytes: int) -> tuple[Block, ...]:
    """``blocks`` with every boundary inside a tensor moved to the nearest multiple of
    ``align_bytes`` from that tensor's start (a boundary that lands on the tensor's start or
    end becomes that tensor boundary). Boundaries are mapped offset by offset, so blocks that
    met still meet; a block left empty is dropped.

    Example::

        >>> from usbyte_opt.formats import Buffer
        >>> lay = Layout((Buffer("float32", ("a", "b")),), [[0, 1]], [[0, 10]], [30], [4],
        ...              [(0, 0, 10), (0, 10, 30)])
        >>> align_cuts(lay, [Block(0, 0, 13), Block(0, 13, 30)], 16)   # 3 into b -> 4
        (Block(buffer=0, start=0, end=14, hier=False), Block(buffer=0, start=14, end=30, hier=False))
    """
    def snap(b: int, o: int) -> int:
        st = layout.starts[b]
        j = bisect_right(st, o) - 1
        if j < 0 or st[j] == o:
            return o
        t = layout.members[b][j]
        lo, hi = layout.pos[t][1], layout.pos[t][2]
        if o >= hi:
            return o
        a = max(1, align_bytes // layout.itemsize[b])
        r = min(hi - lo, a * round((o - lo) / a))
        return lo + r

    out = []
    for k in blocks:
        s, e = snap(k.buffer, k.start), snap(k.buffer, k.end)
        if e > s:
            out.append(Block(k.buffer, s, e))
    return tuple(out)


@dataclass(slots=True)
class Problem:
    """The planner's view of a profile: arrays indexed by tensor, the cost model and the
    iteration model's update rule."""

    profile: Profile
    cost: CostModel
    names: list[str]
    ready: list[float]
    need: list[float]
    update: list[float]
    numel: list[int]
    itemsize: list[int]
    dtype: list[str]
    index: dict[str, int]
    B: float
    F: float
    cpu_ms_per_block: float = 0.0
    """Training-thread time per block (the profile's ``comm.cpu_ms_per_block``)."""
    cpu_ms_per_mb: float = 0.0
    """Training-thread time per MB all-reduced (the profile's ``comm.cpu_ms_per_mb``)."""
    total_bytes: int = 0
    """Bytes of all gradients (one iteration's all-reduce)."""
    update_rule: UpdateRule = UpdateRule.AVAIL
    """Where overlap mode puts the optimizer updates (:class:`UpdateRule`)."""
    host: dict[Runner, HostLine] = field(default_factory=dict)
    """Each runner's host cost (the profile's ``host`` section, µs made ms); a runner absent
    pays none (:meth:`host_line`)."""
    host_hidden: bool = False
    """Whether the host runs ahead of the device (CUDA, not launch-bound: the profile's
    ``host.launch_bound`` false), so that the host's cost counts only where it exceeds the
    compute it runs ahead of (:meth:`host_releases`)."""
    compiled: bool = False
    """Whether the profile is of a compiled model with measured cut costs (``meta.compile.cuts``):
    predictions then charge the cuts a plan's pieces need (:mod:`usbyte_opt.planning.compiled`)."""
    _ready_order: list[int] | None = None
    _need_order: list[int] | None = None
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)
    """Derived data computed once per problem (the default layout, scorers)."""

    @classmethod
    def from_profile(cls, profile: Profile, cost: CostModel | None = None,
                     update_rule: UpdateRule | None = None) -> Problem:
        """Compile ``profile``; ``cost`` defaults to the model of its ``comm``
        (:func:`usbyte_opt.planning.cost.cost_model`), ``update_rule`` to the one the runtime
        follows on the profile's device (:meth:`UpdateRule.of`)."""
        ts = profile.tensors
        numel = [t.numel for t in ts]
        itemsize = [t.itemsize for t in ts]
        h = profile.host
        host: dict[Runner, HostLine] = {}
        if h is not None:
            for runner, tensor_us, block_us in (
                    (Runner.RUNTIME, h.runtime_tensor_us, h.runtime_block_us),
                    (Runner.DDP, h.ddp_tensor_us, h.ddp_bucket_us)):
                if tensor_us > 0 or block_us > 0:
                    host[runner] = HostLine(tensor_us / 1e3, block_us / 1e3)
        return cls(
            profile=profile,
            cost=cost if cost is not None else cost_model(profile.comm),
            names=[t.name for t in ts],
            ready=[t.ready_ms for t in ts],
            need=[t.need_ms for t in ts],
            update=[t.update_ms for t in ts],
            numel=numel,
            itemsize=itemsize,
            dtype=[t.dtype for t in ts],
            index={t.name: i for i, t in enumerate(ts)},
            B=profile.backward_ms,
            F=profile.forward_ms,
            cpu_ms_per_block=profile.comm.cpu_ms_per_block,
            cpu_ms_per_mb=profile.comm.cpu_ms_per_mb,
            total_bytes=sum(n * b for n, b in zip(numel, itemsize)),
            update_rule=UpdateRule.of(profile) if update_rule is None else UpdateRule(update_rule),
            host=host,
            host_hidden=h is not None and not h.launch_bound,
            compiled=isinstance(profile.meta.get("compile"), Mapping)
            and isinstance(profile.meta["compile"].get("cuts"), Mapping),
        )

    def with_cost(self, cost: CostModel) -> Problem:
        """This problem under another cost model (same arrays, a fresh cache): e.g. the flat
        rings only of a hierarchical model (:meth:`usbyte_opt.planning.cost.HierCost.flat_only`)."""
        return dataclasses.replace(self, cost=cost, cache={})

    def with_update_rule(self, rule: UpdateRule) -> Problem:
        """This problem under another :class:`UpdateRule` (same arrays, a fresh cache)."""
        return dataclasses.replace(self, update_rule=UpdateRule(rule), cache={},
                                   _ready_order=None, _need_order=None)

    @property
    def charges_cpu(self) -> bool:
        """Whether communication costs the training thread here (the compute-cost option)."""
        return self.cpu_ms_per_block > 0 or self.cpu_ms_per_mb > 0

    def block_cpu_ms(self, nbytes: float) -> float:
        """Training-thread time one block of ``nbytes`` costs while compute runs beside it:
        ``cpu_ms_per_block + cpu_ms_per_mb * MB`` (0 without the compute-cost option). How much
        of it an iteration pays is the one rule of :mod:`usbyte_opt.planning.fastsim`.

        Example::

            >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
            >>> prof = Profile("t", 40.0, 60.0, (TensorSpec("w", (250_000,), "float32", 30.0, 20.0),),
            ...                CommSpec("gloo", 2, 0.1, 1.0, cpu_ms_per_block=0.5, cpu_ms_per_mb=10.0))
            >>> Problem.from_profile(prof).block_cpu_ms(2_000_000)     # 0.5 + 10 x 2 MB
            20.5
        """
        return self.cpu_ms_per_block + self.cpu_ms_per_mb * nbytes / 1e6

    def stretched(self, backward: float = 1.0, forward: float = 1.0) -> Problem:
        """This problem with the backward's times (``ready``, ``B``) times ``backward``, the
        forward's (``need``, ``update``, ``F``) times ``forward``, and the compute-cost option
        off: how :mod:`usbyte_opt.planning.fastsim` applies what communication cost each phase."""
        return Problem(self.profile, self.cost, self.names, [r * backward for r in self.ready],
                       [x * forward for x in self.need], [u * forward for u in self.update],
                       self.numel, self.itemsize, self.dtype, self.index, self.B * backward,
                       self.F * forward, total_bytes=self.total_bytes,
                       update_rule=self.update_rule, host=self.host,
                       host_hidden=self.host_hidden)

    # -- host cost (docs/planner.md, "Host cost") ---------------------------------------------

    def host_line(self, runner: Runner | str = Runner.RUNTIME) -> HostLine | None:
        """What ``runner`` pays on the host (``None``: nothing here)."""
        return self.host.get(Runner(runner))

    @property
    def charges_host(self) -> bool:
        """Whether any runner pays host cost here."""
        return bool(self.host)

    def ready_sorted(self) -> np.ndarray:
        """The ready times, ascending (kept in :attr:`cache`)."""
        hit = self.cache.get("ready-sorted")
        if hit is None:
            hit = self.cache["ready-sorted"] = np.sort(np.asarray(self.ready, dtype=float))
        return hit

    def host_releases(self, R: np.ndarray, runner: Runner | str = Runner.RUNTIME,
                      stretch: float = 1.0) -> np.ndarray:
        """When each block (``R``: the last ready time of its tensors, blocks in issue order)
        can start on the channel once ``runner`` has paid its host cost, backward's compute
        times ``stretch`` (the compute-cost option).

        Block k is issued, in order, at ``P_k = max_{j<=k} R_j``: in the hook of the tensor
        that makes it and every block before it ready. By then the host has run the hook of
        every tensor ready by ``P_k`` and issued blocks ``0..k``, so
        ``D_k = tensor_ms * #{p : ready_p <= P_k} + block_ms * (k + 1)`` and the block starts
        at ``stretch * P_k + D_k``; with :attr:`host_hidden` (the host runs ahead of the
        device) at ``max(stretch * P_k, D_k)``. Without host cost: ``stretch * R``.

        Example (three tensors ready at 3, 2, 1 ms; 0.1 ms per tensor, 0.5 per block)::

            >>> from usbyte_opt.planning.synthetic import chain_profile
            >>> pb = Problem.from_profile(chain_profile([10, 10, 10], 3.0, 3.0, compute=[1, 1, 1]))
            >>> pb.host = {Runner.RUNTIME: HostLine(0.1, 0.5)}
            >>> pb.ready
            [3.0, 2.0, 1.0]
            >>> pb.host_releases(np.array([1.0, 3.0])).round(6).tolist()  # 1 + 0.1 + 0.5; 3 + 0.3 + 1
            [1.6, 4.3]
            >>> round(pb.host_backward(2), 6)     # 3 + 3 x 0.1 + 2 x 0.5
            4.3
            >>> pb.host_hidden = True             # the host runs ahead: only what exceeds compute
            >>> pb.host_releases(np.array([1.0, 3.0])).round(6).tolist(), pb.host_backward(2)
            ([1.0, 3.0], 3.0)
        """
        h = self.host_line(runner)
        if h is None:
            return R * stretch if stretch != 1.0 else R
        P = np.maximum.accumulate(R)
        D = h.tensor_ms * np.searchsorted(self.ready_sorted(), P, side="right") \
            + h.block_ms * np.arange(1, len(R) + 1)
        return np.maximum(P * stretch, D) if self.host_hidden else P * stretch + D

    def host_backward(self, blocks: int, runner: Runner | str = Runner.RUNTIME,
                      stretch: float = 1.0) -> float:
        """When backward ends with ``runner``'s host cost for ``blocks`` blocks (all issued in
        backward's hooks): ``stretch * B + n * tensor_ms + blocks * block_ms``, or with
        :attr:`host_hidden` the larger of the two terms; ``stretch * B`` without host cost."""
        h = self.host_line(runner)
        B = self.B * stretch
        if h is None:
            return B
        D = self.n * h.tensor_ms + blocks * h.block_ms
        return max(B, D) if self.host_hidden else B + D

    def host_floor(self, runner: Runner | str | None = None) -> Problem:
        """This problem with each tensor's ready time and backward's end raised by the least
        host cost any plan of ``runner`` pays (``None``: of either runner, each cost per
        tensor and per block the smaller of the two runners'; a runner without cost: 0), and
        no host cost left: the tensor ready at ``r`` raised by
        ``tensor_ms * #{p : ready_p <= r} + block_ms`` (its block is issued after those hooks
        and at least its own issue), backward's end by ``n * tensor_ms + block_ms`` (at least
        one block); with :attr:`host_hidden`, each the larger of the time and the host's.
        Every such plan's host-charged releases and backward end are at least these, and the
        iteration never gets shorter when they grow, so the lower bound of the result bounds
        every such plan (:func:`usbyte_opt.planning.bounds.lower_bound`). Kept in
        :attr:`cache`; the problem itself without host cost."""
        if not self.host:
            return self
        key = ("host-floor", None if runner is None else Runner(runner))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        lines = [self.host.get(r, HostLine(0.0, 0.0))
                 for r in (Runner if runner is None else (Runner(runner),))]
        t = min(h.tensor_ms for h in lines)
        b = min(h.block_ms for h in lines)
        r = np.asarray(self.ready, dtype=float)
        D = t * np.searchsorted(self.ready_sorted(), r, side="right") + b
        ready = (np.maximum(r, D) if self.host_hidden else r + D).tolist()
        DB = self.n * t + b
        B = max(self.B, DB) if self.host_hidden else self.B + DB
        floor = dataclasses.replace(self, ready=ready, B=B, host={}, cache={},
                                    _ready_order=None, _need_order=None)
        self.cache[key] = floor
        return floor

    @property
    def n(self) -> int:
        return len(self.names)

    def nbytes(self, i: int) -> int:
        return self.numel[i] * self.itemsize[i]

    def ready_order(self) -> list[int]:
        """Tensor indices by ascending ready time (ties: profile order); a new list each call,
        sorted once per problem."""
        if self._ready_order is None:
            self._ready_order = sorted(range(self.n), key=lambda i: (self.ready[i], i))
        return list(self._ready_order)

    def need_order(self) -> list[int]:
        """Tensor indices by ascending need time, i.e. forward order (ties: reverse ready); a
        new list each call, sorted once per problem."""
        if self._need_order is None:
            self._need_order = sorted(range(self.n),
                                      key=lambda i: (self.need[i], -self.ready[i], i))
        return list(self._need_order)

    def default_buffers(self, order: Sequence[int] | None = None) -> tuple[Buffer, ...]:
        """One buffer per dtype, tensors in ``order`` (default: ascending ready)."""
        order = self.ready_order() if order is None else order
        groups: dict[str, list[str]] = {}
        for i in order:
            groups.setdefault(self.dtype[i], []).append(self.names[i])
        return tuple(Buffer(dt, tuple(ns)) for dt, ns in groups.items())

    def layout(self, buffers: Sequence[Buffer] | None = None) -> Layout:
        """Where every tensor lies in ``buffers`` (default: :meth:`default_buffers`, built
        once per problem and shared: callers only read a layout)."""
        if buffers is None:
            if "layout" not in self.cache:
                self.cache["layout"] = self._layout(self.default_buffers())
            return self.cache["layout"]
        return self._layout(tuple(buffers))

    def _layout(self, buffers: tuple[Buffer, ...]) -> Layout:
        members, starts, numel, itemsize = [], [], [], []
        pos: list[tuple[int, int, int]] = [(-1, 0, 0)] * self.n
        for b, buf in enumerate(buffers):
            idx = [self.index[nm] for nm in buf.tensors]
            off, st = 0, []
            for i in idx:
                st.append(off)
                pos[i] = (b, off, off + self.numel[i])
                off += self.numel[i]
            members.append(idx)
            starts.append(st)
            numel.append(off)
            itemsize.append(self.itemsize[idx[0]])
        return Layout(buffers, members, starts, numel, itemsize, pos)

    def schedule(self, strategy: str, layout: Layout, blocks: Iterable[Block | tuple[int, int, int]],
                 predicted: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                 check: bool = True, mode: Mode = Mode.OVERLAP,
                 profile_digest: str | None = None, align_bytes: int | None = None,
                 gathers: Sequence[Sequence[int]] | None = None,
                 hier: Callable[[int], bool] | None = None,
                 runner: Runner = Runner.RUNTIME) -> Schedule:
        """Build (and by default validate) a :class:`Schedule` for this problem, to run in
        ``mode`` (a :class:`~usbyte_opt.formats.Mode`).

        The schedule records every tensor's shape (``shapes``), so that the runtime
        can name the exact tensor whose shape differs from the model's, and the digest of the
        profile it was planned from (``profile_digest``, default: this problem's profile).

        A block boundary inside a tensor is moved to the nearest multiple of ``align_bytes``
        from the tensor's start (:func:`align_cuts`; default :data:`NCCL_ALIGN_BYTES` for a
        profile measured on NCCL, else none): the runtime starts every tensor of its flat
        buffers on such a boundary on CUDA, so every block starts there too.

        ``gathers`` (sharded mode): the all-gathers, as block indices (a block that alignment
        leaves empty drops out of its all-gather).

        ``hier``: given a block's bytes (after alignment), whether it is all-reduced
        hierarchically (:attr:`Block.hier`); the schedule then records the profile's nodes
        (:attr:`Schedule.nodes`).
        Without it every block is flat and the schedule is as before.

        ``runner``: what runs it (:attr:`Schedule.runner`); torch DDP only for a schedule
        that DDP can express (checked with the schedule, one line otherwise).
        """
        as_blocks: tuple[Block, ...] = tuple(k if isinstance(k, Block) else Block(*k) for k in blocks)
        if align_bytes is None:
            align_bytes = NCCL_ALIGN_BYTES if self.profile.comm.backend == "nccl" else 0
        if align_bytes > 1:
            aligned = [align_cuts(layout, [k], align_bytes) for k in as_blocks]
            if gathers is not None:
                new_index, j = {}, 0
                for k, a in enumerate(aligned):
                    if a:
                        new_index[k], j = j, j + 1
                gathers = [g2 for g2 in ([new_index[k] for k in g if k in new_index]
                                         for g in gathers) if g2]
            as_blocks = align_cuts(layout, as_blocks, align_bytes)
        prof = self.profile
        nodes = 1
        if hier is not None:
            as_blocks = tuple(Block(k.buffer, k.start, k.end,
                                    hier((k.end - k.start) * layout.itemsize[k.buffer]))
                              for k in as_blocks)
            nodes = prof.comm.nodes
        sched = Schedule(
            strategy=strategy,
            profile_name=prof.name,
            profile_digest=profile_digest if profile_digest is not None else prof.digest(),
            fingerprint=prof.fingerprint(),
            world_size=prof.comm.world_size,
            buffers=layout.buffers,
            blocks=as_blocks,
            predicted=dict(predicted or {}),
            buffer_numel=tuple(layout.numel),
            extra=dict(extra or {}),
            mode=mode,
            shapes={t.name: t.shape for t in prof.tensors},
            gathers=None if gathers is None else tuple(tuple(g) for g in gathers),
            nodes=nodes,
            runner=runner,
        )
        if check:
            check_against(sched, prof, f"<{strategy} schedule>")
            check_runner(sched, None, f"<{strategy} schedule>")
        return sched
