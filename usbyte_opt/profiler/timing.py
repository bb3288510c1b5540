"""Per-tensor timing of one training iteration: when each gradient is final, when each
parameter is first used, how long forward, backward and the optimizer step take.

Method (docs/design.md §2.1, §6):

- ``ready_ms``: a post-accumulate-grad hook on every trainable tensor stamps the clock; the
  offset from the start of backward is its ready time. The hook fires once the gradient has
  been accumulated into ``p.grad``; a tied tensor (one Parameter used twice) has one
  ``AccumulateGrad`` node, so the stamp is taken when all its uses have been summed. The
  hook overwrites the stamp, so were it ever to fire twice (re-entrant checkpointing), the
  last accumulation is the one that counts.
- ``need_ms``: forward pre-hooks on every module that directly owns a trainable tensor
  (``module._parameters``) stamp the clock. One untimed discovery pass runs the forward under
  a :class:`torch.overrides.TorchFunctionMode` that sees every torch call, and records for
  each tensor which hook call came last before its first use; timed passes read that
  stamp. For a leaf module this is its own pre-hook. It also covers a parameter that a
  parent (non-leaf) module uses in its own ``forward`` after running children (anchored to
  the last child's hook, closer than the parent's own), and a parameter used through a
  functional call by a module other than its owner, such as ``nn.MultiheadAttention``'s
  ``out_proj.weight``. A tensor used before any hook has fired gets 0 (start of forward).
  Should a timed pass make a different number of hook calls than the discovery pass
  (data-dependent control flow), that pass falls back to the first pre-hook of the
  tensor's owner. A compiled model (``profile --compile``) runs no module hook inside its
  graphs: there each tensor's need time is the stamp of the split graph's gate before the
  piece that reads it first (:class:`GateStamps`, where the runtime runs its pending update),
  which a compiled forward reaches at another share of the forward than the eager module's
  hook (measured on lab-cnn under inductor: the classifier's first weight at 75–78% of the
  forward, its eager hook at 97%); a tensor no gate reads keeps the eager pass's time
  (:func:`fill_need`).
- Parameters that get no gradient (unused, or only in a branch the loss does not reach) get
  ``ready_ms = backward_ms``: the runtime zero-fills them at the end of backward so that every
  rank issues the same collectives. Parameters never touched in forward get
  ``need_ms = forward_ms`` (nothing waits for them). Both lists are returned.
- ``update_ms``: the optimizer step is timed as a whole and apportioned to the tensors that
  had a gradient by element count. See :func:`apportion_update` for why.
- Clocks: on CPU ``time.perf_counter`` (the hooks run on the thread that calls backward);
  on CUDA one ``torch.cuda.Event`` per stamp, recorded in the hooks on the current stream with
  no host synchronisation, and read after the iteration. Before each iteration the ranks
  synchronise (device, then a barrier), so that a rank waiting for another does not count
  the wait as compute.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..collectives.sweep import median
from ..errors import UsageError, UsbyteError, first_line
from ..first_use import FirstUse
from ..models import check_loss

Progress = Callable[[str, int, int], None]

#: Timed iterations with hooks per round of ``IterationTimer.run(steady=True)``; each round
#: is followed by as many plain steady-state ones.
ROUND = 3


# --------------------------------------------------------------------------------------------
# Clocks
# --------------------------------------------------------------------------------------------


class CpuClock:
    """Stamps are ``perf_counter`` seconds; cheap enough to take in every hook."""

    def start_iteration(self) -> None:
        pass

    def stamp(self) -> float:
        return time.perf_counter()

    def finish(self) -> None:
        pass

    def ms(self, a: float, b: float) -> float:
        return (b - a) * 1e3


class CudaClock:
    """Stamps are CUDA events from a pool reused every iteration; read after ``finish``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool: list[torch.cuda.Event] = []
        self.used = 0

    def start_iteration(self) -> None:
        self.used = 0

    def stamp(self) -> torch.cuda.Event:
        if self.used == len(self.pool):
            self.pool.append(torch.cuda.Event(enable_timing=True))
        ev = self.pool[self.used]
        self.used += 1
        # On the profiled device's current stream (autograd sets it to the stream of the op in
        # backward hooks); a bare record() would use the current device's, another GPU when
        # cuda:N is profiled without torch.cuda.set_device(N).
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def finish(self) -> None:
        torch.cuda.synchronize(self.device)

    def ms(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        return a.elapsed_time(b)


def make_clock(device: torch.device):
    return CudaClock(device) if device.type == "cuda" else CpuClock()


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Timings:
    """Raw per-repeat measurements of one rank (milliseconds)."""

    names: list[str]
    """Trainable tensors, ``model.named_parameters()`` order (tied tensors once)."""
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    numels: list[int]
    forward_ms: list[float] = field(default_factory=list)
    backward_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    ready_ms: list[list[float]] = field(default_factory=list)
    """``[repeat][tensor]``; NaN where the tensor got no gradient."""
    need_ms: list[list[float]] = field(default_factory=list)
    """``[repeat][tensor]``; NaN where the tensor was not used in forward."""
    no_grad: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    functional: list[str] = field(default_factory=list)
    """Tensors first used outside their owner's ``forward`` (anchored to another hook)."""
    fallback_passes: int = 0
    """Timed passes whose hook calls differed from discovery (owner pre-hook used)."""
    steady_ms: list[float] = field(default_factory=list)
    """Steady-state iterations without hooks, each timed from its start to the next one's
    (``run(steady=True)``): what a training loop without communication pays per iteration;
    :func:`summarize` scales the hooked medians to their median."""


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of the finite values of ``xs``.

    Example::

        >>> quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9)
        4.6
    """
    v = sorted(x for x in xs if not math.isnan(x))
    if not v:
        return math.nan
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return round(v[lo] + (v[hi] - v[lo]) * (pos - lo), 12)


def apportion_update(step_ms: float, numels: Sequence[int], has_grad: Sequence[bool]) -> list[float]:
    """Split one optimizer step's time over tensors by element count.

    Why not time a single-parameter step per tensor: each ``step()`` call carries a fixed
    overhead (Python, state lookup, kernel launches; on GPU the ``foreach`` multi-tensor
    kernels also batch the work of many tensors into one launch), so summing one step per
    tensor overstates the step the training loop takes, the more so the more tensors
    (docs/profiles.md, "why the step is apportioned", has the measurements). Apportioning keeps
    ``sum(update_ms)`` equal to the measured step, which is what the fence-mode baselines
    charge, while an element-wise optimizer's cost does grow with the element count.
    Tensors without a gradient are skipped by the optimizer and get 0.

    Example::

        >>> apportion_update(3.0, [100, 200, 50], [True, True, False])
        [1.0, 2.0, 0.0]
    """
    total = sum(n for n, g in zip(numels, has_grad) if g)
    if total == 0:
        return [0.0] * len(numels)
    return [step_ms * n / total if g else 0.0 for n, g in zip(numels, has_grad)]


# --------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------


class GateStamps:
    """The gates of a split compiled forward, stamped: the callback of the profile's
    :class:`usbyte_opt.runtime.compiled.PlanSplit` (called before each piece with the
    indices of the tensors the piece reads first), read by the :class:`IterationTimer`
    given it, which sets :attr:`clock` and clears :attr:`calls` at each iteration.

    Example::

        >>> g = GateStamps()
        >>> g([0, 1])                    # no clock yet: nothing is stamped
        >>> g.clock = make_clock(torch.device("cpu")); g([2]); [ts for _, ts in g.calls]
        [[2]]
    """

    __slots__ = ("clock", "calls")

    def __init__(self) -> None:
        self.clock: Any = None
        self.calls: list[tuple[Any, list[int]]] = []

    def __call__(self, ts: list[int]) -> None:
        if self.clock is not None:
            self.calls.append((self.clock.stamp(), list(ts)))


class IterationTimer:
    """Times training iterations of ``model`` with per-tensor hooks.

    Args:
        model: the model, already on ``device`` and in training mode.
        inputs: positional arguments of ``model``.
        loss_fn: maps the output to a scalar loss.
        optimizer: stepped after each backward (its time is ``step_ms``).
        device: where the model runs; CUDA uses events, anything else ``perf_counter``.
        sync: called before each iteration to line the ranks up (e.g. a barrier).
        hooks: ``False`` runs the same loop without any hook (the overhead baseline).
        label: the model's name, for error messages.

    Example::

        >>> from usbyte_opt.models import build
        >>> model, inputs, loss_fn = build("mlp", batch_size=2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        >>> t = IterationTimer(model, inputs, loss_fn, opt).run(warmup=1, repeats=2)
        >>> len(t.ready_ms), len(t.names), t.names[0]
        (2, 8, '0.weight')
        >>> all(0 <= r <= b for rs, b in zip(t.ready_ms, t.backward_ms) for r in rs)
        True
    """

    def __init__(self, model: nn.Module, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor],
                 optimizer: torch.optim.Optimizer | None, device: torch.device | str = "cpu",
                 sync: Callable[[], None] | None = None, hooks: bool = True, label: str = "model",
                 compiled: Callable[..., Any] | None = None,
                 steady_with: tuple[Callable[..., Any], torch.optim.Optimizer | None] | None = None,
                 gates: GateStamps | None = None):
        self.model, self.inputs, self.loss_fn, self.optimizer = model, tuple(inputs), loss_fn, optimizer
        #: What the iterations call: ``model``, or its compiled form (``compiled``: only the
        #: gradients' hooks then, no module pre-hooks and no discovery pass inside the graph;
        #: ``need_ms`` from ``gates``, the split graph's gates stamped, the others NaN for the
        #: caller to fill, :func:`fill_need`).
        self.forward: Callable[..., Any] = compiled if compiled is not None else model
        self.compiled = compiled is not None
        #: What :meth:`steady` trains (default: ``forward`` and ``optimizer``): a compiled
        #: copy of the model not split per tensor, whose speed the hooked iterations' shares
        #: are scaled to (:func:`summarize`).
        self.steady_with = steady_with
        self.device = torch.device(device)
        self.clock = make_clock(self.device)
        self.sync = sync
        self.hooks_on = hooks
        self.label = label
        self.gates = gates
        if gates is not None:
            gates.clock = self.clock
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.timings = Timings([n for n, _ in named], [tuple(p.shape) for p in self.params],
                               [str(p.dtype).removeprefix("torch.") for p in self.params],
                               [p.numel() for p in self.params])
        # Modules that own trainable tensors directly, and which tensors each owns.
        self.owners: list[tuple[nn.Module, list[int]]] = []
        for m in model.modules():
            own = [self.index[id(p)] for p in m._parameters.values() if p is not None and id(p) in self.index]
            if own:
                self.owners.append((m, own))
        self.owner_of: list[list[int]] = [[] for _ in self.params]  # tensor -> owner indices
        for k, (_, own) in enumerate(self.owners):
            for i in own:
                self.owner_of[i].append(k)
        self.calls: list[tuple[int, Any]] = []      # (owner index, stamp) per pre-hook call
        self.ready: list[Any] = [None] * len(self.params)
        self.anchor: list[int | None] = [None] * len(self.params)
        self._handles: list[Any] = []

    # -- hooks ---------------------------------------------------------------------------------

    def install(self) -> None:
        """Install the hooks (``run`` does it; ``remove`` undoes it)."""
        calls, clock, ready = self.calls, self.clock, self.ready
        for k, (m, _) in enumerate(() if self.compiled else self.owners):
            def pre(_mod, _args, k=k):
                calls.append((k, clock.stamp()))
            self._handles.append(m.register_forward_pre_hook(pre))
        for i, p in enumerate(self.params):
            def post(_p, i=i):
                ready[i] = clock.stamp()  # overwrite: the last accumulation counts
            self._handles.append(p.register_post_accumulate_grad_hook(post))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- one iteration ------------------------------------------------------------------------

    def _iteration(self, discover: bool = False) -> tuple:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        if self.sync is not None:
            self.sync()
        self.calls.clear()
        if self.gates is not None:
            self.gates.calls.clear()
        self.ready[:] = [None] * len(self.params)
        clock = self.clock
        clock.start_iteration()
        t0 = clock.stamp()
        if discover and not self.compiled:
            calls, anchor = self.calls, self.anchor

            def used(i: int) -> None:  # the first use of tensor i: after the last hook call
                if anchor[i] is None:
                    anchor[i] = len(calls) - 1

            with FirstUse(self.index, used, metadata=True):
                loss = check_loss(self.label, self.loss_fn(self.model(*self.inputs)))
        else:
            loss = self.loss_fn(self.forward(*self.inputs))
        t1 = clock.stamp()
        loss.backward()
        t2 = clock.stamp()
        if self.optimizer is not None:
            self.optimizer.step()
        t3 = clock.stamp()
        clock.finish()
        return t0, t1, t2, t3

    def _record(self, stamps: tuple, n_discovered: int) -> None:
        t0, t1, t2, t3 = stamps
        ms, tm = self.clock.ms, self.timings
        F, B = ms(t0, t1), ms(t1, t2)
        tm.forward_ms.append(F)
        tm.backward_ms.append(B)
        tm.step_ms.append(ms(t2, t3))
        tm.ready_ms.append([ms(t1, r) if r is not None else math.nan for r in self.ready])
        need = [math.nan] * len(self.params)
        if self.hooks_on and not self.compiled:
            same = len(self.calls) == n_discovered
            if not same:
                tm.fallback_passes += 1
                first_call: dict[int, Any] = {}
                for k, st in self.calls:
                    first_call.setdefault(k, st)
            for i, a in enumerate(self.anchor):
                if same:
                    if a is None:
                        continue  # not used in forward
                    need[i] = 0.0 if a < 0 else ms(t0, self.calls[a][1])
                else:
                    sts = [first_call[k] for k in self.owner_of[i] if k in first_call]
                    if sts:
                        need[i] = min(ms(t0, s) for s in sts)
        elif self.gates is not None:
            for st, ts in self.gates.calls:
                for i in ts:
                    if 0 <= i < len(need) and math.isnan(need[i]):
                        need[i] = ms(t0, st)
        tm.need_ms.append(need)

    def steady(self, n: int) -> list[float]:
        """``n`` iterations of a plain training loop (no hooks, no synchronisation between
        iterations: forward, backward, step, ``zero_grad``), each timed from its start to the
        next one's, as a training loop without communication runs and as ``usbyte-opt bench``
        times its ``no-comm`` run (one more iteration ends the last). With ``sync``, the
        ranks line up once before the first (a collective call)."""
        if self.sync is not None:
            self.sync()
        clock = self.clock
        forward, opt = self.steady_with or (self.forward, self.optimizer)
        clock.start_iteration()
        stamps = []
        for _ in range(n + 1):
            stamps.append(clock.stamp())
            loss = self.loss_fn(forward(*self.inputs))
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                self.model.zero_grad(set_to_none=True)
        stamps.append(clock.stamp())
        clock.finish()
        return [clock.ms(a, b) for a, b in zip(stamps[:n], stamps[1:n + 1])]

    def run(self, warmup: int = 3, repeats: int = 10, progress: Progress | None = None,
            steady: bool = False) -> Timings:
        """Discovery pass, ``warmup`` untimed iterations, then ``repeats`` timed ones.

        With ``steady``, the timed iterations are taken in rounds of :data:`ROUND`, each
        followed by as many plain steady-state iterations (:meth:`steady`, hooks removed),
        so that a burst of load elsewhere falls on both alike: ``Timings.steady_ms``."""
        if repeats < 1:
            raise UsageError(f"--repeats: expected an integer >= 1, got {repeats}")
        if warmup < 0:
            raise UsageError(f"--warmup: expected an integer >= 0, got {warmup}")
        total = 1 + warmup + repeats
        try:
            if self.hooks_on:
                self.install()
            try:
                self._iteration(discover=self.hooks_on)
            except UsbyteError:
                raise
            except Exception as e:
                if type(e).__module__.startswith("torch.distributed"):
                    raise
                raise UsbyteError(f"model {self.label!r}: the first training iteration raised "
                                  f"{type(e).__name__}: {first_line(e, '')} (--debug shows the traceback)") from e
            n_discovered = len(self.calls)
            got_grad = [p.grad is not None for p in self.params]
            tm = self.timings
            tm.no_grad = [n for n, g in zip(tm.names, got_grad) if not g]
            tm.unused = [n for n, a in zip(tm.names, self.anchor) if a is None] \
                if self.hooks_on and not self.compiled else []
            if self.hooks_on and not self.compiled:
                # First use before any pre-hook of the tensor's own module(s) fired.
                first_own: dict[int, int] = {}
                for idx, (k, _) in enumerate(self.calls):
                    for i in self.owners[k][1]:
                        first_own.setdefault(i, idx)
                tm.functional = [tm.names[i] for i, a in enumerate(self.anchor)
                                 if a is not None and (i not in first_own or a < first_own[i])]
            if progress:
                progress("compute", 1, total)
            for w in range(warmup):
                self._iteration()
                if progress:
                    progress("compute", 2 + w, total)
            for r in range(repeats):
                self._record(self._iteration(), n_discovered)
                if progress:
                    progress("compute", 2 + warmup + r, total)
                if steady and (r % ROUND == ROUND - 1 or r == repeats - 1):
                    self.remove()
                    tm.steady_ms += self.steady(r % ROUND + 1)
                    if self.hooks_on:
                        self.install()
        finally:
            self.remove()
        return self.timings


def fill_need(compiled: Timings, eager: Timings) -> None:
    """A compiled run's ``need_ms`` where no gate of its split graphs stamped one (module
    hooks cannot stamp inside a graph): the eager run's medians, scaled by each compiled
    pass's forward over the eager median forward; its ``unused`` and ``functional`` lists
    too.

    Example::

        >>> nan = math.nan
        >>> e = Timings(["a", "b"], [(1,), (1,)], ["float32"] * 2, [1, 1], forward_ms=[10.0],
        ...             need_ms=[[1.0, 9.0]])
        >>> c = Timings(["a", "b"], [(1,), (1,)], ["float32"] * 2, [1, 1], forward_ms=[5.0],
        ...             need_ms=[[0.2, nan]])
        >>> fill_need(c, e); c.need_ms         # a's gate stamped 0.2; b from eager, halved
        [[0.2, 4.5]]
    """
    if not eager.need_ms or not eager.forward_ms:
        return
    cols = [median(c) for c in zip(*eager.need_ms)]
    f_eager = median(eager.forward_ms) or 1.0
    own = compiled.need_ms or [[math.nan] * len(cols) for _ in compiled.forward_ms]
    compiled.need_ms = [[c * f / f_eager if math.isnan(m) else m for c, m in zip(cols, row)]
                        for f, row in zip(compiled.forward_ms, own)]
    compiled.unused, compiled.functional = list(eager.unused), list(eager.functional)


@dataclass(slots=True)
class Summary:
    """Per-rank medians over repeats, plus the spread kept in ``meta``."""

    forward_ms: float
    backward_ms: float
    step_ms: float
    ready_ms: list[float]
    need_ms: list[float]
    update_ms: list[float]
    spread: dict[str, Any]


def summarize(t: Timings) -> Summary:
    """Medians of one rank's repeats; tensors with no gradient / no use get B / F.

    Example::

        >>> t = Timings(["a", "b"], [(2,), (3,)], ["float32"] * 2, [2, 3],
        ...             forward_ms=[1.0, 3.0, 2.0], backward_ms=[4.0, 4.0, 5.0], step_ms=[1.0] * 3,
        ...             ready_ms=[[1.0, math.nan]] * 3, need_ms=[[0.0, 0.5]] * 3, no_grad=["b"])
        >>> s = summarize(t)
        >>> s.forward_ms, s.backward_ms, s.ready_ms, s.update_ms
        (2.0, 4.0, [1.0, 4.0], [1.0, 0.0])
    """
    F0, B0, S0 = median(t.forward_ms), median(t.backward_ms), median(t.step_ms)
    hooked = F0 + B0 + S0
    scale = steady_scale(hooked, t.steady_ms)
    F, B, step = F0 * scale, B0 * scale, S0 * scale
    cols = [[x * scale for x in c] for c in zip(*t.ready_ms)] if t.ready_ms else [[] for _ in t.names]
    ncols = [[x * scale for x in c] for c in zip(*t.need_ms)] if t.need_ms else [[] for _ in t.names]
    ready = []
    for c in cols:
        m = median(c)
        ready.append(B if math.isnan(m) else min(max(m, 0.0), B))
    need = []
    for c in ncols:
        m = median(c)
        need.append(F if math.isnan(m) else min(max(m, 0.0), F))
    has_grad = [not all(math.isnan(x) for x in c) for c in cols]
    update = apportion_update(step, t.numels, has_grad)

    def iqr(c: Sequence[float]) -> float:
        return quantile(c, 0.75) - quantile(c, 0.25) if any(not math.isnan(x) for x in c) else 0.0

    r_iqr = [iqr(c) for c in cols]
    n_iqr = [iqr(c) for c in ncols]
    spread = {
        "forward_ms": {"p10": quantile(t.forward_ms, 0.1), "p50": F0, "p90": quantile(t.forward_ms, 0.9)},
        "backward_ms": {"p10": quantile(t.backward_ms, 0.1), "p50": B0, "p90": quantile(t.backward_ms, 0.9)},
        "step_ms": {"p10": quantile(t.step_ms, 0.1), "p50": S0, "p90": quantile(t.step_ms, 0.9)},
        "ready_iqr_ms": {"median": median(r_iqr), "max": max(r_iqr, default=0.0)},
        "need_iqr_ms": {"median": median(n_iqr), "max": max(n_iqr, default=0.0)},
        "repeats": len(t.forward_ms),
    }
    if t.steady_ms:
        # The hooked iterations give the shares (forward, backward, step, each tensor's
        # offsets); the plain steady-state ones the total (docs/profiles.md, "How close the
        # profile's compute is"). Forward, backward and step above are scaled; these are not.
        spread["steady_ms"] = {"p10": quantile(t.steady_ms, 0.1), "p50": median(t.steady_ms),
                               "p90": quantile(t.steady_ms, 0.9), "iterations": len(t.steady_ms)}
        spread["hooked_ms"] = hooked
        spread["scale"] = scale
    return Summary(F, B, step, ready, need, update, spread)


def steady_scale(hooked_ms: float, steady_ms: Sequence[float]) -> float:
    """What the hooked medians (forward + backward + step, ``hooked_ms``) are multiplied by
    so that they add up to the median plain steady-state iteration: 1 without steady-state
    iterations or a usable sum.

    Example::

        >>> steady_scale(100.0, [110.0, 130.0, 120.0]), steady_scale(100.0, [])
        (1.2, 1.0)
    """
    m = median(steady_ms) if steady_ms else math.nan
    if not (hooked_ms > 0 and m > 0 and math.isfinite(m)):
        return 1.0
    return m / hooked_ms

