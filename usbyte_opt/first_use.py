"""Where each watched tensor is first used in a forward: a ``TorchFunctionMode`` that sees
every torch call. The profiler's discovery pass (:mod:`usbyte_opt.profiler.timing`) and the
runtime's first training forward (:mod:`usbyte_opt.runtime.forward`) both learn from it which
parameters a forward reads before, or outside, the modules that own them.

Example::

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2, 2))
    >>> used = []
    >>> with FirstUse({id(w): 0}, used.append):
    ...     _ = w.shape                  # metadata, not a use
    ...     _ = torch.nn.functional.linear(torch.ones(1, 2), w)
    >>> used
    [0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: Tensor attributes and methods that read metadata only: not a use of the values.
METADATA = frozenset({"shape", "dtype", "device", "requires_grad", "is_cuda", "ndim", "layout",
                      "is_leaf", "grad_fn", "names", "is_sparse", "is_quantized", "is_meta",
                      "itemsize", "nbytes", "grad", "_version", "is_nested", "size", "dim",
                      "numel", "nelement", "is_floating_point", "is_complex", "stride",
                      "element_size", "data_ptr", "is_contiguous", "get_device",
                      "storage_offset"})


def metadata_only(func: Any) -> bool:
    """Whether the torch call ``func`` only reads a tensor's metadata (``.shape``, ...)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: its descriptor names it
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name in METADATA


class FirstUse(TorchFunctionMode):
    """Calls ``used(i)`` for each tensor argument of every torch call whose ``id`` is in
    ``index`` (``id(tensor) -> i``), looking two levels into lists, tuples and dicts; calls
    that only read metadata are passed over unless ``metadata`` is true. ``used`` decides what
    a repeated use means."""

    def __init__(self, index: dict[int, int], used: Callable[[int], None], metadata: bool = False):
        super().__init__()
        self.index, self.used, self.metadata = index, used, metadata

    def _scan(self, obj: Any, depth: int = 0) -> None:
        if isinstance(obj, torch.Tensor):
            i = self.index.get(id(obj))
            if i is not None:
                self.used(i)
        elif depth < 2 and isinstance(obj, (list, tuple)):
            for o in obj:
                self._scan(o, depth + 1)
        elif depth < 2 and isinstance(obj, dict):
            for o in obj.values():
                self._scan(o, depth + 1)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.metadata or not metadata_only(func):
            self._scan(args)
            self._scan(kwargs)
        return func(*args, **kwargs)
