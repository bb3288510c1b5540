"""DDP's bucket plans, torch-free and in one place: DDP's own buckets, the tuned ones, DDP's caps.

Stock PyTorch DDP all-reduces whole tensors fused into buckets. Everything the planner and the
runtime know about those buckets is here:

* **DDP's own buckets** (:func:`buckets`): the buckets DDP forms by itself, what the ``ddp``
  strategy plans (:func:`stock_plan`) and the runtime's default plan is
  (:mod:`usbyte_opt.runtime.default_plan`).
* **The tuned buckets** (:func:`tuned_plan`, the ``ddp-tuned`` strategy): the bucket
  boundaries with the least predicted iteration time that stock DDP can still run.
* **A plan as DDP's buckets** (:func:`planned_buckets`, :func:`bucket_caps_mb`): the
  ``bucket_cap_mb_list`` that makes DDP build a schedule's blocks as its buckets.
  :mod:`usbyte_opt.ddp` builds DDP from it (torch) and checks what DDP built.

The strategies' modules (:mod:`usbyte_opt.planning.strategies.ddp`,
:mod:`usbyte_opt.planning.strategies.ddp_tuned`) register :func:`stock_plan` and
:func:`tuned_plan` under their names.

**DDP's own buckets.** :func:`buckets` mirrors the semantics of
``torch.distributed._compute_bucket_assignment_by_size`` as the reducer uses it after its first
iteration (when it rebuilds the buckets in the order the gradients actually became ready):

* tensors are visited in gradient-ready order;
* each dtype has its own open bucket and its own walk through the list of size limits
  ``[first_bucket_bytes, bucket_bytes_cap]`` (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES`` is 1 MiB, so
  the bucket holding the first gradients can go out early; ``bucket_cap_mb`` defaults to 25);
* a tensor is always added whole, and the bucket closes as soon as its size *reaches* the
  limit (``size >= limit``), so a bucket can exceed its cap by up to one tensor;
* DDP all-reduces buckets strictly in bucket order: the buckets that closed, in the order they
  closed, then the buckets still open at the end (at most one per dtype). Torch appends those in
  hash-map order and, for rebuilt buckets, does not sort; here they follow the order in which
  their last gradient becomes ready. With one dtype this is exactly torch's order.

Fence mode: DDP's optimizer step waits for every bucket (docs/design.md §2.6).

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> MiB = 1 << 20
    >>> # four float32 tensors of 0.75 MiB each, all in one buffer
    >>> pb = Problem.from_profile(chain_profile([MiB * 3 // 16] * 4))
    >>> p = stock_plan(pb, first_bucket_mb=1.0, bucket_cap_mb=1.0)
    >>> [(k.start, k.end) for k in p.blocks]     # 1.5 MiB >= 1 MiB closes each bucket at 2 tensors
    [(0, 393216), (393216, 786432)]

**The tuned buckets (``ddp-tuned``).** PyTorch DDP (2.13 and later) takes one size limit
per bucket, ``bucket_cap_mb_list``. After its first iteration it rebuilds its buckets in the
order gradients became ready, closing bucket ``i`` once it holds ``bucket_cap_mb_list[i]``,
all-reduces them in that order, one at a time, and steps the optimizer after the last (fence
mode, docs/design.md §2.6). So the schedules DDP can run are exactly: whole tensors, one
buffer in gradient-ready order, blocks contiguous in that order and issued in it
(:func:`planned_buckets` reads them back from a schedule, :func:`bucket_caps_mb` gives the
list). :func:`tuned_plan` picks, among those, the bucket boundaries with the least predicted
fence-mode iteration time, by an exact dynamic programme over the iteration model (the one
scorer's, :class:`usbyte_opt.planning.fastsim.Scorer`, with the compute-cost option when the
profile has it); :func:`usbyte_opt.ddp.wrap` builds the DDP model of the plan.

**Ties.** Tensors with the same ready time stay in one bucket: the profile cannot tell in
which order DDP will see them, so a boundary between them could give DDP other buckets than
the plan's. Without the compute-cost option this costs nothing (moving a tensor into the
earlier bucket, whose ready time it does not raise, never delays a block).

**One dtype.** DDP buckets each dtype separately but walks the *same* ``bucket_cap_mb_list``
for every dtype, and appends the last, still open bucket of each dtype in hash-map order; one
list cannot give several dtypes planned buckets, nor a predictable order. A profile with
tensors of several dtypes is refused (:class:`~usbyte_opt.planning.strategies.NotApplicable`,
one line); train it with the usbyte-opt runtime (``best``), or give the parameters one dtype.

**The dynamic programme.** Tensors in ready order are grouped into *atoms* (equal ready
times); a plan is a partition of the atoms into consecutive runs. Fence mode gives
``T = max(B', finish_last) + sum(update) + F``.

* Without the compute-cost option ``B' = B``, and ``finish(j)``, the least time at which
  runs covering atoms ``[0, j)`` can have finished, obeys
  ``f(j) = min_i max(f(i), r_{j-1}) + alpha + beta W(i, j)``: a later channel never helps the
  rest, so every prefix may take its fastest partition. Solved in O(n log n)
  (:func:`min_finish`).
* With it, a run's charge depends on where it falls relative to the end of backward, and the
  stretch ``s = 1 + X_B / B`` multiplies every ready time, so the prefix's fastest partition is
  no longer always the best start. The programme keeps, per atom boundary, every partial plan
  that no other one dominates. A partial plan is its charge so far ``X``, its channel's free
  time without the charge ``f``, and its stretched free time as a function of the stretch
  (an upper envelope of lines ``s r_k + cost``). Plan A dominates plan B when, for every
  continuation, A ends no later: ``X_A + rho (min(f_B, B) - min(f_A, B))^+ <= X_B`` (a channel
  that starts ``d`` earlier puts at most ``d`` more ms of wire inside backward, each costing at
  most ``rho``, the highest charge per wire-ms of any run) and A's envelope is below B's for
  every stretch B can still end with. Once a plan's channel is past the end of backward, its
  charge is final and the envelope one number. A partial plan is dropped when a lower bound on
  every completion reaches the best complete plan so far, which starts as the best of a few
  guesses (DDP's default buckets, one run, every atom alone, the fastest partitions when the
  charge is guessed as a stretch and an extra cost per run and per byte) improved by moving,
  adding and removing single boundaries. The search is exact when it completes; its work is
  capped (:data:`MAX_WORK`, a few tenths of a second), and past the cap the plan is the best
  found, no slower than any of the guesses, ``info["exact"]`` saying so.

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> from usbyte_opt.planning.fastsim import evaluate
    >>> pb = Problem.from_profile(chain_profile([250_000] * 8, alpha_ms=2.0, algbw_gbs=1.0))
    >>> p = tuned_plan(pb)
    >>> str(p.mode), len(p.blocks), p.info["exact"]
    ('fence', 5, True)
    >>> d = stock_plan(pb)
    >>> evaluate(pb, p.layout, p.blocks, "fence") <= evaluate(pb, d.layout, d.blocks, "fence")
    True
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsbyteError
from ..formats import DTYPE_SIZES, Block, Mode, Schedule
from .fastsim import scorer_for
from .problem import Layout, Problem, Runner
from .strategies import NotApplicable, Plan

MIB = 1 << 20
#: PyTorch DDP's bucket sizes: ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` and
#: ``bucket_cap_mb=25``.
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_CAP_BYTES = 25 << 20


def stock_plan(problem: Problem, *, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0) -> Plan:
    """Fuse whole tensors into DDP buckets over the default layout.

    Args:
        problem: the compiled profile.
        bucket_cap_mb: DDP's ``bucket_cap_mb`` (MiB, as in torch: ``int(mb * 1024 * 1024)`` bytes).
        first_bucket_mb: the cap of the first bucket of each dtype (torch's 1 MiB default).

    Returns:
        A fence-mode :class:`Plan` run by torch DDP (its host cost); ``info["buckets"]`` is
        the number of buckets.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([1000] * 10))   # 40 kB in all
        >>> len(stock_plan(pb).blocks)                            # one bucket
        1
    """
    if not bucket_cap_mb > 0 or not first_bucket_mb > 0:
        raise ValueError(f"bucket sizes must be > 0 MiB, got bucket_cap_mb={bucket_cap_mb}, "
                         f"first_bucket_mb={first_bucket_mb}")
    layout = problem.layout()
    blocks = buckets(problem, layout, first_bucket_bytes=int(first_bucket_mb * MIB),
                     bucket_cap_bytes=int(bucket_cap_mb * MIB))
    return Plan(layout, blocks, Mode.FENCE, {"buckets": len(blocks), "bucket_cap_mb": bucket_cap_mb,
                                          "first_bucket_mb": first_bucket_mb},
                runner=Runner.DDP)


def buckets(problem: Problem, layout: Layout | None = None, order: Sequence[int] | None = None, *,
            first_bucket_bytes: int = FIRST_BUCKET_BYTES,
            bucket_cap_bytes: int = BUCKET_CAP_BYTES) -> list[Block]:
    """DDP's buckets of ``problem`` (the rule of the module docstring), as blocks of ``layout``
    (default: the problem's default layout, whose buffers hold their tensors in ready order),
    walking tensors in ``order`` (default: ready order); the runtime's default plan is these.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([100] * 4))        # 400 B each
        >>> [(k.start, k.end) for k in buckets(pb, first_bucket_bytes=700, bucket_cap_bytes=1000)]
        [(0, 200), (200, 400)]
    """
    limits = (first_bucket_bytes, bucket_cap_bytes)
    layout = problem.layout() if layout is None else layout
    order = problem.ready_order() if order is None else list(order)
    # Per buffer (= per dtype): [start element, end element, bytes, index into limits,
    # ready position of the last tensor added].
    open_: dict[int, list[int]] = {}
    closed: list[tuple[int, Block]] = []     # (ready position of last tensor, block)
    for pos, i in enumerate(order):
        b, s, e = layout.pos[i]
        cur = open_.get(b)
        if cur is None:
            # torch starts every dtype at the first limit (its iterator is per bucket key)
            cur = open_[b] = [s, s, 0, 0, pos]
        elif cur[1] != s:  # pragma: no cover - the default layout keeps each dtype in ready order
            raise AssertionError("ddp: tensors of a buffer are not adjacent in ready order")
        cur[1] = e
        cur[2] += (e - s) * layout.itemsize[b]
        cur[4] = pos
        if cur[2] >= limits[cur[3]]:
            closed.append((pos, Block(b, cur[0], cur[1])))
            # the next bucket of this dtype uses the next limit (the last one repeats)
            open_[b] = [e, e, 0, min(cur[3] + 1, len(limits) - 1), pos]
    leftovers = sorted(((cur[4], Block(b, cur[0], cur[1])) for b, cur in open_.items()
                        if cur[1] > cur[0]), key=lambda x: x[0])
    return [blk for _, blk in closed] + [blk for _, blk in leftovers]


def planned_buckets(schedule: Schedule, source: str = "<schedule>") -> list[list[str]]:
    """The schedule's blocks as DDP buckets (tensor names, in gradient-ready order), or a
    one-line :class:`~usbyte_opt.errors.UsbyteError` saying why DDP cannot express it."""
    if schedule.mode != Mode.FENCE:
        raise UsbyteError(f"{source}: mode: expected \"fence\" (DDP steps after every bucket), "
                          f"got {schedule.mode!r}; plan with `usbyte-opt optimize --strategy "
                          "ddp-tuned`")
    if len(schedule.buffers) != 1:
        raise UsbyteError(f"{source}: buffers: expected one buffer (one dtype): DDP sizes the "
                          f"buckets of every dtype with the same list, got "
                          f"{len(schedule.buffers)} ({', '.join(b.dtype for b in schedule.buffers)})")
    shapes = schedule.shapes
    if shapes is None:
        raise UsbyteError(f"{source}: shapes: expected the per-tensor shapes (schedules written "
                          "by `usbyte-opt optimize` record them)")
    buf = schedule.buffers[0]
    ends: dict[int, int] = {}     # element offset where each tensor ends -> its index
    starts: dict[int, int] = {}
    off = 0
    for i, name in enumerate(buf.tensors):
        n = 1
        for d in shapes.get(name, ()):
            n *= int(d)
        starts[off] = i
        off += n
        ends[off] = i
    pos = 0
    buckets: list[list[str]] = []
    for k, blk in enumerate(schedule.blocks):
        if blk.start != pos:
            raise UsbyteError(f"{source}: blocks[{k}]: expected a block starting at element "
                              f"{pos}: DDP all-reduces its buckets in gradient-ready order, "
                              f"so blocks must follow the buffer's order; got start {blk.start}")
        if blk.start not in starts or blk.end not in ends:
            raise UsbyteError(f"{source}: blocks[{k}]: expected whole tensors: DDP cannot cut a "
                              f"tensor, got [{blk.start}, {blk.end}) which cuts one")
        buckets.append(list(buf.tensors[starts[blk.start]: ends[blk.end] + 1]))
        pos = blk.end
    return buckets


def bucket_caps_mb(schedule: Schedule, source: str = "<schedule>") -> list[float]:
    """``bucket_cap_mb_list`` that makes DDP rebuild exactly the schedule's buckets: bucket
    ``i`` of ``S`` bytes gets a cap of ``S - 1`` bytes, so it closes right after its last
    tensor and not before (a tensor is at least 2 bytes)."""
    shapes = schedule.shapes or {}
    size = DTYPE_SIZES[schedule.buffers[0].dtype] if schedule.buffers else 4
    caps = []
    for names in planned_buckets(schedule, source):
        total = 0
        for n in names:
            e = 1
            for d in shapes[n]:
                e *= int(d)
            total += e * size
        caps.append((total - 0.5) / MIB)
    return caps


def expressible(problem: Problem, layout: Layout, blocks: Sequence[Block], ties: bool = True) -> bool:
    """Whether torch DDP can run ``blocks`` of ``layout`` as its buckets with a
    ``bucket_cap_mb_list`` (:meth:`usbyte_opt.formats.Schedule.bucket_cap_mb_list`): one buffer
    holding the tensors in ready order, blocks of whole tensors that follow it from its start,
    and with ``ties`` no boundary between tensors of the same ready time (DDP may see them in
    either order: the module docstring's *Ties*). What ``best`` may hand to the DDP runner.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([100, 100, 100], compute=[1, 1, 1]))
        >>> lay = pb.layout()
        >>> expressible(pb, lay, [Block(0, 0, 100), Block(0, 100, 300)])
        True
        >>> expressible(pb, lay, [Block(0, 0, 150), Block(0, 150, 300)])   # cuts a tensor
        False
    """
    at = _starts_at(problem, layout)
    if at is None:
        return False
    members, ready = layout.members[0], problem.ready
    pos = 0
    for k in blocks:
        if k.buffer != 0 or k.start != pos or k.end <= k.start:
            return False
        if k.end != layout.numel[0]:
            j = at.get(k.end)
            if j is None or (ties and ready[members[j]] == ready[members[j - 1]]):
                return False
        pos = k.end
    return pos == layout.numel[0]


def _starts_at(problem: Problem, layout: Layout) -> dict[int, int] | None:
    """Where each tensor of ``layout``'s one buffer starts (offset to its place), if the layout
    is one buffer in ready order, else ``None``; once per problem and layout (kept in
    ``problem.cache``: :func:`expressible` is asked about many plans of one layout)."""
    key = ("ddp-starts", id(layout))
    hit = problem.cache.get(key)
    if hit is None or hit[0] is not layout:
        at = None
        if len(layout.buffers) == 1 and layout.members[0] == problem.ready_order():
            at = {o: j for j, o in enumerate(layout.starts[0])}
        hit = problem.cache[key] = (layout, at)
    return hit[1]


#: Work (partial plans built plus dominance tests) the compute-cost programme may spend before
#: it settles for the best plan found (a few tenths of a second).
MAX_WORK = 100_000
#: Predicted gain below which DDP's own buckets are kept (see :func:`plan`).
PREFER_DEFAULT = 0.02

_EPS = 1e-12


def min_finish(R: Sequence[float], P: Sequence[float], alpha: float,
               run_lo: Sequence[int] | None = None) -> tuple[list[float], list[int]]:
    """Least finish time of runs covering items ``[0, j)``, for every ``j``.

    Items in ready order: item ``k`` is ready at ``R[k]`` (nondecreasing) and ``P`` is the
    prefix sum of their wire times (``P[0] = 0``); a run ``[i, j)`` is ready at ``R[j-1]`` and
    costs ``alpha + P[j] - P[i]``; ``run_lo[k]``: the first item a run ending at ``k`` may start
    at (``0`` for all). Returns ``(f, arg)`` with ``f[j] = alpha + P[j] + min_i (max(f[i],
    R[j-1]) - P[i])`` and ``arg[j]`` the ``i`` attaining it, in O(n log n): the ``i`` with
    ``f[i] <= R[j-1]`` only grow with ``j`` (the best of them is the last), the others are kept
    in a heap by ``f[i] - P[i]``.

    Example::

        >>> f, arg = min_finish([1.0, 1.5, 9.0], [0.0, 1.0, 2.0, 3.0], alpha=1.0)
        >>> f[3], arg[1:]            # [0, 2) ready 1.5 -> 3.5, then [2, 3) ready 9 -> 11
        (11.0, [0, 0, 2])
    """
    N = len(R)
    lo_of = run_lo if run_lo is not None else [0] * N
    f = [0.0] * (N + 1)
    arg = [0] * (N + 1)
    pending: list[tuple[float, int]] = []     # (f(i), i) not yet below the current release
    late: list[tuple[float, int]] = []        # (f(i) - P_i, i) among those, lazily cleaned
    active = -1                               # largest i with f(i) <= the current release
    for j in range(1, N + 1):
        i_new = j - 1
        heapq.heappush(pending, (f[i_new], i_new))
        heapq.heappush(late, (f[i_new] - P[i_new], i_new))
        r = R[j - 1]
        while pending and pending[0][0] <= r:
            active = max(active, heapq.heappop(pending)[1])
        lo = lo_of[j - 1]
        best_v, best_i = math.inf, -1
        if active >= lo:
            best_v, best_i = r - P[active], active
        while late and (late[0][1] < lo or f[late[0][1]] <= r):
            heapq.heappop(late)
        if late and late[0][0] < best_v:
            best_v, best_i = late[0]
        f[j], arg[j] = alpha + P[j] + best_v, best_i
    return f, arg


@dataclass(slots=True)
class _Atoms:
    """Tensors of the one buffer in ready order, grouped by equal ready time."""

    r: list[float]
    """Ready time of each atom."""
    nbytes: list[int]
    end: list[int]
    """Element offset where each atom ends (its start is the previous one's end)."""


def _atoms(problem: Problem, members: Sequence[int], pos: Sequence[tuple[int, int, int]]) -> _Atoms:
    r: list[float] = []
    nb: list[int] = []
    end: list[int] = []
    for i in members:
        ready = problem.ready[i]
        if r and ready == r[-1]:
            nb[-1] += problem.nbytes(i)
            end[-1] = pos[i][2]
        else:
            r.append(ready)
            nb.append(problem.nbytes(i))
            end.append(pos[i][2])
    return _Atoms(r, nb, end)


def tuned_plan(problem: Problem, *, max_work: int = MAX_WORK,
         prefer_default: float = PREFER_DEFAULT) -> Plan:
    """Whole tensors in one ready-ordered buffer, cut into the buckets with the least
    predicted fence-mode time (see the module docstring).

    Args:
        problem: the compiled profile; its tensors must have one dtype.
        max_work: cap on the work of the compute-cost programme (:data:`MAX_WORK`).
        prefer_default: keep DDP's own buckets (:func:`buckets`) unless the
            optimum is predicted faster by more than this fraction: a smaller gain is within
            the model's error, and DDP's own buckets are as fast as DDP by construction
            (docs/bench.md, the lab's ddp-tuned rows).

    Returns:
        A fence-mode :class:`Plan` that :func:`bucket_caps_mb` accepts;
        ``info``: ``buckets``, ``iteration_ms`` (its prediction), ``exact`` (the programme
        proved its optimum), ``default_buckets`` (DDP's own were kept).

    Raises:
        NotApplicable: the profile's tensors have several dtypes.
    """
    dtypes = sorted(set(problem.dtype))
    if len(dtypes) > 1:
        raise NotApplicable(
            f"profile {problem.profile.name!r}: tensors: expected one dtype for ddp-tuned, got "
            f"{', '.join(dtypes)}: DDP sizes every dtype's buckets with the same "
            "bucket_cap_mb_list and issues each dtype's last bucket in an unspecified order; "
            "use the usbyte-opt runtime (--strategy best) or give the parameters one dtype")
    layout = problem.layout()
    atoms = _atoms(problem, layout.members[0], layout.pos)
    if problem.charges_cpu:
        cuts, T, exact = _charged(problem, atoms, max_work)
    else:
        cuts, T, exact = _uncharged(problem, atoms), None, True
    blocks, start = [], 0
    for j in cuts:
        blocks.append(Block(0, start, atoms.end[j - 1]))
        start = atoms.end[j - 1]
    sc = scorer_for(problem, layout)
    # the programmes time runs on a line, without DDP's host cost: scored again where either
    # does not hold
    if T is None or not problem.cost.is_linear or problem.charges_host:
        T = sc.score(sc.stats(blocks), Mode.FENCE, Runner.DDP)
    if prefer_default > 0:
        default = buckets(problem, layout)
        T_default = sc.score(sc.stats(default), Mode.FENCE, Runner.DDP)
        if T_default <= T * (1.0 + prefer_default):
            return Plan(layout, default, Mode.FENCE, {"buckets": len(default), "iteration_ms": T_default,
                                                   "exact": exact, "default_buckets": True},
                        runner=Runner.DDP)
    return Plan(layout, blocks, Mode.FENCE, {"buckets": len(blocks), "iteration_ms": T,
                                          "exact": exact, "default_buckets": False},
                runner=Runner.DDP)


def _uncharged(problem: Problem, atoms: _Atoms, stretch: float = 1.0, alpha_extra: float = 0.0,
               beta_extra: float = 0.0) -> list[int]:
    """Run ends (atom indices, exclusive) of the partition with the least finish time; with
    ready times times ``stretch`` and ``alpha_extra``/``beta_extra`` (ms per run, per byte)
    added to the cost when this serves as a guess under the compute-cost option. Runs cost
    the cost model's linear bound: the partition is the fastest for a linear model."""
    alpha, beta = problem.cost.linear_bound()
    beta += beta_extra
    P = [0.0]
    for b in atoms.nbytes:
        P.append(P[-1] + b * beta)
    R = atoms.r if stretch == 1.0 else [x * stretch for x in atoms.r]
    _, arg = min_finish(R, P, alpha + alpha_extra)
    cuts, j = [], len(atoms.r)
    while j > 0:
        cuts.append(j)
        j = arg[j]
    cuts.reverse()
    return cuts


# ---------------------------------------------------------------------------------------------
# With the compute-cost option
# ---------------------------------------------------------------------------------------------


def _ddp_cuts(problem: Problem, atoms: _Atoms) -> list[int] | None:
    """DDP's default buckets as run ends over the atoms (``None`` if they split an atom)."""
    ends = {e: j + 1 for j, e in enumerate(atoms.end)}
    cuts = [ends.get(k.end) for k in stock_plan(problem).blocks]
    return None if None in cuts else sorted(c for c in cuts if c is not None)


def _improve(cuts: list[int], score, budget: int = 200_000) -> tuple[list[int], float]:
    """Local search over run ends: remove one, move one between its neighbours, or split a
    run in two; first improvement, to a fixed point or until ``budget`` runs were scored."""
    cur = score(cuts)
    spent = 0
    improved = True
    while improved and spent < budget:
        improved = False
        k = 0
        while k < len(cuts) and spent < budget:
            lo = cuts[k - 1] if k else 0
            hi = cuts[k]
            options = []
            if k < len(cuts) - 1:
                options.append(cuts[:k] + cuts[k + 1:])                       # remove
                options += [cuts[:k] + [x] + cuts[k + 1:] for x in range(lo + 1, cuts[k + 1])
                            if x != hi]                                         # move
            options += [cuts[:k] + [x] + cuts[k:] for x in range(lo + 1, hi)]  # split
            for c in options:
                v = score(c)
                spent += len(c)
                if v < cur - _EPS * cur:
                    cuts, cur, improved = c, v, True
                    break
            k += 1
    return cuts, cur


class _State:
    """A partial plan: runs covering atoms ``[0, j)``."""

    __slots__ = ("X", "f", "lines", "s", "parent", "j")

    def __init__(self, X: float, f: float, lines: tuple[tuple[float, float], ...],
                 s: float | None, parent: _State | None, j: int):
        self.X = X            # training-thread charge so far (ms)
        self.f = f            # the channel's free time, without the charge
        self.lines = lines    # stretched free time: max over lines (m, c) of m * s + c
        self.s = s            # the final stretch once the channel is past backward, else None
        self.parent, self.j = parent, j

    def env(self, s: float) -> float:
        if self.s is not None:
            return self.lines[0][1]
        return max((m * s + c for m, c in self.lines), default=0.0)


def _envelope(lines: Sequence[tuple[float, float]], lo: float,
              hi: float) -> tuple[tuple[float, float], ...]:
    """The lines ``(m, c)`` (slopes ascending) whose maximum ``m s + c`` they reach somewhere in
    ``[lo, hi]``: the upper hull, trimmed to the interval."""
    hull: list[tuple[float, float]] = []
    for m, c in lines:
        if hull and m == hull[-1][0]:
            if c <= hull[-1][1]:
                continue
            hull.pop()
        while len(hull) >= 2:
            (m1, c1), (m2, c2) = hull[-2], hull[-1]
            # the middle line is never above both: the outer ones cross left of where it rises
            if (c1 - c) * (m2 - m1) <= (c1 - c2) * (m - m1):
                hull.pop()
            else:
                break
        hull.append((m, c))
    while len(hull) >= 2 and (hull[0][1] - hull[1][1]) / (hull[1][0] - hull[0][0]) <= lo:
        hull.pop(0)
    while len(hull) >= 2 and (hull[-2][1] - hull[-1][1]) / (hull[-1][0] - hull[-2][0]) >= hi:
        hull.pop()
    return tuple(hull)


def _breaks(lines: Sequence[tuple[float, float]]) -> list[float]:
    return [(c1 - c2) / (m2 - m1) for (m1, c1), (m2, c2) in zip(lines, lines[1:])]


def _below(a: _State, b: _State, lo: float, hi: float) -> bool:
    """Whether ``a``'s stretched free time is at most ``b``'s for every stretch in ``[lo, hi]``
    (both piecewise linear: checking the ends and every break point suffices)."""
    tol = _EPS * max(1.0, abs(b.env(lo)))
    if a.env(lo) > b.env(lo) + tol:
        return False
    if hi <= lo:
        return True
    if a.env(hi) > b.env(hi) + tol:
        return False
    for st in (a, b):
        if st.s is None:
            for x in _breaks(st.lines):
                if lo < x < hi and a.env(x) > b.env(x) + tol:
                    return False
    return True


#: Beyond this many atoms, the compute-cost programme first solves the problem with atoms
#: grouped into about this many runs, for a first plan to prune with.
COARSE_ATOMS = 40


@dataclass(slots=True)
class _Charging:
    """The compute-cost programme's view of the atoms: prefix bytes, the linear cost, the
    charge per run, and the pieces of the search (partial plans, bounds, dominance).

    ``s_cap`` is the largest stretch a plan that can still win may end with (the incumbent's
    time over ``B``), ``work`` the work spent (partial plans built plus dominance tests)."""

    r: list[float]
    """Ready time of each atom."""
    Pb: list[int]
    """Prefix sums of the atoms' bytes (``Pb[0] = 0``)."""
    alpha: float
    beta: float
    cpb: float
    cpm: float
    Bk: float
    """Backward time ``B``."""
    rho: float
    """The highest charge per wire-ms of any run."""
    s_cap: float = math.inf
    work: int = 0

    @classmethod
    def of(cls, problem: Problem, atoms: _Atoms) -> _Charging:
        alpha, beta = problem.cost.linear_bound()
        Pb = [0]
        for b in atoms.nbytes:
            Pb.append(Pb[-1] + b)
        ctx = cls(atoms.r, Pb, alpha, beta, problem.cpu_ms_per_block, problem.cpu_ms_per_mb,
                  problem.B, 0.0)
        ctx.rho = max(ctx.charge(b) / ctx.cost(b) for b in (min(atoms.nbytes), Pb[-1]))
        return ctx

    @property
    def M(self) -> int:
        return len(self.r)

    def cost(self, nbytes: int) -> float:
        return self.alpha + self.beta * nbytes

    def charge(self, nbytes: int) -> float:
        return self.cpb + self.cpm * nbytes / 1e6

    def final(self, st: _State) -> float:
        """T' (the iteration less updates and F) of the complete plan ``st``."""
        s = 1.0 + st.X / self.Bk
        return max(s * self.Bk, st.env(s))

    def child(self, st: _State, b: int) -> _State:
        """``st`` followed by the run ``[st.j, b)``. Every later run waits for atom ``b`` at
        least, so the channel's free times are taken as at least its ready time: partial
        plans that differ only while the channel would idle anyway become equal."""
        r, Bk = self.r, self.Bk
        nbytes = self.Pb[b] - self.Pb[st.j]
        C = self.cost(nbytes)
        rr = r[b - 1]
        nxt = r[b] if b < len(r) else 0.0
        start = st.f if st.f > rr else rr
        fin = start + C
        X = st.X
        if st.s is None and start < Bk and C > 0:
            X += self.charge(nbytes) * (min(fin, Bk) - start) / C
        f = fin if fin > nxt else nxt
        if st.s is not None or f >= Bk:
            s = st.s if st.s is not None else 1.0 + X / Bk
            e = max(st.env(s), s * rr) + C
            return _State(X, f, ((0.0, max(e, s * nxt)),), s, st, b)
        lines = [(m, c + C) for m, c in st.lines] + [(rr, C), (nxt, 0.0)]
        return _State(X, f, _envelope(lines, 1.0 + X / Bk, self.s_cap), None, st, b)

    def timeline(self, cuts: Sequence[int]) -> tuple[float, float]:
        """``(T', stretch)`` of the runs ending at ``cuts`` (the scorer's fence mode, less
        updates and F)."""
        r, Pb, Bk = self.r, self.Pb, self.Bk
        t = X = 0.0
        i = 0
        runs = []
        for b in cuts:
            nbytes = Pb[b] - Pb[i]
            C = self.cost(nbytes)
            start = t if t > r[b - 1] else r[b - 1]
            t = start + C
            if start < Bk:
                X += self.charge(nbytes) * (min(t, Bk) - start) / C
            runs.append((r[b - 1], C))
            i = b
        s = 1.0 + X / Bk
        e = 0.0
        for rr, C in runs:
            e = (e if e > s * rr else s * rr) + C
        return max(s * Bk, e), s

    def score_cuts(self, cuts: Sequence[int]) -> float:
        return self.timeline(cuts)[0]

    def lower(self, st: _State) -> float:
        """A lower bound on T' of every completion of ``st``: the channel's work left, and,
        if the rest puts ``y`` byte-equivalents of wire inside backward, at least
        ``cpm * y`` more charge (``T' >= s B + cpm y`` and ``T' >= s r_last + cpm y r_last / B
        + alpha + beta b_last``, the last gradient's run) and at least ``beta (rest - y)`` of
        wire after ``B`` (``T' >= max(B, f) + beta (rest - y)``), for the least ``y`` can do."""
        Bk, alpha, beta, M = self.Bk, self.alpha, self.beta, len(self.r)
        s = st.s if st.s is not None else 1.0 + st.X / Bk
        if st.j == M:
            return max(s * Bk, st.env(s))
        rem = self.Pb[M] - self.Pb[st.j]
        r_last = self.r[M - 1]
        a1, a2 = s * Bk, s * r_last + (alpha + beta * (self.Pb[M] - self.Pb[M - 1]))
        lb = max(a1, a2, st.env(s) + alpha + beta * rem)
        c_byte = self.cpm / 1e6
        if st.s is None and c_byte > 0:
            k1, k2 = c_byte, c_byte * r_last / Bk
            d = max(Bk, st.f) + beta * rem
            ys = [0.0, rem] + [y for y in ((d - a1) / (k1 + beta), (d - a2) / (k2 + beta))
                               if 0.0 < y < rem]
            lb = max(lb, min(max(a1 + k1 * y, a2 + k2 * y, d - beta * y) for y in ys))
        return lb

    def dominates(self, a: _State, b: _State) -> bool:
        """Whether ``a`` ends no later than ``b`` for every continuation (module docstring)."""
        self.work += 1
        Bk = self.Bk
        fa, fb = min(a.f, Bk), min(b.f, Bk)
        if a.X + self.rho * max(0.0, fb - fa) > b.X + _EPS * max(1.0, b.X):
            return False
        lo = b.s if b.s is not None else 1.0 + b.X / Bk
        hi = lo if b.s is not None else max(lo, self.s_cap)
        return _below(a, b, lo, hi)


def _charged(problem: Problem, atoms: _Atoms, max_work: int,
             coarse: bool = True) -> tuple[list[int], float, bool]:
    """Run ends, iteration time and exactness of the best partition with the compute-cost
    option (the module docstring's programme): an incumbent (:func:`_incumbent`), then the
    search over partial plans (:func:`_search`). The programme's runs cost the cost model's
    linear bound: it is exact for a linear model."""
    ctx = _Charging.of(problem, atoms)
    cuts0 = _incumbent(problem, atoms, ctx, max_work, coarse)
    best_state = _State(0.0, 0.0, (), None, None, 0)
    for b in cuts0:
        best_state = ctx.child(best_state, b)
    best_state, best_T, exact = _search(ctx, best_state, max_work)
    cuts = []
    node: _State | None = best_state
    while node is not None and node.j > 0:
        cuts.append(node.j)
        node = node.parent
    cuts.reverse()
    return cuts, best_T + (sum(problem.update) + problem.F), exact


def _incumbent(problem: Problem, atoms: _Atoms, ctx: _Charging, max_work: int,
               coarse: bool) -> list[int]:
    """The best of a few partitions (DDP's default buckets, every atom alone, all in one run,
    and the fastest without the charge when the charge is guessed as a stretch of the ready
    times and an extra cost per run and per byte; with many atoms, the programme's plan over
    groups of atoms), improved by moving, removing and adding single boundaries while that
    helps."""
    M, cpb, cpm = ctx.M, ctx.cpb, ctx.cpm
    seeds = [list(range(1, M + 1)), [M]]
    seeds += [c for c in [_ddp_cuts(problem, atoms)] if c is not None]
    s1 = ctx.timeline(_uncharged(problem, atoms))[1]
    for stretch in {1.0, s1}:
        for a_x in (0.0, cpb, 4 * cpb):
            for b_x in (0.0, cpm / 1e6):
                seeds.append(_uncharged(problem, atoms, stretch, a_x, b_x))
    if coarse and M > 2 * COARSE_ATOMS:
        # the same programme over runs of ``g`` atoms: its plan is a plan of these atoms too
        g = -(-M // COARSE_ATOMS)
        last = [min(k + g, M) for k in range(0, M, g)]
        Pb = ctx.Pb
        grouped = _Atoms([atoms.r[e - 1] for e in last],
                         [Pb[e] - Pb[a] for a, e in zip([0] + last[:-1], last)],
                         [atoms.end[e - 1] for e in last])
        cuts_g, _, _ = _charged(problem, grouped, max_work // 4, coarse=False)
        seeds.append([last[k - 1] for k in cuts_g])
    seeds.sort(key=ctx.score_cuts)
    cuts0, v0 = _improve(seeds[0], ctx.score_cuts)
    for other in seeds[1:3]:
        c, v = _improve(other, ctx.score_cuts)
        if v < v0:
            cuts0, v0 = c, v
    return cuts0


def _search(ctx: _Charging, best_state: _State, max_work: int) -> tuple[_State, float, bool]:
    """The search over partial plans from the incumbent ``best_state`` (a complete plan):
    per atom boundary, the front of partial plans that no other dominates and whose lower
    bound is below the best complete plan so far. Returns the best complete plan, its T' and
    whether the search completed within ``max_work``."""
    M, Bk, alpha, beta = ctx.M, ctx.Bk, ctx.alpha, ctx.beta
    r, Pb = ctx.r, ctx.Pb
    W = Pb[M]
    best_T = ctx.final(best_state)
    ctx.s_cap = best_T / Bk
    fronts: list[list[_State]] = [[] for _ in range(M + 1)]
    fronts[0].append(_State(0.0, 0.0, (), None, None, 0))
    exact = True
    for j in range(M):
        front = [st for st in fronts[j] if ctx.lower(st) < best_T - _EPS * best_T]
        fronts[j] = []
        for st in front:
            s_lo = st.s if st.s is not None else 1.0 + st.X / Bk
            e_lo = st.env(s_lo)
            for b in range(j + 1, M + 1):
                if b < M and (max(e_lo, s_lo * r[b - 1]) + 2 * alpha + beta * (W - Pb[j])
                              >= best_T):
                    b = M          # every run ending before M is bounded out: only [j, M) is left
                ch = ctx.child(st, b)
                ctx.work += 1
                if b == M:
                    T = ctx.final(ch)
                    if T < best_T:
                        best_T, best_state = T, ch
                        ctx.s_cap = best_T / Bk
                    break
                if ctx.lower(ch) >= best_T - _EPS * best_T:
                    continue
                fr = fronts[b]
                if any(ctx.dominates(o, ch) for o in fr):
                    continue
                fr[:] = [o for o in fr if not ctx.dominates(ch, o)]
                fr.append(ch)
            if ctx.work > max_work:
                exact = False
                break
        if not exact:
            break
    return best_state, best_T, exact
