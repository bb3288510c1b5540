"""The process group of a rank: joined from the variables its launcher set, a barrier on it.

The launcher side (starting the ranks, setting ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``) is :mod:`usbyte_opt.launcher`, or torchrun.
"""

from __future__ import annotations

import datetime as _dt
import os
from typing import Any

import torch
import torch.distributed as dist

from .errors import DistributedError


def init_from_env(device: torch.device, timeout_s: float = 600.0) -> bool:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) when it is set and no group exists yet; return whether it
    did (the caller then destroys it). NCCL on CUDA (on ``device``, this rank's GPU), gloo
    on CPU."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=_dt.timedelta(seconds=timeout_s), **kwargs)
    except Exception as e:
        raise DistributedError(f"cannot join the process group ({backend}, rank {os.environ['RANK']} of "
                               f"{os.environ['WORLD_SIZE']}): {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return True


def barrier(group: Any, device: torch.device, backend: str) -> None:
    """A barrier; on NCCL tied to this rank's GPU (no guessing, no warning)."""
    if backend == "nccl" and device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because another rank stopped or timed out:
    torch's ``DistError`` family, or the ``RuntimeError`` gloo's transport raises (a peer
    that closed or reset its connection, a timeout).

    Example::

        >>> collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
        True
        >>> collective_failure(RuntimeError("shape mismatch"))
        False
    """
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("gloo" in text or "NCCL" in text) and any(
        s in text for s in ("Connection", "connection", "Timed out", "timed out", "closed", "abort"))


__all__ = ["barrier", "collective_failure", "init_from_env"]
