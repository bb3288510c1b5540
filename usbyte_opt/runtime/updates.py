"""Applying a step's updates: the subset step, and when each tensor's update runs.

After ``step()`` every tensor the wrapped optimizer steps has a *pending* update: its
averaged gradient is in its view of the flat buffer (or still on the wire), and the update
runs once the blocks covering it have finished. Three policies:

* fence mode (:meth:`SubsetStepper.step` on everything, inside ``step()``, as DDP);
* :class:`HostUpdates`, overlap mode on CPU: a forward pre-hook of each module waits on the
  host for the blocks of its pending tensors and steps them (together with every other
  pending tensor whose blocks have finished), so communication of the input-side tensors
  overlaps the next forward;
* :class:`StreamUpdates`, overlap mode on CUDA: ``step()`` enqueues the updates, a few
  optimizer calls in all, on an update stream that waits for each block's collective; a
  module's forward pre-hook only makes the compute stream wait for the event of the update
  group holding its tensors. The host never waits, and runs ahead of the GPU as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ..errors import UsbyteError
from .buffers import FlatGrads
from .semantics import check_no_new_hooks, group_changed

if TYPE_CHECKING:
    from .trace import Recorder

#: The refusal of a param group added to the wrapped optimizer after wrapping.
GROUPS_CHANGED = ("the wrapped optimizer's param groups changed after wrapping (add_param_group?): "
                  "those parameters would not be averaged; add the group before creating the "
                  "DistributedOptimizer")

#: Default number of optimizer calls per step in :class:`StreamUpdates`.
STREAM_UPDATE_GROUPS = 8


class Updates(Protocol):
    """The pending updates of one step: what :class:`~usbyte_opt.runtime.DistributedOptimizer`
    and its forward gates (:mod:`.forward`) ask of them, in overlap mode.

    :class:`HostUpdates` and :class:`StreamUpdates` provide it; a third implementation (one
    that steps a shard of each tensor and gathers the rest before use, say) must provide:

    * :meth:`start`, at ``step()``: the tensors ``candidates`` are now pending on this step's
      block collectives ``works`` (``None``: not issued on this rank, a world of one);
      ``include(t)``, asked when ``t``'s update runs, says whether it is stepped (the works
      may still be in flight);
    * :meth:`gate`, in a module's forward pre-hook: the forward is about to read the tensors
      ``need``; when it returns, their updated values are what the current stream reads;
    * :meth:`flush`: every pending update is done (for the current stream) when it returns;
      it returns the tensors no gate had covered (the stale-use check of the next backward);
    * :meth:`drop_grads`, at ``zero_grad(set_to_none=True)``: every ``p.grad`` is ``None``
      once nothing pending reads it (at once where nothing does);
    * :attr:`n_pending`: how many tensors are pending (0: the gates do nothing);
    * :attr:`pending`: per tensor, whether it is pending, or ``None`` when the
      implementation does not track it per tensor (then every gate calls :meth:`gate`);
    * :attr:`guard`: the :mod:`.guard` that disarms the tensors whose update ran, or ``None``.
    """

    n_pending: int
    guard: Any

    @property
    def pending(self) -> Sequence[bool] | None: ...

    def start(self, works: Sequence[dist.Work | None], include: Callable[[int], bool],
              candidates: Sequence[int]) -> None: ...

    def gate(self, need: Sequence[int]) -> None: ...

    def flush(self) -> list[int]: ...

    def drop_grads(self) -> None: ...


class Stepper(Protocol):
    """What :class:`HostUpdates` runs on tensors whose blocks have finished: the subset step
    (:class:`SubsetStepper`), or in sharded mode the copy of the gathered parameters
    (:class:`~usbyte_opt.runtime.sharded.GatherBack`)."""

    def step(self, ts: Sequence[int]) -> None: ...


class SubsetStepper:
    """Steps the wrapped optimizer on a subset of the model's tensors.

    The subset is stepped by narrowing each param group's ``params`` list for the call and
    restoring it afterwards: the optimizer's state stays keyed by parameter (Adam's
    per-parameter ``step`` counts stay right), and outside the call ``param_groups`` is the
    user's, so ``state_dict()`` keeps the wrapped optimizer's format and LR schedulers act on
    the same group dicts. The hyperparameters recorded by :meth:`snapshot` (at ``step()``) are
    put back into the groups for the call, so an LR scheduler stepped right after ``step()``
    does not change this iteration's update. For the call, ``p.grad`` is the tensor's view
    (the averaged gradient); whatever the user left in ``p.grad`` is put back afterwards.

    Only an optimizer that updates each parameter independently of the others is stepped on
    subsets (``per_parameter``: :func:`.semantics.steps_per_parameter`); any other is stepped
    whole, once per step, inside ``step()`` (:attr:`Installed.mode` is then fence mode), its
    groups and hyperparameters untouched: the tensors not stepped have ``p.grad = None`` for
    the call, as the plain optimizer under DDP sees them. A class the user declared
    per-parameter whose step changes a param group's value is refused in one line.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, grads: FlatGrads, device: torch.device,
                 calls: int = 0, per_parameter: bool = True, declared: bool = False):
        self.opt = optimizer
        self.grads = grads
        self.device = device
        #: Whether the optimizer may be stepped on subsets of its tensors.
        self.per_parameter = per_parameter
        #: Per-parameter by the user's declaration (each subset step is checked).
        self.declared = declared
        where = {id(p): gi for gi, grp in enumerate(optimizer.param_groups)
                 for p in grp["params"]}
        #: Param group of each tensor (-1: the optimizer does not step it).
        self.group_of = [where.get(id(p), -1) for p in grads.params]
        index = {id(p): t for t, p in enumerate(grads.params)}
        #: Per group, the runtime index of each of its parameters in its order (-1: not one
        #: of the runtime's tensors, a frozen one), and how many are the runtime's.
        self.members = [[index.get(id(p), -1) for p in grp["params"]]
                        for grp in optimizer.param_groups]
        self.in_opt = sum(1 for gi in self.group_of if gi >= 0)
        self.hp: list[dict[str, Any]] = []
        #: Attributes set on the wrapped optimizer for each call (a fused optimizer's found_inf).
        self.attrs: dict[str, Any] = {}
        #: Optimizer calls so far (``calls``: those of the plans this one replaces).
        self.calls = calls

    def snapshot(self) -> None:
        """Record the hyperparameters in force now (at ``step()``); a step hook registered
        since the optimizer was found per-parameter is refused here."""
        if self.per_parameter:
            check_no_new_hooks(self.opt)
        self.hp = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in grp.items()
                    if k != "params"} for grp in self.opt.param_groups]

    def step(self, ts: Sequence[int]) -> None:
        """``optimizer.step()`` on exactly the tensors ``ts`` (their views hold the averaged
        gradient and are final on the current stream). Every tensor the optimizer steps: its
        groups as they are (frozen members have no gradient, and are skipped as in any
        step); else each group narrowed to the members in ``ts``."""
        if not ts:
            return
        g = self.grads
        groups = self.opt.param_groups
        if len(groups) != len(self.hp):
            raise UsbyteError(GROUPS_CHANGED)
        if not self.per_parameter:
            self._step_whole(ts)
            return
        params, views = g.params, g.views
        # For the call, p.grad is the view; a tensor whose p.grad is something else (None
        # after zero_grad(), a tensor of the user's) gets it back afterwards.
        swap = [(params[t], views[t]) for t in ts if params[t].grad is not views[t]]
        saved = [(p, p.grad) for p, _ in swap]
        for p, v in swap:
            p.grad = v
        old_params = [grp["params"] for grp in groups]
        whole = len(ts) == self.in_opt and len(set(ts)) == self.in_opt
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            if not whole:
                chosen = bytearray(g.n)
                for t in ts:
                    chosen[t] = 1
                for gi, grp in enumerate(groups):
                    grp["params"] = [p for p, t in zip(old_params[gi], self.members[gi])
                                     if t >= 0 and chosen[t]]
            for gi, grp in enumerate(groups):
                for key, val in self.hp[gi].items():
                    cur = grp.get(key)
                    if cur is not val:
                        swapped.append((grp, key, cur))
                        grp[key] = val
            for k, v in self.attrs.items():
                setattr(self.opt, k, v)
            versions = [{k: v._version for k, v in hp.items() if torch.is_tensor(v)}
                        for hp in self.hp] if self.declared else []
            with torch.inference_mode(False), _no_autocast(self.device):
                inner_step(self.opt)
            self.calls += 1
            for gi, grp in enumerate(groups[:len(versions)]):
                changed = group_changed(self.hp[gi], grp, versions[gi])
                if changed is not None:
                    raise UsbyteError(
                        f"{type(self.opt).__name__}.step() changed param_groups[{gi}][{changed!r}]: "
                        "an optimizer declared with usbyte_opt.per_parameter must leave its "
                        "groups as they are (it is stepped on subsets of its tensors); drop "
                        "the declaration (it is then stepped whole, once per step)")
        finally:
            self._del_attrs()
            if not whole:
                for grp, ps in zip(groups, old_params):
                    grp["params"] = ps
            for grp, key, cur in reversed(swapped):
                grp[key] = cur
            for p, grad in saved:
                p.grad = grad

    def _step_whole(self, ts: Sequence[int]) -> None:
        """One call of the optimizer's own ``step()`` over all its groups, as the user's code
        makes it under DDP: the tensors ``ts`` hold their averaged gradient, the others of the
        model ``None``; groups and hyperparameters as they are now."""
        g = self.grads
        chosen = bytearray(g.n)
        for t in ts:
            chosen[t] = 1
        saved: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []
        for t, p in enumerate(g.params):
            if self.group_of[t] < 0:
                continue
            want = g.views[t] if chosen[t] else None
            if p.grad is not want:
                saved.append((p, p.grad))
                p.grad = want
        try:
            for k, v in self.attrs.items():
                setattr(self.opt, k, v)
            with torch.inference_mode(False), _no_autocast(self.device):
                inner_step(self.opt)
            self.calls += 1
        finally:
            self._del_attrs()
            for p, grad in saved:
                p.grad = grad

    def _del_attrs(self) -> None:
        for k in self.attrs:
            try:
                delattr(self.opt, k)
            except AttributeError:
                pass


class HostUpdates:
    """Overlap mode on the host (CPU tensors): updates run in the next forward, tensor by
    tensor, each after a host wait for its blocks.

    Args:
        grads: the flat buffers.
        stepper: steps the wrapped optimizer (in sharded mode: copies the gathered values).
        wait: ``wait(work, what)`` for a block's collective.
        what: ``what(k)`` describes block ``k`` in errors.
        trace: the :class:`~usbyte_opt.runtime.trace.Recorder` that notes each gate, or None.
        order: the blocks in the order their collectives end (default: block order); a gate
            also applies what has finished, scanning in this order. Blocks may share a work
            (sharded mode's grouped all-gathers): it is waited for once.
    """

    def __init__(self, grads: FlatGrads, stepper: Stepper,
                 wait: Callable[[dist.Work, str], None], what: Callable[[int], str],
                 trace: Recorder | None = None, order: Sequence[int] | None = None):
        self.grads, self.stepper, self._wait, self._what = grads, stepper, wait, what
        n, m = grads.n, len(grads.block_views)
        self.n, self.m = n, m
        self.pending = [False] * n
        self.n_pending = 0
        #: Pending tensors whose ``p.grad`` goes to ``None`` once their update has read it
        #: (:meth:`drop_grads`), and how many.
        self.drop = bytearray(n)
        self.n_drop = 0
        self.nblocks = [len(ks) for ks in grads.tensor_blocks]
        self.t_incomplete = [0] * n     # blocks of t not waited for yet
        self.complete = [True] * m      # block waited for
        self.order = list(range(m)) if order is None else list(order)
        self.done_ptr = m               # blocks before it in ``order`` are all complete
        self.ready: list[int] = []      # pending tensors whose blocks are all complete
        self.works: list[dist.Work | None] = [None] * m
        self.waited: set[int] = set()   # ids of this step's works waited for
        self.include: Callable[[int], bool] = lambda t: False
        self.trace = trace
        #: Disarms the tensors whose update ran (:mod:`.guard`), or None.
        self.guard: Any = None
        self._cand_of: Sequence[int] | None = None
        self._cand_mask: list[bool] = []
        self._cand_inc: list[int] = []

    def start(self, works: Sequence[dist.Work | None], include: Callable[[int], bool],
              candidates: Sequence[int]) -> None:
        """Make ``candidates`` pending on this step's ``works``; ``include(t)`` says, when its
        update runs, whether tensor ``t`` is stepped."""
        self.works = list(works)
        self.include = include
        if candidates is not self._cand_of:   # the same candidates every step: masks once
            mask = [False] * self.n
            for t in candidates:
                mask[t] = True
            self._cand_of, self._cand_mask = candidates, mask
            self._cand_inc = [nb if on else 0 for nb, on in zip(self.nblocks, mask)]
        self.pending[:] = self._cand_mask
        self.t_incomplete[:] = self._cand_inc
        self.n_pending = len(candidates)
        self.complete = [False] * self.m
        self.done_ptr = 0
        self.ready = []
        self.waited = set()
        if self.n_drop:   # (none left: every update ran before this step's backward)
            self.drop[:] = bytes(self.n)
            self.n_drop = 0

    def drop_grads(self) -> None:
        """``zero_grad(set_to_none=True)``: a pending tensor whose ``p.grad`` is its view
        keeps it until its update has read it, then loses it; every other ``p.grad`` goes
        now. What user code reads is the same (a read of a pending
        tensor's ``p.grad`` runs its update first, :mod:`.guard`), and the update writes
        ``p.grad`` once instead of three times (to the view for the call, back to ``None``
        after it, after ``None`` at ``zero_grad()``)."""
        pending, drop, views = self.pending, self.drop, self.grads.views
        n_drop = self.n_drop
        for t, p in enumerate(self.grads.params):
            if pending[t] and p.grad is views[t]:
                if not drop[t]:
                    drop[t] = 1
                    n_drop += 1
            else:
                p.grad = None
        self.n_drop = n_drop

    def _complete_block(self, k: int) -> None:
        w = self.works[k]
        if w is not None and id(w) not in self.waited:
            self._wait(w, self._what(k))
            self.waited.add(id(w))
        self.complete[k] = True
        inc, pending = self.t_incomplete, self.pending
        for t in self.grads.block_tensors[k]:
            inc[t] -= 1
            if inc[t] == 0 and pending[t]:
                self.ready.append(t)

    def gate(self, need: Sequence[int]) -> None:
        """A module's forward is about to use ``need``: wait for their blocks, then update them
        together with every other pending tensor whose blocks have finished already (one
        optimizer call instead of several)."""
        tr = self.trace
        t0 = tr.now() if tr is not None else 0.0
        complete, tb = self.complete, self.grads.tensor_blocks
        for t in need:
            if self.pending[t]:
                for k in tb[t]:
                    if not complete[k]:
                        self._complete_block(k)
        works, m, order = self.works, self.m, self.order
        while self.done_ptr < m:
            k = order[self.done_ptr]
            if not complete[k]:
                w = works[k]
                if w is not None and not w.is_completed():
                    break
                self._complete_block(k)
            self.done_ptr += 1
        ready, self.ready = self.ready, []
        t1 = tr.now() if tr is not None else 0.0
        self._apply([t for t in ready if self.pending[t]])
        if tr is not None:
            tr.gate(need, t0, t1)

    def flush(self) -> list[int]:
        """Apply every pending update (waits for all blocks); returns the tensors it applied."""
        for k in range(self.m):
            if not self.complete[k]:
                self._complete_block(k)
        self.done_ptr = self.m
        self.ready = []
        return self._apply([t for t in range(self.n) if self.pending[t]])

    def _apply(self, ts: list[int]) -> list[int]:
        if not ts:
            return []
        pending, include = self.pending, self.include
        for t in ts:
            pending[t] = False
        self.n_pending -= len(ts)
        if self.guard is not None:
            self.guard.disarm(ts)
        select = getattr(include, "select", None)
        self.stepper.step(select(ts) if select is not None else [t for t in ts if include(t)])
        if self.n_drop:
            drop, params = self.drop, self.grads.params
            for t in ts:
                if drop[t]:
                    drop[t] = 0
                    self.n_drop -= 1
                    params[t].grad = None
        return ts


class StreamUpdates:
    """Overlap mode on CUDA: ``start()`` enqueues every update on an update stream, in a few
    groups; a forward gate waits for an event.

    The tensors are ordered by the last block covering them and cut into at most ``groups``
    groups; group ``g`` waits (on the update stream) for the collectives of the blocks up to
    its last one, steps its tensors in one optimizer call and records an event. A gate makes
    the current stream wait for the event of the latest group among the tensors it needs.
    """

    def __init__(self, grads: FlatGrads, stepper: SubsetStepper,
                 wait: Callable[[dist.Work, str], None], what: Callable[[int], str],
                 device: torch.device, groups: int = STREAM_UPDATE_GROUPS):
        self.grads, self.stepper, self._wait, self._what = grads, stepper, wait, what
        self.device = device
        self.n, self.m = grads.n, len(grads.block_views)
        self.stream = torch.cuda.Stream(device)
        last = [max(ks) for ks in grads.tensor_blocks]
        order = sorted(range(self.n), key=lambda t: last[t])
        cuts = update_groups([last[t] for t in order], groups)
        #: (blocks to wait for, tensors) per group, in issue order.
        self.groups: list[tuple[list[int], list[int]]] = []
        self.group_of = [0] * self.n
        waited = -1
        for gi, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            ts = order[lo:hi]
            top = last[ts[-1]]
            self.groups.append((list(range(waited + 1, top + 1)), ts))
            waited = top
            for t in ts:
                self.group_of[t] = gi
        self.events = [torch.cuda.Event() for _ in self.groups]
        self.active = False
        self.waited = -1
        self.n_pending = 0
        #: Not tracked per tensor: a gate is one event wait.
        self.pending = None
        #: Disarms the tensors whose update the current stream waited for (:mod:`.guard`).
        self.guard: Any = None

    def start(self, works: Sequence[dist.Work | None], include: Callable[[int], bool],
              candidates: Sequence[int]) -> None:
        cand = set(candidates)
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        self._keep_alive()
        with torch.cuda.stream(self.stream):
            for (blocks, ts), ev in zip(self.groups, self.events):
                for k in blocks:
                    w = works[k]
                    if w is not None:
                        self._wait(w, self._what(k))   # the update stream waits
                self.stepper.step([t for t in ts if t in cand and include(t)])
                ev.record(self.stream)
        self.active = True
        self.waited = -1
        self.n_pending = len(cand)

    def _keep_alive(self) -> None:
        """Mark the tensors the queued updates read but the caller owns as used by the update
        stream: ``found_inf`` (GradScaler drops it as soon as ``step()`` returns) and the
        recorded hyperparameters (a tensor ``lr`` is replaced at the next ``step()``). Without
        it the caching allocator could hand their memory to the compute stream while the
        update stream still reads it."""
        st = self.stepper
        vals = list(st.attrs.values()) + [v for hp in st.hp for v in hp.values()]
        for v in vals:
            if torch.is_tensor(v) and v.is_cuda:
                v.record_stream(self.stream)

    def gate(self, need: Sequence[int]) -> None:
        if not self.active or not need:
            return
        g = max(self.group_of[t] for t in need)
        if g > self.waited:
            torch.cuda.current_stream(self.device).wait_event(self.events[g])
            if self.guard is not None:
                for gi in range(self.waited + 1, g + 1):
                    self.guard.disarm(self.groups[gi][1])
            self.waited = g
            if g == len(self.groups) - 1:
                self.active = False
                self.n_pending = 0

    def flush(self) -> list[int]:
        """Make the current stream wait for every update; returns the tensors no gate had
        waited for (their updates were not known to be done when the forward ran)."""
        if not self.active:
            return []
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        late = [t for t in range(self.n) if self.group_of[t] > self.waited]
        if self.guard is not None:
            self.guard.disarm(late)
        self.active = False
        self.n_pending = 0
        return late

    def drop_grads(self) -> None:
        """``zero_grad(set_to_none=True)``: every ``p.grad`` goes now (the queued updates
        read the views, which they hold)."""
        for p in self.grads.params:
            p.grad = None


def update_groups(last: Sequence[int], groups: int) -> list[int]:
    """Cut points of a sorted list of "last block" values into at most ``groups`` runs of
    about equal length, each cut between two different values.

    Example::

        >>> update_groups([0, 0, 1, 2, 2, 2, 3, 5], 3)
        [0, 3, 6, 8]
        >>> update_groups([4, 4, 4], 8)
        [0, 3]
    """
    n = len(last)
    cuts = [0]
    for g in range(1, groups):
        c = max(round(n * g / groups), cuts[-1] + 1)
        while 0 < c < n and last[c] == last[c - 1]:
            c += 1
        if c >= n:
            break
        if c > cuts[-1]:
            cuts.append(c)
    cuts.append(n)
    return cuts


def inner_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` as the optimizer's own class defines it, also when the user's object is
    routed through the runtime (:func:`usbyte_opt.runtime.wrapper.take_over`)."""
    d = opt.__dict__
    if "_usbyte_rt" not in d:
        opt.step()
        return
    before = d.get("_usbyte_inner", False)
    d["_usbyte_inner"] = True
    try:
        opt.step()
    finally:
        d["_usbyte_inner"] = before


class _no_autocast:
    """Disable autocast for the optimizer step if it is on (the update runs in full precision)."""

    __slots__ = ("dev", "ctx")

    def __init__(self, device: torch.device):
        self.dev = device.type
        self.ctx: Any = None

    def __enter__(self) -> None:
        if torch.is_autocast_enabled(self.dev):
            self.ctx = torch.autocast(self.dev, enabled=False)
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
            self.ctx = None
