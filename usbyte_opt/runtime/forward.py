"""The runtime's forward hooks: update gates, module buffers, ``torch.compile``.

* **Gates.** A forward pre-hook on each module that owns trainable tensors runs the pending
  updates of those tensors first (:mod:`.updates`). Parameters used before, or outside,
  their module's forward (a parent calling ``F.linear(x, self.child.weight)`` before, or
  instead of, ``self.child(...)``) are learned in the first iteration: its training forward
  runs under a :class:`~torch.overrides.TorchFunctionMode` that sees every torch call (as the
  profiler's discovery pass does, :mod:`usbyte_opt.profiler.timing`), and a tensor whose first
  use (metadata reads such as ``.shape`` aside) comes before any pre-hook of its owning
  modules, or that gets a gradient without one having run, is gated from then on in the root
  module's pre-hook, before the forward starts. Forwards without grad, or in eval mode,
  apply every pending update first (inference code paths such as
  ``nn.TransformerEncoderLayer``'s fast path read weights without running the owning modules).
* **Buffers** (BatchNorm statistics), as DDP's ``broadcast_buffers=True``: after every
  training forward with grad enabled, rank 0's buffers are broadcast (async, ordered before
  that iteration's gradient blocks) and installed at the start of the next forward or at
  ``synchronize()``.
* **torch.compile.** Inside a compiled forward the module pre-hooks do nothing; the root
  pre-hook runs eagerly before the compiled graph (a graph break at its very start) and applies
  every pending update there. Communication still overlaps backward; updates do not overlap a
  compiled forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..first_use import FirstUse
from .comm import Channel
from .updates import Updates


class ForwardGates:
    """The forward-side hooks of one optimizer.

    Args:
        model: the root module.
        params: the trainable tensors, by runtime index.
        updates: the pending updates.
        chan: the channel (buffer broadcasts).
        buffers: the module buffers to broadcast from rank 0 (empty: none).
        clear_flushed: called at the start of each forward (the stale-use check).
    """

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter],
                 updates: Updates, chan: Channel,
                 buffers: list[torch.Tensor], clear_flushed: Callable[[], None],
                 output_grad: Callable[[torch.Tensor], None] | None = None):
        self.model, self.updates, self.chan, self.buffers = model, updates, chan, buffers
        self.clear_flushed = clear_flushed
        self.output_grad = output_grad
        self.buf_pending: list[tuple[dist.Work, list[torch.Tensor], torch.Tensor]] = []
        self.probe: Any = None          # the tuner's measurement of this iteration, or None
        self.learning = True            # first iteration: which tensors bypass their modules
        self.seen = [False] * len(params)
        self.root_extra: list[int] = []
        index = {id(p): t for t, p in enumerate(params)}
        self.index = index
        self.watch: FirstUse | None = None   # active during a learning forward
        #: Root forwards running now: a root forward called inside another (a step function
        #: that calls ``self(x)``) is part of the outer one, and the root hooks act once.
        self.depth = 0
        self.owned: dict[int, tuple[torch.nn.Module, list[int]]] = {}
        for mod in model.modules():
            ts = [index[id(p)] for p in mod._parameters.values()
                  if p is not None and id(p) in index]
            if ts:
                self.owned[id(mod)] = (mod, ts)
        self.root_owned = self.owned.pop(id(model), (model, []))[1]
        self.root_owned_set = set(self.root_owned)

    def install(self) -> list[Any]:
        """Register the hooks; returns their handles."""
        handles = [mod.register_forward_pre_hook(_Hook(self.module_hook(ts)))
                   for mod, ts in self.owned.values()]
        handles.append(self.model.register_forward_pre_hook(_Hook(self.root_pre_hook),
                                                            prepend=True))
        handles.append(self.model.register_forward_hook(_Hook(self.root_post_hook)))
        # Ends the learning forward's watch, also when the forward raises.
        handles.append(self.model.register_forward_hook(_Hook(self._end_watch), always_call=True))
        return handles

    def _early(self, t: int) -> None:
        """Tensor ``t`` is used, in the learning forward, before any of its owners' pre-hooks
        ran: gate it at the root from then on."""
        if not self.seen[t]:
            self.seen[t] = True
            if t not in self.root_owned_set:
                self.root_extra.append(t)

    def _begin_watch(self) -> None:
        if self.watch is None:
            seen = self.seen
            self.watch = FirstUse(self.index, lambda t: None if seen[t] else self._early(t))
            self.watch.__enter__()

    def _end_watch(self, *args: Any) -> None:
        """Runs last after every root forward, also one that raised: the nesting depth goes
        back, and the outermost forward ends the learning forward's watch."""
        if self.depth > 0:
            self.depth -= 1
            if self.depth > 0:
                return
        if self.watch is not None:   # (only reads when there is none: compiled forwards)
            w, self.watch = self.watch, None
            w.__exit__(None, None, None)

    def note_gradient(self, t: int) -> None:
        """Tensor ``t`` got a gradient: in the first iteration, one whose module's pre-hook
        did not run is gated at the root from then on."""
        if self.learning and not self.seen[t] and t not in self.root_owned_set:
            self.seen[t] = True
            self.root_extra.append(t)

    def module_hook(self, ts: list[int]) -> Callable[..., None]:
        upd = self.updates
        pending = upd.pending

        def hook(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return None  # a compiled forward: the root hook applied every update
            if self.probe is not None:
                self.probe.need(ts)
            if upd.n_pending:
                if pending is None or any(pending[t] for t in ts):
                    upd.gate(ts)
            elif self.learning:
                for t in ts:
                    self.seen[t] = True
            return None
        return hook

    def root_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Runs eagerly before the compiled graph. torch._dynamo is only touched here,
            # where compiling has imported it already.
            return torch._dynamo.disable(_compiled_pre)(self)
        self.depth += 1
        if self.depth > 1:
            return None  # inside the root's own forward: the outer call did all of this
        if self.probe is not None and module.training and torch.is_grad_enabled():
            self.probe.forward_begin()
            self.probe.need(self.root_owned)
        if self.buf_pending:
            self.wait_buffers()
        self.clear_flushed()
        if self.updates.n_pending:
            if not (module.training and torch.is_grad_enabled()):
                self.updates.flush()
                return None
            need = self.root_owned + self.root_extra
            if need:
                self.updates.gate(need)
        elif self.learning:
            for t in self.root_owned:
                self.seen[t] = True
            if module.training and torch.is_grad_enabled():
                self._begin_watch()
        return None

    def root_post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return torch._dynamo.disable(_compiled_post)(self, module, output)
        if self.depth > 1:
            return None  # an inner root forward: buffers go out once, after the outer one
        if self.probe is not None and module.training and torch.is_grad_enabled():
            self.probe.forward_end()
        self.broadcast_buffers(module)
        self.hook_outputs(module, output)
        return None

    def hook_outputs(self, module: torch.nn.Module, output: Any) -> None:
        """A training forward: its outputs' gradient hooks start the backward pass in the
        outermost backward (:meth:`.backward.StepComm.output_grad`)."""
        if self.output_grad is None or not torch.is_grad_enabled():
            return
        for t in _output_tensors(output):
            if t.requires_grad:
                t.register_hook(self.output_grad)

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        if self.buffers and module.training and torch.is_grad_enabled():
            self.wait_buffers()
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for b in self.buffers:
                by_dtype.setdefault(b.dtype, []).append(b)
            for bufs in by_dtype.values():
                flat = torch.cat([b.detach().reshape(-1) for b in bufs])
                self.buf_pending.append((self.chan.broadcast(flat), bufs, flat))

    def wait_buffers(self) -> None:
        pend, self.buf_pending = self.buf_pending, []
        for work, bufs, flat in pend:
            self.chan.wait(work, "broadcast of module buffers from rank 0")
            if self.chan.rank != 0:
                off = 0
                with torch.no_grad():
                    for b in bufs:
                        b.copy_(flat[off: off + b.numel()].view_as(b))
                        off += b.numel()


def _compiled_pre(gates: ForwardGates) -> None:
    gates.wait_buffers()
    gates.clear_flushed()
    if gates.updates.n_pending:
        gates.updates.flush()


def _compiled_post(gates: ForwardGates, module: torch.nn.Module, output: Any = None) -> None:
    gates.broadcast_buffers(module)
    gates.hook_outputs(module, output)


def _output_tensors(output: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors of a forward's output (tensors, sequences and mappings, a few levels)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if depth > 3:
        return []
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _output_tensors(o, depth + 1)]
    if isinstance(output, Mapping):
        return [t for o in output.values() for t in _output_tensors(o, depth + 1)]
    return []


class _Detached:
    """A hook that does nothing: what copies and pickles of the model carry instead of ours."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Hook:
    """A module hook of the runtime. ``copy.deepcopy(model)`` and ``torch.save(model)`` give
    a model without the runtime (a :class:`_Detached` hook), not a second optimizer."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _Detached:
        return _Detached()

    def __reduce__(self) -> tuple:
        return (_Detached, ())
