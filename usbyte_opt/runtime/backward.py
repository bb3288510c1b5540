"""One step's communication: gradients arriving, blocks issued in order, the end of backward.

:class:`StepComm` is the per-step state of a :class:`~usbyte_opt.runtime.DistributedOptimizer`
(docs/design.md §5.3):

* each tensor's post-accumulate-grad hook (:meth:`StepComm.hook`) marks the tensor ready in
  the step's last backward pass. ``p.grad`` is the tensor's view of the flat buffer from one
  step to the next, so autograd accumulates into it in place; a gradient that arrives
  elsewhere (``p.grad`` was ``None`` or another tensor) is copied into the view, which becomes
  ``p.grad``. A block is issued once all its tensors are ready *and* every block before it in
  the schedule's order has been issued, so every rank issues the same collectives in the same
  order; it is scaled by ``1 / world_size`` right before (one kernel per block, the values
  DDP's ``mul_out(bucket_view, grad, 1 / world_size)`` gives). The hook's common case (last
  pass, stored buffers, nothing to learn or check) is a few list updates: the runtime's host
  cost per tensor is a kernel's, not a protocol's;
* the first gradient of each backward pass queues an autograd final callback
  (:meth:`StepComm.end_pass`, as DDP's reducer does); at the end of the step's last pass it
  issues what is left (:meth:`StepComm.finish`): a tensor this rank gave no gradient
  contributes zeros, then the remaining blocks, then the usage map on the control group. When
  ``backward()`` returns, every rank has issued the whole step;
* :meth:`StepComm.include_rule` is the update rule of the step: which tensors the optimizer
  steps (DDP's: the ones with a gradient here, or that some rank used).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import UsbyteError
from ..formats import Schedule
from .buffers import FlatGrads
from .comm import Channel

if TYPE_CHECKING:
    from .guard import Guard


class Phase(enum.Enum):
    """Where the step in progress is (:attr:`StepComm.phase`); :data:`TRANSITIONS` lists the
    legal moves.

    ``IDLE``: no gradient since the last ``step()``. ``ACCUMULATING``: gradients arrived in
    passes that only accumulate (inside ``no_sync()``, or before the last of
    ``backward_passes_per_step``). ``LAST_PASS``: the step's last backward pass runs (its
    gradients are scaled and its blocks go out). ``ISSUED``: every block of the step is
    issued. ``WAITED``: and waited for; the averaged gradients are readable.
    """

    IDLE = "idle"
    ACCUMULATING = "accumulating"
    LAST_PASS = "last pass"
    ISSUED = "issued"
    WAITED = "waited"


#: The legal moves between phases; ``step()`` (:meth:`StepComm.reset`) goes back to ``IDLE``
#: from any phase.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.ACCUMULATING, Phase.LAST_PASS, Phase.ISSUED}),
    Phase.ACCUMULATING: frozenset({Phase.ACCUMULATING, Phase.LAST_PASS, Phase.ISSUED}),
    Phase.LAST_PASS: frozenset({Phase.ISSUED}),
    Phase.ISSUED: frozenset({Phase.WAITED}),
    Phase.WAITED: frozenset(),
}


IDLE, ACCUMULATING, LAST_PASS = Phase.IDLE, Phase.ACCUMULATING, Phase.LAST_PASS
ISSUED, WAITED = Phase.ISSUED, Phase.WAITED


def _current_stream(index: int) -> Any:
    """The current CUDA stream of device ``index`` as ``(stream id, device index, device
    type)``: what ``torch.cuda.current_stream`` builds its ``Stream`` from, without building
    it (the hooks note it per tensor; a ``Stream`` is made only for a block whose gradients
    were finished on another stream)."""
    return torch._C._cuda_getCurrentStream(index)


_GRAD_OF = operator.attrgetter("grad")


class Include:
    """The update rule of one step (:meth:`StepComm.include_rule`): ``include(t)`` says
    whether tensor ``t`` is stepped; :meth:`select` filters a list of tensors at once.

    Args:
        keep: per tensor, whether it may be stepped at all.
        sure: per tensor, kept and decided without the usage map (it has a gradient here).
        used: for a kept tensor that is not sure, whether some rank used it (reads the usage
            map), or None when there is no such tensor.
    """

    __slots__ = ("keep", "sure", "used")

    def __init__(self, keep: list[bool], sure: list[bool], used: Callable[[int], bool] | None):
        self.keep, self.sure, self.used = keep, sure, used

    def __call__(self, t: int) -> bool:
        if not self.keep[t]:
            return False
        if self.sure[t] or self.used is None:
            return True
        return self.used(t)

    def select(self, ts: Sequence[int]) -> list[int]:
        """The tensors of ``ts`` that are stepped, in order."""
        if self.used is None:
            keep = self.keep
            return [t for t in ts if keep[t]]
        return [t for t in ts if self(t)]


class StepComm:
    """The communication state of the step in progress.

    Args:
        schedule: the schedule (its blocks name errors).
        grads: the flat buffers.
        chan: the channel of the collectives.
        passes: backward passes per step.
        find_unused: exchange the usage map each step.
        wait_in_backward: wait for the step's all-reduce in the end-of-backward callback, so
            that ``p.grad`` holds the averaged gradients when ``backward()`` returns (DDP's
            contract).
        flush: applies the previous step's pending updates; returns the tensors it applied
            without the forward having reached them (the stale-use check).
    """

    def __init__(self, schedule: Schedule, grads: FlatGrads, chan: Channel, passes: int,
                 find_unused: bool, flush: Callable[[], list[int]],
                 wait_in_backward: bool = False):
        self.schedule, self.grads, self.chan, self.k = schedule, grads, chan, passes
        self.find_unused = find_unused
        self.wait_in_backward = wait_in_backward
        self._flush = flush
        n, m = grads.n, len(schedule.blocks)
        self.n, self.m = n, m
        ws = chan.world_size
        self.scale: float | None = 1.0 / ws if ws > 1 else None
        #: Scale each block once before it is issued (``None``: not here). Sharded mode scales
        #: per tensor instead, as it puts each gradient in place (:attr:`put_scale`).
        self.block_scale: float | None = self.scale
        self.put_scale: float | None = None
        self.cuda = chan.cuda
        self._dev_index = 0
        if chan.cuda:
            idx = chan.device.index
            self._dev_index = torch.cuda.current_device() if idx is None else idx
        self._labels: list[str] | None = None
        self._labels_of = ""
        #: Tensors made final this step (:attr:`final` set).
        self.nfinal = 0
        #: The hooks' common case applies (:meth:`refresh`).
        self.fast = False
        self.rem0 = [len(ts) for ts in grads.block_tensors]
        self.count = [0] * n            # gradients received this step
        self.final = [False] * n        # gradient final and scaled (ready)
        self.local = [False] * n        # has a gradient on this rank (for the update rule)
        self.placed = [False] * n       # p.grad is the view since this step's backward
        self.rem = self.rem0.copy()     # tensors of each block not ready yet
        self.next = 0                   # next block to issue
        self.works: list[dist.Work | None] = [None] * m
        #: CUDA: the stream each tensor's gradient was finished on, as
        #: ``torch._C._cuda_getCurrentStream`` gives it (stream id, device index, type).
        self.streams: list[Any] = [None] * n
        self.passes = 0                 # backward passes of this step so far
        #: Backward passes run now accumulate locally (``DistributedOptimizer.no_sync()``).
        self.no_sync = False
        #: Where the step is (:class:`Phase`); changed only by :meth:`_enter` and :meth:`reset`.
        self.phase = Phase.IDLE
        #: The final callback of the running backward pass is queued (a pass is running).
        self.in_pass = False
        #: A backward through the model's outputs runs; its callback ends the pass.
        self.outer = False
        self.issued_by = ""             # what issued them before the end of backward
        self.discard: bool | None = None  # zero_grad() between backward and step()
        self.usage: torch.Tensor | None = None
        self.usage_work: dist.Work | None = None
        self.global_used: list[int] | None = None
        #: ``zero_grad(set_to_none=False)`` since the last step (sharded mode, where ``p.grad``
        #: is ``None`` after ``step()``): a zero gradient.
        self.zero_intent = [False] * n
        #: Tensors updated when this backward began, unseen by the forward (stale-use check).
        self.flushed: list[int] = []
        self.flushed_flag = [False] * n
        self.trace: Any = None
        #: Issue nothing before the end of backward (the tuner's compute-only measurement).
        self.defer = False
        self._probe: Any = None
        #: Issues block ``k`` instead of its all-reduce (sharded mode's reduce-scatter), or None.
        self.issue_block: Callable[[int, tuple], dist.Work] | None = None
        #: The blocks' collective, in errors.
        self.collective = "all-reduce"
        #: ``put(t, grad, scale)``: tensor ``t``'s gradient (times ``scale``) into its blocks
        #: and ``p.grad`` its view (:meth:`FlatGrads.take`; ZeRO-2: ``Sharded.put``).
        self.put: Callable[[int, torch.Tensor | None, float | None], None] = grads.take
        #: Sharded mode: drop the works of blocks whose collective has finished, at each
        #: issue, so that what they hold goes (:meth:`reap`).
        self.reaping = False
        self.reaped = 0                 # blocks before it are reaped (or not issued yet)
        #: Arms the tensors while their gradients are in flight (:mod:`.guard`), or None.
        self.guard: Guard | None = None
        #: Keep the gradient guard armed after the wait (sharded mode: ``p.grad`` never holds
        #: the average, so reads stay refused until ``step()``).
        self.keep_grad_guard = False
        #: Tensors whose ``p.grad`` was set to the view by :meth:`expose_used` this step.
        self.exposed = [False] * n
        self.refresh()

    @property
    def probe(self) -> Any:
        """The tuner's measurement of this iteration, or None."""
        return self._probe

    @probe.setter
    def probe(self, probe: Any) -> None:
        self._probe = probe
        self.refresh()

    def refresh(self) -> None:
        """Whether the hooks' common case applies: flat buffers stored, gradients put by
        :meth:`FlatGrads.take` and scaled per block, no probe, no stale-use check pending.
        Call after changing :attr:`put` or :attr:`put_scale`."""
        self.fast = (self.grads.stored and self.put == self.grads.take and self._probe is None
                     and not self.flushed and self.put_scale is None)

    # -- backward ----------------------------------------------------------------------------

    def hook(self, t: int) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of tensor ``t``."""
        final, count, rem = self.final, self.count, self.rem
        g = self.grads
        view, name, take = g.views[t], g.names[t], g.take
        blocks = g.tensor_blocks[t]
        k0 = blocks[0] if len(blocks) == 1 else -1
        cur = _current_stream if self.cuda else None
        dev = self._dev_index

        def hook(p: torch.Tensor) -> None:
            if self.fast and self.phase is LAST_PASS and self.in_pass:
                # The common case: the step's last pass, into stored buffers.
                if final[t]:
                    self.twice(name)
                count[t] += 1
                final[t] = True
                self.nfinal += 1
                grad = p.grad
                if grad is not view:   # p.grad was None or another tensor: copied in
                    take(t, grad)
                if cur is not None:
                    self.streams[t] = cur(dev)
                if k0 < 0:
                    self.mark_ready(t)
                    return
                left = rem[k0] - 1
                rem[k0] = left
                if left == 0 and k0 == self.next and not self.defer:
                    self.advance()
                return
            self.slow_hook(t, p)
        return hook

    def slow_hook(self, t: int, p: torch.Tensor) -> None:
        """The hook of tensor ``t`` outside its common case: the first gradient of a pass, a
        pass that only accumulates, sharded mode, the tuner's probe, the stale-use check."""
        g = self.grads
        view, name = g.views[t], g.names[t]
        if not self.in_pass:
            self.begin_pass()
        if self.phase is ISSUED or self.phase is WAITED:
            self.late_gradient(name)
        if self.flushed_flag[t]:
            raise UsbyteError(f"parameter {name!r} was used in forward before its pending "
                              "update was applied (it was used outside the forward of the "
                              "modules that own it); call opt.synchronize() before such a "
                              "forward")
        last = self.phase is LAST_PASS
        if last and self.final[t]:
            self.twice(name)
        self.count[t] += 1
        grad = p.grad
        if grad is not view:
            # Without stored buffers (ZeRO-2) a pass that only accumulates leaves the
            # gradient in p.grad, where autograd accumulates it.
            if g.stored or last:
                self.put(t, grad, self.put_scale if last else None)
        elif last and self.put_scale is not None and g.stored:
            with torch.no_grad():
                view.mul_(self.put_scale)
        if self._probe is not None:
            self._probe.ready(t)
        if self.cuda:
            self.streams[t] = _current_stream(self._dev_index)
        if last:   # (local and placed follow from final in finish())
            self.final[t] = True
            self.nfinal += 1
            self.mark_ready(t)

    def twice(self, name: str) -> None:
        """A second gradient of one tensor in one backward pass: reentrant activation
        checkpointing (``checkpoint(..., use_reentrant=True)``) with the tensor used in two
        checkpointed segments. Its blocks may have gone out with the first part only."""
        raise UsbyteError(f"parameter {name!r} got two gradients in one backward pass (reentrant "
                          "activation checkpointing with the parameter used in two checkpointed "
                          "segments): its all-reduce could go out with part of its gradient; use "
                          "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), as DDP "
                          "also requires (or static_graph=True there)")

    def output_grad(self, grad: torch.Tensor) -> None:
        """Gradient hook of the model's outputs: a backward through the model starts. Its
        end is noted by a callback queued here, in the outermost backward, so that a reentrant
        backward inside it (reentrant activation checkpointing, which runs one backward per
        segment) does not end the pass early: the pass's gradients then end with it."""
        if not self.outer:
            self.outer = True
            torch.autograd.Variable._execution_engine.queue_callback(self.outer_end)

    def outer_end(self) -> None:
        self.outer = False
        if self.in_pass:
            self.end_pass()

    def pre_hook(self, t: int) -> Callable[[torch.Tensor], None]:
        """Tensor ``t``'s gradient hook, before autograd accumulates it (ZeRO-2, where
        ``p.grad`` is a placeholder after the step's last pass that cannot be accumulated
        into): a gradient after the step was issued is refused here, as :meth:`hook` does."""
        name = self.grads.names[t]
        final = self.final

        def pre(grad: torch.Tensor) -> None:
            if self.phase is LAST_PASS and final[t]:
                self.twice(name)
            if self.phase is ISSUED or self.phase is WAITED:
                if not self.in_pass:
                    self.begin_pass()   # the pass counted, as hook() counts it
                self.late_gradient(name)
        return pre

    def late_gradient(self, name: str) -> None:
        if self.issued_by:
            raise UsbyteError(f"parameter {name!r} got a gradient after this step's all-reduce "
                              f"was issued (by {self.issued_by}); call step() before the next "
                              "backward()")
        raise UsbyteError(f"parameter {name!r} got a gradient in backward pass {self.passes} of "
                          f"a step, with backward_passes_per_step={self.k}: the step's "
                          f"all-reduce was issued at the end of pass {self.k}; call step() after "
                          f"{self.k} backward() calls, pass the number of backward() calls "
                          "per step() as backward_passes_per_step, or run the passes that only "
                          "accumulate inside opt.no_sync()")

    def _enter(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise AssertionError(f"step phase {self.phase.value!r} cannot become {phase.value!r}")
        self.phase = phase

    @property
    def accumulating(self) -> bool:
        """Between the backward passes of an accumulation: gradients have arrived, the last
        pass has not (the step's all-reduce is not due yet)."""
        return self.phase is ACCUMULATING and not self.in_pass

    def begin_pass(self) -> None:
        """First gradient of a backward pass: queue the end-of-backward callback."""
        if self.phase is IDLE:
            self.begin_step()
        self.passes += 1
        if self.phase is IDLE or self.phase is ACCUMULATING:
            last = self.passes >= self.k and not self.no_sync
            self._enter(LAST_PASS if last else ACCUMULATING)
        if not self.outer:   # else the outermost backward's callback ends the pass
            torch.autograd.Variable._execution_engine.queue_callback(self.end_pass)
        self.in_pass = True

    def begin_step(self) -> None:
        """First gradient of a step: the previous step's updates must all be done before any
        gradient of this one lands in the buffers or any block of this one is issued."""
        for t in self._flush():
            self.flushed_flag[t] = True
            self.flushed.append(t)
        if self.flushed:
            self.refresh()

    def clear_flushed(self) -> None:
        """A new forward starts: tensors updated late are current again (and a backward that
        raised before its end left nothing behind)."""
        self.outer = False
        if self.flushed:
            for t in self.flushed:
                self.flushed_flag[t] = False
            self.flushed.clear()
            self.refresh()

    def end_pass(self) -> None:
        """Autograd final callback: at the end of the step's last pass, issue the rest."""
        self.in_pass = False
        if self.phase is LAST_PASS:
            if self.probe is not None:
                self.probe.backward_end(self.next)
            self.finish()
            if self.wait_in_backward:
                self.complete("backward()")
            elif self.guard is not None:
                self.guard.arm_grads()   # DDP's contract for code that reads p.grad now

    def mark_ready(self, t: int) -> None:
        rem = self.rem
        for k in self.grads.tensor_blocks[t]:
            rem[k] -= 1
        if not self.defer:
            self.advance()

    def advance(self) -> None:
        """Issue the blocks, in order from the next one, whose tensors are all ready."""
        nxt, m, rem = self.next, self.m, self.rem
        while nxt < m and rem[nxt] == 0:
            self.issue(nxt)
            nxt += 1
        self.next = nxt

    def issue(self, k: int) -> None:
        if self.reaping:
            self.reap()
        view = self.grads.block_views[k]
        if self.cuda:
            self.after_streams(k)
        if self.block_scale is not None:
            view.mul_(self.block_scale)
        if self.issue_block is not None:
            self.works[k] = self.issue_block(k, ())
        else:
            self.works[k] = self.chan.all_reduce_block(view)
        if self.trace is not None:
            self.trace.issue(k, self.works[k])

    def after_streams(self, k: int) -> None:
        """CUDA: make the current stream wait for the streams block ``k``'s gradients were
        finished on, where they differ from it."""
        cur = _current_stream(self._dev_index)
        others = {s for s in (self.streams[t] for t in self.grads.block_tensors[k])
                  if s is not None and s != cur}
        if others:
            self.chan.after([torch.cuda.Stream(stream_id=s[0], device_index=s[1],
                                               device_type=s[2]) for s in others])

    def reap(self) -> None:
        """Wait for (at no cost) and drop the works of the blocks, in issue order, whose
        collective has finished, up to the first that has not: what they hold (an all-to-all's
        receive buffer; ZeRO-2: the blocks' gradient storage) goes."""
        works, j, chan = self.works, self.reaped, self.chan
        while j < self.next:
            w = works[j]
            if w is not None:
                if not w.is_completed():
                    break
                chan.wait(w, self.what(j))
                works[j] = None
            j += 1
        self.reaped = j

    def finish(self) -> None:
        """Issue what is left of this step: the gradients not final yet (zeros for a tensor
        that got none), the remaining blocks in order, then the usage map."""
        if self.phase is ISSUED or self.phase is WAITED:
            return
        if self.phase is IDLE:
            self.begin_step()
        count, local, placed, final = self.count, self.local, self.placed, self.final
        # The hooks of the last pass made their tensors final: those have a gradient here,
        # in the view.
        local[:] = final
        placed[:] = final
        if self.nfinal < self.n:
            self._finish_rest()
        while self.next < self.m:
            self.issue(self.next)
            self.next += 1
        # After the blocks, on the control group: ranks may differ in how many blocks went out
        # during backward (a tensor one rank did not use), never in what is issued here.
        if self.find_unused and self.chan.control is not None:
            self.usage = torch.tensor([1 if c else 0 for c in count], dtype=torch.int32)
            self.usage_work = self.chan.control_all_reduce(self.usage)
        else:
            self.usage = self.usage_work = None
        self.global_used = None
        self._enter(ISSUED)
        if not self.find_unused and self.passes and 0 in count:
            self.check_all_used()

    def _finish_rest(self) -> None:
        """The tensors no hook of the last pass made final: a gradient accumulated in earlier
        passes, kept from the last step, assigned by the user, or none (zeros)."""
        g, count, local, placed, final = self.grads, self.count, self.local, self.placed, self.final
        scale, zero_intent = self.put_scale, self.zero_intent
        cur = _current_stream(self._dev_index) if self.cuda else None
        with torch.no_grad():
            for t in range(self.n):
                if final[t]:
                    continue
                grad = g.params[t].grad
                view = g.views[t]
                if grad is None:
                    # No gradient (a zero one after zero_grad(set_to_none=False) in sharded
                    # mode), or one the user dropped during accumulation. (ZeRO-2: storage
                    # starts zeroed.)
                    if g.stored:
                        view.zero_()
                    local[t] = count[t] == 0 and zero_intent[t]
                elif grad is view:
                    # Accumulated in earlier passes, or a gradient kept from the last step:
                    # contributed as it is, as DDP does.
                    if scale is not None and g.stored:
                        view.mul_(scale)
                    local[t] = placed[t] = True
                else:  # a tensor the user assigned (ZeRO-2: also one accumulated)
                    self.put(t, grad, scale)
                    local[t] = placed[t] = True
                final[t] = True
                if cur is not None:
                    self.streams[t] = cur
        self.nfinal = self.n

    def check_all_used(self) -> None:
        """``find_unused_parameters=False``: every tensor must have had a gradient this step,
        as DDP requires (it raises at the next forward). Raised after everything of the step
        was issued, so that no other rank waits for a block of this one."""
        unused = [self.grads.names[t] for t in range(self.n) if self.count[t] == 0]
        if unused:
            more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
            raise UsbyteError(f"parameter {unused[0]!r}{more} got no gradient in this step, with "
                              "find_unused_parameters=False (DDP raises here too): pass "
                              "find_unused_parameters=True, or freeze the parameters that are "
                              "not used (requires_grad_(False)) before wrapping")

    def complete(self, by: str) -> None:
        """Issue (if a caller needs it before the end of backward) and wait for everything of
        this step; then every tensor some rank used has the average in ``p.grad``."""
        if self.guard is not None and not self.keep_grad_guard:
            self.guard.disarm_grads()
        with torch._C.DisableTorchFunctionSubclass():   # the runtime's own reads and writes
            if self.phase is not ISSUED and self.phase is not WAITED:
                self.issued_by = by
                self.finish()
            self.wait_blocks()
            self.expose_used()
        if self.phase is ISSUED:
            self._enter(WAITED)

    def complete_if_due(self, by: str, between_passes: bool = False) -> None:
        """:meth:`complete`, unless there is nothing to wait for: no gradient yet, already
        waited for, or (unless ``between_passes``) between the passes of an accumulation,
        where the all-reduce is not due yet."""
        ph = self.phase
        if ph is not IDLE and ph is not WAITED and (between_passes or not self.accumulating):
            self.complete(by)

    def wait_blocks(self) -> None:
        if self.phase is WAITED:
            return
        for k in range(self.m):
            w = self.works[k]
            if w is not None:
                self.chan.wait(w, self.what(k))
                if self.reaping:   # what the work holds goes now, not at the next issue
                    self.works[k] = None

    def expose_used(self) -> None:
        """``p.grad`` = the view for the tensors with no gradient of this rank that another
        rank used, or that had a zero gradient here: what DDP leaves in ``p.grad``."""
        if all(self.placed):
            return
        used = self.usage_map() if self.find_unused else None
        g, local, placed = self.grads, self.local, self.placed
        for t in range(self.n):
            if not placed[t] and (local[t] or (used is not None and used[t])) \
                    and g.params[t].grad is None:
                g.params[t].grad = g.views[t]
                self.exposed[t] = True

    def what(self, k: int) -> str:
        """Block ``k`` in errors (the labels are made once, at the first wait)."""
        labels = self._labels
        if labels is None or self._labels_of != self.collective:
            self._labels_of = self.collective
            labels = self._labels = [
                f"{self.collective} of block {j} (buffer {b.buffer} [{b.start}, {b.end}))"
                for j, b in enumerate(self.schedule.blocks)]
        return labels[k]

    # -- the update rule ---------------------------------------------------------------------

    def usage_map(self) -> list[int]:
        """The step's usage map: how many ranks gave each tensor a gradient (waits for it)."""
        if self.global_used is None:
            if self.usage is None:   # one rank: its own
                self.global_used = [1 if c else 0 for c in self.count]
            else:
                if self.usage_work is not None:
                    self.chan.wait_host(self.usage_work, "all-reduce of the parameter usage map")
                self.global_used = self.usage.tolist()
        return self.global_used

    def include_rule(self, in_opt: Sequence[bool]) -> Include:
        """Whether tensor ``t`` is stepped for the step ending now: it is in the optimizer
        (``in_opt``), and it has a gradient here (the user did not drop it after backward), or
        some rank gave it one (the usage map, read only when asked about a tensor this rank
        did not use). ``zero_grad()`` between backward and ``step()`` discards every gradient
        (``set_to_none=True``) or zeroes them."""
        n = self.n
        if self.discard:
            return Include([False] * n, [False] * n, None)
        keep = list(in_opt)
        local = self.local.copy()
        params, placed, exposed = self.grads.params, self.placed, self.exposed
        now = list(map(_GRAD_OF, params))
        if any(map(operator.is_, now, repeat(None))):
            for t in range(n):  # the user dropped p.grad after backward: DDP would skip it
                if (placed[t] or exposed[t]) and now[t] is None:
                    local[t] = keep[t] = False
        if not self.find_unused:
            return Include(keep, keep, None)
        sure = list(map(operator.and_, keep, local))
        if sure == keep:
            return Include(keep, sure, None)
        usage_work, usage, chan = self.usage_work, self.usage, self.chan
        holder: list[list[int]] = []

        def used(t: int) -> bool:
            if not holder:
                if usage is None:
                    return False
                if usage_work is not None:
                    chan.wait_host(usage_work, "all-reduce of the parameter usage map")
                holder.append(usage.tolist())
            return holder[0][t] > 0
        return Include(keep, sure, used)

    def reset(self, clear_zero_intent: bool) -> None:
        """The step ended (``step()``): start the next one."""
        n = self.n
        self.count[:] = [0] * n   # in place: the hooks hold these lists
        self.final[:] = [False] * n
        self.local[:] = [False] * n
        self.placed[:] = [False] * n
        self.exposed[:] = [False] * n
        self.nfinal = 0
        self.rem[:] = self.rem0
        if self.guard is not None:
            self.guard.disarm_grads()
        self.next = 0
        self.reaped = 0
        self.passes = 0
        self.phase = IDLE
        self.in_pass = False
        self.issued_by = ""
        self.discard = None
        if clear_zero_intent:
            self.zero_intent[:] = [False] * n

    def in_flight(self) -> list[dist.Work]:
        """Every collective of the step that may still run (blocks, usage map)."""
        works = [w for w in self.works if w is not None]
        if self.usage_work is not None:
            works.append(self.usage_work)
        return works
