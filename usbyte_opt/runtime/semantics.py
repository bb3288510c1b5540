"""DDP's semantics, in one place: what the runtime must do exactly as torch's
``DistributedDataParallel`` does, and what it refuses because it cannot.

Everything a user of DDP can observe that is not the averaged gradient itself is decided
here, and nowhere else:

* **Module buffers** (:class:`BufferSync`). DDP's rule (``_pre_forward``, ``_post_forward``,
  ``will_sync_module_buffers``): a forward *through DDP* starts by broadcasting rank 0's
  buffers when ``require_forward_param_sync`` is set, which the previous forward through DDP
  set to "grad was enabled and gradient sync was on" (so not after a ``no_sync()`` forward
  or a ``torch.no_grad()`` forward, but also at the start of an eval forward that follows a
  training one), and which is set at construction. Forwards of the bare module are never
  synced, and each rank keeps the statistics of its own last forward until the next
  synced forward starts. The broadcast is synchronous, at the start of the forward, of the
  buffers as they are then (whatever user code did to them in between: averaging them over
  the ranks, loading a checkpoint, an EMA update). The buffer list is read again at every
  sync (a buffer reassigned is the new one), leaving out those named in
  ``module._ddp_params_and_buffers_to_ignore``; the broadcast leaves the buffers' version
  counters alone, as DDP's does.
* **Optimizers** (:func:`steps_per_parameter`). The runtime may step an optimizer on a
  subset of the model's tensors (each as soon as its blocks have arrived) only when the
  optimizer updates every parameter independently of the others: torch.optim's
  per-parameter classes (not subclasses that define their own ``step``), and classes the
  user declares with :func:`per_parameter`, with no step hook (which would run once per
  subset; one registered later is refused). Any other optimizer (a global gradient norm
  inside ``step()`` as LAMB-style optimizers compute it, state shared across parameters,
  counters kept in the param group) is stepped whole, once, after its last block, as under
  DDP.
* **Refusals** (:func:`check_ddp_arguments`, :func:`check_module`). DDP options and module
  attributes whose behaviour the runtime does not reproduce are refused in one line, on
  every rank (each rank runs the same checks on the same arguments).

Example::

    >>> import torch
    >>> steps_per_parameter(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]))
    True
    >>> class Lamb(torch.optim.Optimizer):
    ...     def step(self, closure=None): ...
    >>> steps_per_parameter(Lamb([torch.nn.Parameter(torch.ones(1))], {}))
    False
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import UsbyteError

#: DDP's bucket size for broadcasting buffers (``broadcast_bucket_size``).
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024

# -- module buffers -----------------------------------------------------------------------------


class BufferSync:
    """DDP's forward-side buffer rule for one model (see the module's docstring).

    Args:
        module: the model whose buffers are synced (the module DDP would wrap).
        group: the data-parallel process group (``None``: the default group).
        enabled: DDP's ``broadcast_buffers`` (``forward_sync_buffers``); ``False``: never.

    The owner calls :meth:`pre_forward` at the start and :meth:`post_forward` at the end of
    every forward through DDP (the wrapper's forward; with the Horovod-style optimizer, the
    model's own). :attr:`require_forward_param_sync` is DDP's flag of the same name; where
    torch's DDP runs some forwards instead (before the takeover, verification's windows), the
    owner hands the flag to it and takes it back, so the rule runs across both.

    Example (one rank: the broadcast is a no-op, the flag follows DDP's rule)::

        >>> import os, tempfile, torch, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> sync = BufferSync(torch.nn.BatchNorm1d(3), None, True)
        >>> sync.pre_forward()               # set at construction: the first forward syncs
        True
        >>> with torch.no_grad():
        ...     sync.post_forward(grad_sync=True)
        >>> sync.pre_forward()               # after a no-grad forward: nothing
        False
        >>> dist.destroy_process_group()
    """

    __slots__ = ("module", "group", "enabled", "require_forward_param_sync", "world_size",
                 "syncs", "bufs")

    def __init__(self, module: torch.nn.Module, group: dist.ProcessGroup | None, enabled: bool):
        self.module = module
        self.group = group
        self.enabled = bool(enabled)
        #: DDP's flag: set at construction, then by each forward through DDP.
        self.require_forward_param_sync = True
        self.world_size = dist.get_world_size(group)
        #: How many broadcasts ran (tests and reports).
        self.syncs = 0
        #: The buffers as last read (DDP's ``modules_buffers``): a model without any at the
        #: last read is not walked again at each forward, as DDP's ``will_sync_module_buffers``.
        self.bufs = module_buffers(module)

    def buffers(self) -> list[torch.Tensor]:
        """The buffers DDP syncs now: ``named_buffers()`` less the ignored names."""
        return module_buffers(self.module)

    def pre_forward(self) -> bool:
        """The start of a forward through DDP: broadcast rank 0's buffers if DDP would.
        Returns whether it did (on one rank: whether DDP would)."""
        if not (self.enabled and self.require_forward_param_sync and self.bufs):
            return False
        if torch.compiler.is_compiling():
            return bool(torch._dynamo.disable(self._broadcast)())
        return self._broadcast()

    def _broadcast(self) -> bool:
        bufs = self.bufs = self.buffers()   # read again, as DDP's _assign_modules_buffers
        if not bufs:
            return False
        self.syncs += 1
        if self.world_size > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(bufs)):
                dist._broadcast_coalesced(group, bufs, BROADCAST_BUCKET_BYTES, src)
        return True

    def post_forward(self, grad_sync: bool) -> None:
        """The end of a forward through DDP (one that returned): the next one syncs if this
        one ran with grad enabled and gradient sync on (``grad_sync``: not inside
        ``no_sync()``, and its backward communicates)."""
        self.require_forward_param_sync = bool(torch.is_grad_enabled() and grad_sync)

    def run_ddp(self, ddp: Any, call: Callable[[], Any]) -> Any:
        """Run a forward of torch's own DDP (``call()``) under this rule: DDP gets the flag,
        and the flag comes back from it."""
        ddp.require_forward_param_sync = self.require_forward_param_sync
        if hasattr(ddp, "forward_sync_buffers"):
            ddp.forward_sync_buffers = self.enabled
        else:   # older torch
            ddp.broadcast_buffers = self.enabled
        out = call()
        self.require_forward_param_sync = bool(ddp.require_forward_param_sync)
        return out


def module_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers DDP broadcasts: ``module.named_buffers()`` less the names in
    ``module._ddp_params_and_buffers_to_ignore``."""
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())
    return [b for n, b in module.named_buffers() if n not in ignore]


# -- optimizers ---------------------------------------------------------------------------------

_OptimizerClass = TypeVar("_OptimizerClass", bound=type)

#: torch.optim's classes whose ``step()`` updates each parameter from its own gradient and
#: state only (foreach and fused implementations included; hyperparameters are only read).
_TORCH_PER_PARAMETER = ("SGD", "Adam", "AdamW", "Adamax", "Adadelta", "Adagrad", "Adafactor",
                        "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop", "SparseAdam")

#: Classes the user declared per-parameter (:func:`per_parameter`).
_DECLARED: set[type] = set()


def _known_classes() -> list[type]:
    return [c for c in (getattr(torch.optim, n, None) for n in _TORCH_PER_PARAMETER)
            if isinstance(c, type)]


def per_parameter(cls: _OptimizerClass) -> _OptimizerClass:
    """Declare an optimizer class per-parameter: its ``step()`` updates each parameter from
    that parameter's gradient, state and its group's hyperparameters only, and changes no
    value of its param groups. The runtime may then step it on the tensors whose blocks have
    arrived, in several calls per step (overlap mode); undeclared classes are stepped whole,
    once per step. Usable as a decorator; returns the class.

    A declared class whose ``step()`` changes a param group's value is refused at that step,
    in one line.

    Example::

        >>> import torch, usbyte_opt
        >>> @usbyte_opt.per_parameter
        ... class SignSGD(torch.optim.Optimizer):
        ...     def __init__(self, params, lr=0.01):
        ...         super().__init__(params, {"lr": lr})
        ...     @torch.no_grad()
        ...     def step(self, closure=None):
        ...         for g in self.param_groups:
        ...             for p in g["params"]:
        ...                 if p.grad is not None:
        ...                     p.add_(p.grad.sign(), alpha=-g["lr"])
        >>> steps_per_parameter(SignSGD([torch.nn.Parameter(torch.ones(2))]))
        True
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UsbyteError(f"per_parameter: expected a torch.optim.Optimizer subclass, got {cls!r}")
    _DECLARED.add(cls)
    return cls


def step_hooks(optimizer: torch.optim.Optimizer) -> int:
    """How many step hooks would run around each call of ``optimizer.step()``: its own
    (``register_step_pre_hook``/``post_hook``) and torch's global ones, less the runtime's
    own (the wrapper's, while it waits for the optimizer's first step)."""
    from torch.optim import optimizer as torch_optimizer

    own = sum(len(getattr(optimizer, k, None) or ())
              for k in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"))
    glob = [h for d in (torch_optimizer._global_optimizer_pre_hooks,
                        torch_optimizer._global_optimizer_post_hooks) for h in d.values()
            if getattr(h, "__module__", "") != "usbyte_opt.runtime.wrapper"]
    return own + len(glob)


def steps_per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the runtime may step ``optimizer`` on subsets of its parameters: its class is
    one of torch.optim's per-parameter classes (or a subclass that keeps that class's
    ``step``), or was declared with :func:`per_parameter`, and no step hook would run once
    per subset (:func:`step_hooks`: under DDP each runs once per step)."""
    if step_hooks(optimizer):
        return False
    cls: Any = type(optimizer)
    if any(issubclass(cls, d) and cls.step is getattr(d, "step", None) for d in _DECLARED):
        return True
    return any(issubclass(cls, k) and cls.step is getattr(k, "step", None)
               for k in _known_classes())


def check_no_new_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, in one line, step hooks registered after the runtime chose to step
    ``optimizer`` per block: each would run once per block instead of once per step."""
    if step_hooks(optimizer):
        raise UsbyteError(
            f"a step hook was registered on {type(optimizer).__name__} (or globally) after "
            "usbyte-opt's runtime took it over: the runtime steps it per block, so the hook "
            "would run several times per step; register step hooks before wrapping (the "
            "optimizer is then stepped whole, once per step, as under DDP)")


def declared(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is per-parameter by the user's declaration (:func:`per_parameter`)
    rather than as one of torch.optim's classes."""
    cls: Any = type(optimizer)
    return (not any(issubclass(cls, k) and cls.step is getattr(k, "step", None)
                    for k in _known_classes())
            and any(issubclass(cls, d) for d in _DECLARED))


def group_changed(before: Mapping[str, Any], group: Mapping[str, Any],
                  versions: Mapping[str, int]) -> str | None:
    """The first key of a param group that a step changed: a value replaced, or a tensor
    value changed in place (its version counter moved). ``before``: the values put in for
    the call; ``versions``: their tensors' versions then."""
    for key in group:
        if key != "params" and key not in before:
            return key
    for key, val in before.items():
        cur = group.get(key)
        if cur is not val:
            return key
        if torch.is_tensor(val) and val._version != versions.get(key):
            return key
    return None


# -- refusals -----------------------------------------------------------------------------------

#: DDP constructor options whose behaviour the runtime does not reproduce, with their
#: do-nothing values: any other value is refused when a schedule runs.
UNSUPPORTED_OPTIONS: dict[str, Any] = {
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "device_mesh": None,
    "skip_all_reduce_unused_params": False,
    "init_sync": True,
}


def check_ddp_arguments(options: Mapping[str, Any]) -> None:
    """Refuse, in one line, a DDP option whose behaviour a planned schedule does not
    reproduce (the value given differs from DDP's default). Every rank passes the same
    options, so every rank raises."""
    for name, default in UNSUPPORTED_OPTIONS.items():
        if name in options and options[name] is not default and options[name] != default:
            raise UsbyteError(
                f"DistributedDataParallel({name}={options[name]!r}): usbyte-opt's runtime does "
                f"not reproduce this DDP option; drop it or run without a schedule (torch's DDP "
                f"then runs)")


def check_module(module: torch.nn.Module) -> None:
    """Refuse, in one line, a module whose DDP behaviour the runtime does not reproduce:
    parameters DDP is told to ignore (``_ddp_params_and_buffers_to_ignore`` naming a
    trainable parameter: DDP would leave it unaveraged, the runtime's schedule averages every
    trainable parameter). Ignored buffers are honoured (:func:`module_buffers`)."""
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())
    if not ignore:
        return
    named = [n for n, p in module.named_parameters() if p.requires_grad and n in ignore]
    if named:
        raise UsbyteError(
            f"parameter {named[0]!r} is in the module's _ddp_params_and_buffers_to_ignore: DDP "
            "would not average it, usbyte-opt's runtime averages every trainable parameter; "
            "freeze it (requires_grad=False) or run torch's DDP")
