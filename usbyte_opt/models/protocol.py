"""The factory protocol: what a factory returns, the loss of the built-in models, and the
helpers that use a built model (its loss checked, synthetic batches, its parameter count).

This module imports nothing else of :mod:`usbyte_opt.models`: every model module builds on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import UsbyteError

#: What a factory returns: ``(model, inputs, loss_fn)``.
Built = tuple[nn.Module, tuple, Callable[[Any], torch.Tensor]]
Factory = Callable[[int], Built]

#: The expected shape of a factory's result, quoted in errors.
PROTOCOL = ("factory(batch_size: int) -> (model: torch.nn.Module, inputs: tuple, loss_fn: callable"
            "[, optimizer: torch.optim.Optimizer])")


class RandomTargetLoss:
    """Cross-entropy against fixed random targets, made on the output's device at first use.

    Args:
        classes: number of classes (vocabulary size for language models).
        shape: shape of the target tensor (``(batch,)`` or ``(batch, seq)``).
        pick: optional function selecting the logits from the model output (e.g. an
            attribute of a transformers output object); default: the output itself.
        seed: seed of the targets, so every rank and every run sees the same ones.

    Example::

        >>> loss = RandomTargetLoss(10, (4,))
        >>> round(float(loss(torch.zeros(4, 10))), 4)   # uniform logits: log(10)
        2.3026
    """

    def __init__(self, classes: int, shape: Sequence[int], pick: Callable[[Any], torch.Tensor] | None = None,
                 seed: int = 0):
        self.classes, self.shape, self.pick, self.seed = classes, tuple(shape), pick, seed
        self._targets: torch.Tensor | None = None

    def __call__(self, output: Any) -> torch.Tensor:
        logits = self.pick(output) if self.pick is not None else output
        if self._targets is None or self._targets.device != logits.device:
            g = torch.Generator().manual_seed(self.seed)
            self._targets = torch.randint(self.classes, self.shape, generator=g).to(logits.device)
        return F.cross_entropy(logits.reshape(-1, self.classes).float(), self._targets.reshape(-1))


def check_loss(label: str, loss: Any) -> torch.Tensor:
    """Raise :class:`UsbyteError` unless ``loss`` is a scalar tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else f"a {type(loss).__name__}")
        raise UsbyteError(f"model {label!r}: loss_fn(model(*inputs)) must return a scalar tensor, got {what}")
    if not loss.requires_grad:
        raise UsbyteError(f"model {label!r}: the loss does not depend on any trainable parameter")
    return loss.reshape(())


def make_batches(inputs: Sequence[Any], rank: int, count: int = 4) -> list[tuple]:
    """``count`` synthetic batches shaped like ``inputs`` (a factory's), different on every
    rank and reproducible, for training without a dataset (the bench, ``examples/train.py``):
    floating tensors get normal noise, integer tensors (token ids) uniform ids below the
    largest id of the factory's own inputs, anything else is passed as is.

    Example::

        >>> b = make_batches((torch.zeros(2, 3), torch.tensor([[1, 5]]), "x"), rank=1, count=2)
        >>> len(b), b[0][0].shape, int(b[1][1].max()) <= 5, b[0][2]
        (2, torch.Size([2, 3]), True, 'x')
    """
    out = []
    for j in range(count):
        g = torch.Generator().manual_seed(10_007 * (rank + 1) + j)
        batch = []
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                batch.append(torch.randn(x.shape, generator=g, dtype=x.dtype).to(x.device))
            elif isinstance(x, torch.Tensor) and x.dtype in (torch.int64, torch.int32):
                hi = int(x.max()) + 1 if x.numel() else 1
                batch.append(torch.randint(hi, x.shape, generator=g, dtype=x.dtype).to(x.device))
            else:
                batch.append(x)
        out.append(tuple(batch))
    return out


def parameter_count(model: nn.Module) -> int:
    """Trainable elements of ``model`` (tied tensors counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
