"""The optimizer whose step the profiler times (and the bench trains with)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UsageError

#: The names ``--optimizer`` takes.
OPTIMIZERS = ("sgd", "adam", "adamw")


def make_optimizer(name: str, params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer whose step is timed: ``sgd`` (momentum 0.9), ``adam`` or ``adamw``,
    with PyTorch's default implementation choice (``foreach`` on GPU, a loop on CPU).

    Example::

        >>> make_optimizer("adamw", [torch.nn.Parameter(torch.zeros(2))]).__class__.__name__
        'AdamW'
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    raise UsageError(f"--optimizer: expected one of {'|'.join(OPTIMIZERS)}, got {name!r}")


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The name a profile records for an optimizer object: one of :data:`OPTIMIZERS` for
    torch's SGD, Adam and AdamW, else its class name in lower case.

    Example::

        >>> p = [torch.nn.Parameter(torch.zeros(2))]
        >>> optimizer_name(torch.optim.AdamW(p)), optimizer_name(torch.optim.RMSprop(p))
        ('adamw', 'rmsprop')
    """
    return type(optimizer).__name__.lower()


__all__ = ["OPTIMIZERS", "make_optimizer", "optimizer_name"]
