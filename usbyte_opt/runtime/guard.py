"""DDP's contract, enforced: parameters that are not in DDP's state yet wait when touched.

The runtime keeps communication in flight past ``backward()`` and updates in flight past
``step()``; that is where its speed comes from. Under DDP, when ``backward()`` returns every
``p.grad`` holds the averaged gradient, and when ``step()`` returns every parameter holds its
new value. Two windows of a step therefore differ from DDP, and code that touches a parameter
inside one would silently see other values than under DDP:

* the **gradient window**, from the end of the step's last backward pass until its blocks are
  waited for: ``p.grad`` is a view being all-reduced in place (``torch.nn.utils.
  clip_grad_norm_``, a logged gradient norm, gradient surgery, ``p.grad = new_tensor``);
* the **parameter window**, from ``step()`` until a tensor's pending update has run (in the
  next forward): its value is the previous one (an EMA, ``state_dict()``, ``deepcopy``,
  ``p.data.clamp_()``).

:class:`Guard` closes both without any change to user code. While a window is open, the
tensors it concerns are *armed*: their class is swapped for a subclass of their own class
(:func:`guarded_class`) whose ``__torch_function__`` sees every torch call and every
attribute read or write that touches them (``p.grad``, ``p.data``, any op, ``_foreach_*``
over lists, ``state_dict()``'s ``detach``, ``deepcopy``, pickling). The first such touch
settles what the touched tensor is waiting for (the whole step's gradient communication; or
that tensor's update), the tensors settled get their own class back, and the call proceeds
as under DDP. Reads of metadata (shape, dtype, device, ``requires_grad``, ...) settle nothing.
Outside the windows, and for every tensor once it is settled, nothing is swapped: a loop that
touches neither window pays one class assignment per tensor and window, and keeps all of its
overlap.

Example::

    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> seen = []
    >>> def settle(ts):                    # would run the tensors' updates
    ...     seen.append(ts)
    ...     g.disarm(ts)
    >>> g = Guard([p], on_grad=seen.append, on_param=settle)
    >>> g.arm_params([0])
    >>> _ = p.shape                       # metadata: nothing to wait for
    >>> type(p).__name__, seen
    ('GuardedParameter', [])
    >>> p.detach().sum().item()            # a read of the value: its update first
    3.0
    >>> type(p).__name__, seen
    ('Parameter', [[0]])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["Guard", "guarded_class"]

#: Attribute descriptors of ``torch.Tensor`` whose reads touch no value.
_META_ATTRS = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "is_cuda",
    "is_sparse", "is_quantized", "is_meta", "is_mps", "is_xpu", "names", "grad_fn",
    "_version", "is_nested", "itemsize", "nbytes", "_base", "_cdata", "output_nr",
    "_backward_hooks", "_post_accumulate_grad_hooks", "is_mkldnn", "is_complex",
})
#: Methods of ``torch.Tensor`` that read no value.
_META_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "stride", "is_contiguous",
    "is_floating_point", "is_complex", "data_ptr", "get_device", "__hash__", "__len__",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "storage_offset",
    "is_shared", "is_pinned", "untyped_storage", "_typed_storage", "retain_grad", "type",
    "__format__",
})
_GRAD = ("grad", "_grad")

#: id(tensor) -> (guard, index) for every tensor of a guard in use (armed or not).
_OWNER: dict[int, tuple[Guard, int]] = {}
_CLASSES: dict[type, type] = {}


def _name_of(func: Any) -> tuple[str, str]:
    """(kind, name): ``("get"|"set", attribute)`` for a descriptor access, else
    ``("call", function name)``."""
    desc = getattr(func, "__self__", None)
    fname = getattr(func, "__name__", "")
    if fname in ("__get__", "__set__", "__delete__") and desc is not None:
        return ("get" if fname == "__get__" else "set"), getattr(desc, "__name__", "")
    return "call", fname


def _torch_function(cls: type, func: Any, types: Any, args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None) -> Any:
    kwargs = kwargs or {}
    kind, name = _name_of(func)
    armed = [a for a in _tensors(args, kwargs) if getattr(type(a), "_usbyte_base", None)]
    for a in armed:
        if getattr(type(a), "_usbyte_base", None) is None:
            continue   # settled by an earlier touch of this call
        owner = _OWNER.get(id(a))
        if owner is None or owner[0].params[owner[1]] is not a:
            a.__class__ = type(a)._usbyte_base  # a copy made of an armed tensor: plain
            continue
        owner[0].touched(owner[1], kind, name)
    still = [a for a in armed if getattr(type(a), "_usbyte_base", None)]
    if not still:
        return func(*args, **kwargs)
    # Nothing to settle (metadata, or a window that lets this call through): run it on the
    # tensors' own classes, then arm them again where they are still armed.
    classes = [type(a) for a in still]
    for a in still:
        a.__class__ = type(a)._usbyte_base
    try:
        return func(*args, **kwargs)
    finally:
        for a, c in zip(still, classes):
            owner = _OWNER.get(id(a))
            if owner is not None and owner[0].armed(owner[1]):
                a.__class__ = c


def _tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterable[Any]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def guarded_class(base: type) -> type:
    """The armed form of parameter class ``base`` (made once per class)."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(f"Guarded{base.__name__}", (base,), {
            "__torch_function__": classmethod(_torch_function),
            "_usbyte_base": base,
            "__module__": __name__,
        })
        _CLASSES[base] = cls
    return cls


class Guard:
    """The armed tensors of one optimizer and what settles them.

    Arming is a class assignment per tensor and nothing else (the tensors are registered as
    this guard's once, at construction): the runtime arms every tensor at the end of each
    backward and disarms it at its update, a few tenths of a microsecond per tensor.

    Args:
        params: the trainable tensors, by runtime index.
        on_grad: settles the gradient window (waits for the step's gradient communication);
            called with what touched a gradient. It must disarm the window
            (:meth:`disarm_grads`) or raise.
        on_param: settles the parameter window for the tensors given (runs their updates);
            it must disarm them (:meth:`disarm`) or raise.
        names: the tensors' names, in what settles (default ``#index``).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], on_grad: Callable[[str], None],
                 on_param: Callable[[list[int]], None], names: Sequence[str] | None = None):
        self.params = list(params)
        self.on_grad, self.on_param = on_grad, on_param
        self.names = list(names) if names is not None else [f"#{t}" for t in range(len(self.params))]
        #: Each tensor's own class, and its armed form.
        self.bases: list[type] = [getattr(type(p), "_usbyte_base", None) or type(p)
                                  for p in self.params]
        self.guarded: list[type] = [guarded_class(b) for b in self.bases]
        for t, p in enumerate(self.params):
            _OWNER[id(p)] = (self, t)
        self.grad_window = False
        #: Per tensor: armed for its pending update (the parameter window).
        self.param_armed = [False] * len(self.params)
        self.n_param_armed = 0
        #: Sharded mode: ``p.grad`` is no averaged gradient there; a read is refused, not waited.
        self.refuse_grads: Callable[[str], None] | None = None

    def armed(self, t: int) -> bool:
        """Whether tensor ``t`` is in an open window."""
        return self.grad_window or self.param_armed[t]

    # -- arming ------------------------------------------------------------------------------

    def arm_grads(self) -> None:
        """Open the gradient window: every tensor is armed until :meth:`disarm_grads`."""
        self.grad_window = True
        for p, c in zip(self.params, self.guarded):
            p.__class__ = c

    def disarm_grads(self) -> None:
        """Close the gradient window (tensors armed for their update stay armed)."""
        if not self.grad_window:
            return
        self.grad_window = False
        if not self.n_param_armed:
            for p, b in zip(self.params, self.bases):
                p.__class__ = b
            return
        for p, b, a in zip(self.params, self.bases, self.param_armed):
            if not a:
                p.__class__ = b

    def arm_params(self, ts: Iterable[int] | None = None) -> None:
        """Open the parameter window of the tensors ``ts`` (default: all; their updates are
        pending)."""
        armed, params, guarded = self.param_armed, self.params, self.guarded
        if ts is None:
            armed[:] = [True] * len(params)
            self.n_param_armed = len(params)
            for p, c in zip(params, guarded):
                p.__class__ = c
            return
        for t in ts:
            if not armed[t]:
                armed[t] = True
                self.n_param_armed += 1
            params[t].__class__ = guarded[t]

    def disarm(self, ts: Iterable[int]) -> None:
        """The updates of ``ts`` have run (or need not): their parameter window closes."""
        if not self.n_param_armed:
            return
        armed, window, params, bases = self.param_armed, self.grad_window, self.params, self.bases
        n = 0
        for t in ts:
            if armed[t]:
                armed[t] = False
                n += 1
                if not window:
                    params[t].__class__ = bases[t]
        self.n_param_armed -= n

    def disarm_all(self) -> None:
        """Close every window (a plan switch, ``close()``); the tensors are this guard's no
        more."""
        self.grad_window = False
        self.param_armed = [False] * len(self.params)
        self.n_param_armed = 0
        for p, b in zip(self.params, self.bases):
            p.__class__ = b
            owner = _OWNER.get(id(p))
            if owner is not None and owner[0] is self:
                del _OWNER[id(p)]

    # -- touches -----------------------------------------------------------------------------

    def touched(self, t: int, kind: str, name: str) -> None:
        """Tensor ``t`` was touched by ``kind`` (``get``/``set``/``call``) of ``name``."""
        if kind != "call" and name in _META_ATTRS or kind == "call" and name in _META_METHODS:
            return
        is_grad = kind != "call" and name in _GRAD
        if self.grad_window and is_grad:
            what = f"p.grad of {self.names[t]!r} " + ("read" if kind == "get" else "assigned")
            if self.refuse_grads is not None:
                if kind == "get":
                    self.refuse_grads(what)
                return   # p.grad = None: honoured (the step leaves the tensor out)
            self.on_grad(what)
        if self.param_armed[t]:
            # After step(), p.grad is the averaged gradient that the pending update reads
            # (as under DDP): a read of it runs the update first, so that what the reader does
            # to it cannot reach the update. An assignment changes nothing the update reads.
            # (Sharded mode: p.grad holds no gradient after step(); nothing to run.)
            if not is_grad or (kind == "get" and self.refuse_grads is None):
                self.on_param([t])
