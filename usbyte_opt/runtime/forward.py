"""The runtime's forward hooks: update gates, module buffers, ``torch.compile``.

* **Gates.** A tensor's pending update runs right before its first use in the next forward:
  the guard (:mod:`.guard`) arms every tensor with a pending update at ``step()``, and the
  first torch call that reads one (a module's ``F.linear(x, self.weight)``, a parent reading
  a child's weight before calling the child, ``p.data``) runs its update, with every other
  pending update whose blocks have finished, before it proceeds. No hook per module: the
  forward pays nothing per module, and a few settling calls per step (one per update group
  on CUDA; on CPU one per tensor whose blocks were still in flight). Forwards without grad,
  or in eval mode, apply every pending update first, in the root module's pre-hook
  (inference code paths such as ``nn.TransformerEncoderLayer``'s fast path check for
  overridden tensors and would leave it); a module with such a fast path called on its own
  outside a training forward runs its pending updates first (a global pre-hook, installed
  only for models that contain one). While the tuner measures an iteration
  (``probe``), a pre-hook on each module that owns trainable tensors notes when the forward
  first needs them; the hooks are on for each training forward only (a module hook takes
  ``nn.TransformerEncoderLayer``'s eval forward off its fast path, which DDP's takes).
* **Buffers** (BatchNorm statistics): DDP's rule, :class:`.semantics.BufferSync`, run by
  the root hooks when the model's own forward is the forward through DDP (the
  Horovod-style optimizer); under :class:`usbyte_opt.DistributedDataParallel` the wrapper's
  forward runs it instead, and forwards of the bare module are not synced, as under DDP.
* **torch.compile.** The root pre-hook runs eagerly before the compiled graph (a graph break
  at its very start). From there to the end of the forward, dynamo splits each graph it
  compiles at the plan's blocks, with a gate before each piece (:mod:`.compiled`): a
  training forward leaves the updates of the tensors a split graph gates pending for those
  gates, and applies the others there. Before the first split graph exists (the forward
  that compiles it), in eval or no-grad forwards, and for a model whose training forward
  runs as several graphs (a graph break), every pending update runs there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import UsbyteError
from .comm import Channel
from .compiled import PlanSplit, check_forward
from .semantics import BufferSync
from .updates import Updates


class ForwardGates:
    """The forward-side hooks of one optimizer.

    Args:
        model: the root module.
        params: the trainable tensors, by runtime index.
        updates: the pending updates.
        chan: the channel.
        buffer_sync: DDP's buffer rule, run at the start and end of each root forward; None
            where the wrapper's forward runs it (or nothing is synced).
        clear_flushed: called at the start of each forward (the stale-use check).
        output_grad: the gradient hook put on the outputs of each training forward.
        grad_sync: whether the backward of the forward now running communicates (not
            ``no_sync()``, the last of ``backward_passes_per_step``): DDP's
            ``require_backward_grad_sync`` for the buffer rule.
        pieces: each tensor's piece of a compiled graph (:func:`.compiled.plan_pieces`).
        accept_rounding: compile the plan's pieces under any backend
            (:class:`.compiled.PlanSplit`).
    """

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter],
                 updates: Updates, chan: Channel,
                 buffer_sync: BufferSync | None, clear_flushed: Callable[[], None],
                 output_grad: Callable[[torch.Tensor], None] | None = None,
                 grad_sync: Callable[[], bool] = lambda: True,
                 pieces: list[int] | None = None, accept_rounding: bool = False):
        self.model, self.updates, self.chan = model, updates, chan
        self.buffer_sync = buffer_sync
        self.grad_sync = grad_sync
        self.clear_flushed = clear_flushed
        self.output_grad = output_grad
        self._probe: Any = None
        self._probe_handles: list[Any] = []
        index = {id(p): t for t, p in enumerate(params)}
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
        if isinstance(model, torch.nn.TransformerEncoderLayer):
            # Its inference fast path is off while any of its modules has a forward hook (the
            # root's are on it for good); DDP's bare module keeps it.
            raise UsbyteError("the model is an nn.TransformerEncoderLayer itself: usbyte-opt's "
                              "forward hooks on it would turn off its inference fast path "
                              "(torch._transformer_encoder_layer_fwd), which it takes under "
                              "DDP; train a module that contains it")
        #: Modules with an inference fast path that torch leaves when a tensor it passes has
        #: ``__torch_function__`` (an armed one, :mod:`.guard`), and the trainable tensors of
        #: each (its whole subtree: the check covers them all).
        self.fast_path: dict[int, list[int]] = {
            id(mod): [index[id(p)] for p in mod.parameters() if id(p) in index]
            for mod in model.modules() if isinstance(mod, _FAST_PATH_MODULES)}
        #: Code compiled apart from the model runs in its forward: every update of a
        #: training forward runs before it (:func:`compiled_inside`).
        self.compiled_inside = compiled_inside(model)
        #: torch.compile: the plan's pieces, and the gates' way in (:mod:`.compiled`).
        self.split = PlanSplit(model, params, pieces if pieces is not None else [0] * len(params),
                               self.run_pending, accept_rounding)
        #: Updates left to the split graph's gates by the forward in progress.
        self._left = 0

    def run_pending(self, ts: list[int]) -> None:
        """The pending updates of ``ts`` run now (a split graph's gate before the piece that
        reads them, :meth:`fast_path_hook`)."""
        upd = self.updates
        if upd.n_pending:
            pending = upd.pending
            need = ts if pending is None else [t for t in ts if pending[t]]
            if need:
                upd.gate(need)

    def install(self, resplit: bool = True) -> list[Any]:
        """Register the hooks; returns their handles (``resplit``:
        :meth:`~usbyte_opt.runtime.compiled.PlanSplit.register`)."""
        handles = [self.model.register_forward_pre_hook(_Hook(self.root_pre_hook),
                                                        prepend=True),
                   self.model.register_forward_hook(_Hook(self.root_post_hook)),
                   # Ends a root forward, also one that raises.
                   self.model.register_forward_hook(_Hook(self._end_forward),
                                                    always_call=True),
                   _Removes(self)]
        if self.fast_path:
            # A global pre-hook: torch's fast-path checks read each module's own hook dicts,
            # which a hook of the module would fill (and so leave the fast path itself).
            handles.append(torch.nn.modules.module.register_module_forward_pre_hook(
                _Hook(self.fast_path_hook)))
        self.split.register(resplit)
        return handles

    @property
    def probe(self) -> Any:
        """The tuner's measurement of this iteration, or None. While one is set, each module
        that owns trainable tensors has a pre-hook noting when the forward first needs
        them, during each training forward through the root (:meth:`add_probe_hooks`)."""
        return self._probe

    @probe.setter
    def probe(self, probe: Any) -> None:
        # The modules' pre-hooks are put on by each training root forward and taken off at
        # its end (:meth:`add_probe_hooks`), never left on between forwards.
        self._probe = probe
        if probe is None:
            self.remove_probe_hooks()

    def add_probe_hooks(self) -> None:
        """The probe's pre-hook on each module that owns trainable tensors, for the training
        forward now starting (removed at its end, :meth:`_end_forward`).

        Only there: a module pre-hook changes what torch runs in other forwards.
        ``nn.TransformerEncoderLayer.forward`` leaves its fast path
        (``torch._transformer_encoder_layer_fwd``) when any of its modules has a forward
        hook (torch/nn/modules/transformer.py, "forward pre-/hooks are attached to the
        module"), and that fast path ignores CPU autocast (its check,
        ``torch.is_autocast_enabled()``, asks about CUDA only): an eval forward under bf16
        autocast computes in fp32 under DDP, in bf16 with the hooks on (Lightning's
        validation loss differed from DDP's while the tuner measured)."""
        if not self._probe_handles:
            self._probe_handles = [mod.register_forward_pre_hook(_Hook(self.module_hook(ts)))
                                   for mod, ts in self.owned.values()]

    def remove_probe_hooks(self) -> None:
        for h in self._probe_handles:
            h.remove()
        self._probe_handles = []

    def _end_forward(self, *args: Any) -> None:
        """Runs last after every root forward, also one that raised: the nesting depth goes
        back."""
        if self.depth > 0:
            self.depth -= 1
            if self.depth == 0 and self._probe_handles:
                self.remove_probe_hooks()

    def module_hook(self, ts: list[int]) -> Callable[..., None]:
        """The pre-hook of a module owning the tensors ``ts`` while a probe is set: notes the
        need, and runs their pending updates (as the guard would at their first use)."""
        upd = self.updates

        def hook(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return None  # a compiled forward: the root hook applied every update
            if self._probe is not None:
                self._probe.need(ts)
            if upd.n_pending:
                pending = upd.pending
                if pending is None or any(pending[t] for t in ts):
                    upd.gate(ts)
            return None
        return hook

    def fast_path_hook(self, module: torch.nn.Module, args: Any) -> None:
        """Before a module with an inference fast path (``nn.TransformerEncoderLayer``,
        ``nn.MultiheadAttention``) runs outside a training forward: the pending updates of its
        tensors, so that none is armed when its forward chooses the path. Under DDP its
        tensors are plain, and an eval/no-grad forward takes the fast path; an armed tensor
        (``torch.overrides.has_torch_function``) would send it down the slow path, which
        computes otherwise (under CPU autocast: bf16 instead of fp32). Eval forwards through
        the root have run every update already; this covers a submodule called on its own."""
        if not self.updates.n_pending or torch.compiler.is_compiling():
            return None
        ts = self.fast_path.get(id(module))
        if ts is not None and not (module.training and torch.is_grad_enabled()):
            self.run_pending(ts)
        return None

    def root_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Runs eagerly before the compiled graph. torch._dynamo is only touched here,
            # where compiling has imported it already.
            return torch._dynamo.disable(_compiled_pre)(
                self, module.training and torch.is_grad_enabled())
        self.depth += 1
        if self.depth > 1:
            return None  # inside the root's own forward: the outer call did all of this
        training = module.training and torch.is_grad_enabled()
        if self._probe is not None and training:
            self.add_probe_hooks()
            self._probe.forward_begin()
            self._probe.need(self.root_owned)
        if self.buffer_sync is not None:
            self.buffer_sync.pre_forward()
        self.clear_flushed()
        if self.updates.n_pending and (not training or self.compiled_inside):
            self.updates.flush()
        return None

    def root_post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return torch._dynamo.disable(_compiled_post)(self, module, output)
        if self.depth > 1:
            return None  # an inner root forward: the outer one is the forward through DDP
        if self._probe is not None and module.training and torch.is_grad_enabled():
            self._probe.forward_end()
        if self.buffer_sync is not None:
            self.buffer_sync.post_forward(self.grad_sync())
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


#: Module classes whose forward has an inference fast path that any ``__torch_function__``
#: tensor argument disables (torch/nn/modules/transformer.py, activation.py).
_FAST_PATH_MODULES = (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer,
                      torch.nn.MultiheadAttention)


#: True (an attribute or property) on a model whose forward runs code compiled apart from it
#: that :func:`compiled_inside` cannot see (the Lightning integration's root, whose forward
#: calls a LightningModule's compiled ``training_step``).
COMPILED_INSIDE_ATTR = "_usbyte_compiled_inside"


def compiled_inside(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward runs code that ``torch.compile`` compiled apart from the
    model (the runtime does not split it; its armed parameters' updates would be traced into
    that graph): a submodule compiled on its own, a module's method replaced by its compiled
    form (Lightning compiles a LightningModule's ``forward`` and ``*_step`` methods so), or a
    model marked with :data:`COMPILED_INSIDE_ATTR`.

    Example::

        >>> import torch
        >>> compiled_inside(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        False
    """
    if getattr(model, COMPILED_INSIDE_ATTR, False):
        return True
    for m in model.modules():
        if m is not model and type(m).__name__ == "OptimizedModule":
            return True
        if any(hasattr(v, "_torchdynamo_orig_callable") for v in vars(m).values() if callable(v)):
            return True
    return False


class _Removes:
    """A handle that removes the probe's module hooks with the others."""

    __slots__ = ("gates",)

    def __init__(self, gates: ForwardGates):
        self.gates = gates

    def remove(self) -> None:
        self.gates.remove_probe_hooks()
        self.gates.split.unregister()


def _compiled_pre(gates: ForwardGates, training: bool = True) -> None:
    split = gates.split
    split.enter()
    if gates.buffer_sync is not None:
        gates.buffer_sync.pre_forward()
    gates.clear_flushed()
    gates._left = 0
    upd = gates.updates
    if not upd.n_pending:
        return
    if not (training and split.gated):
        upd.flush()
        return
    # The split graphs' gates run the updates of the tensors they read; the others run now.
    # The tensors left pending are disarmed (dynamo's guards check their class).
    covered, rest = split.gated_and_rest()
    if rest:
        upd.gate(rest)
    if upd.guard is not None:
        upd.guard.disarm(covered)
    gates._left = upd.n_pending


def _compiled_post(gates: ForwardGates, module: torch.nn.Module, output: Any = None) -> None:
    left, gates._left = gates._left, 0
    check_forward(gates.split, module.training and torch.is_grad_enabled(), left,
                  gates.updates.n_pending)
    if gates.buffer_sync is not None:
        gates.buffer_sync.post_forward(gates.grad_sync())
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
