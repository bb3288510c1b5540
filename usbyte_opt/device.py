"""The device a rank computes on: ``--device`` resolved, one GPU per rank by ``LOCAL_RANK``."""

from __future__ import annotations

import os

import torch

from .errors import UsbyteError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` picks CUDA when available; ``cuda`` becomes ``cuda:LOCAL_RANK`` under torchrun
    (or under :mod:`usbyte_opt.launcher`), so that every rank of a host has its own GPU.

    Example::

        >>> resolve_device("cpu")
        device(type='cpu')
        >>> resolve_device("meta")
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsbyteError: --device: expected cpu or cuda, got 'meta'
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsbyteError("--device cuda: expected a CUDA device, but torch.cuda.is_available() is False "
                              "(use --device cpu)")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    elif device.type != "cpu":
        raise UsbyteError(f"--device: expected cpu or cuda, got {device.type!r}")
    return device


__all__ = ["resolve_device"]
