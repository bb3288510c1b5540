"""Stock PyTorch DDP with planned buckets: no custom runtime, everything DDP supports.

PyTorch's ``DistributedDataParallel(..., bucket_cap_mb_list=[...])`` takes one size limit per
bucket. DDP rebuilds its buckets after the first iteration, in the order gradients became
ready, closing bucket ``i`` once it holds at least ``bucket_cap_mb_list[i]``; it all-reduces
the buckets in that order, and steps the optimizer after all of them (fence mode,
docs/design.md §2.6). So a schedule whose blocks are whole tensors, contiguous in gradient-ready
order, in one buffer, and in fence mode (the ``ddp-tuned`` strategy plans exactly those) is a
list of bucket sizes: :func:`bucket_caps_mb` computes it, :func:`wrap` builds the DDP model,
and :func:`rebuilt_bucket_sizes` reads back what DDP actually built, to check it.

Example (the caps of a schedule, no process group needed)::

    >>> import dataclasses, torch
    >>> from usbyte_opt.runtime import default_schedule
    >>> m = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(3)])
    >>> s = dataclasses.replace(default_schedule(m), mode="fence")
    >>> [int(c * 2**20) for c in bucket_caps_mb(s)]   # bytes: just under 1 MiB, then 2 MiB
    [1048575, 2097151]
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .errors import MismatchError, UsbyteError
from .formats import DTYPE_SIZES, Schedule

_MB = 1024 * 1024


def supports_bucket_list() -> bool:
    """Whether this torch's DDP takes ``bucket_cap_mb_list``."""
    from torch.nn.parallel import DistributedDataParallel

    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


def planned_buckets(schedule: Schedule, source: str = "<schedule>") -> list[list[str]]:
    """The schedule's blocks as DDP buckets (tensor names, in gradient-ready order), or a
    one-line :class:`~usbyte_opt.errors.UsbyteError` saying why DDP cannot express it."""
    if schedule.mode != "fence":
        raise UsbyteError(f"{source}: mode: expected \"fence\" (DDP steps after every bucket), "
                          f"got {schedule.mode!r}; plan with `usbyte-opt optimize --strategy "
                          "ddp-tuned`")
    if len(schedule.buffers) != 1:
        raise UsbyteError(f"{source}: buffers: expected one buffer (one dtype): DDP sizes the "
                          f"buckets of every dtype with the same list, got "
                          f"{len(schedule.buffers)} ({', '.join(b.dtype for b in schedule.buffers)})")
    shapes = schedule.extra.get("shapes")
    if not isinstance(shapes, dict):
        raise UsbyteError(f"{source}: shapes: expected the per-tensor shapes (schedules written "
                          "by `usbyte-opt optimize` record them)")
    buf = schedule.buffers[0]
    ends: dict[int, int] = {}     # element offset where each tensor ends -> its index
    starts: dict[int, int] = {}
    off = 0
    for i, name in enumerate(buf.tensors):
        n = 1
        for d in shapes.get(name, ()):
            n *= int(d)
        starts[off] = i
        off += n
        ends[off] = i
    pos = 0
    buckets: list[list[str]] = []
    for k, blk in enumerate(schedule.blocks):
        if blk.start != pos:
            raise UsbyteError(f"{source}: blocks[{k}]: expected a block starting at element "
                              f"{pos}: DDP all-reduces its buckets in gradient-ready order, "
                              f"so blocks must follow the buffer's order; got start {blk.start}")
        if blk.start not in starts or blk.end not in ends:
            raise UsbyteError(f"{source}: blocks[{k}]: expected whole tensors: DDP cannot cut a "
                              f"tensor, got [{blk.start}, {blk.end}) which cuts one")
        buckets.append(list(buf.tensors[starts[blk.start]: ends[blk.end] + 1]))
        pos = blk.end
    return buckets


def bucket_caps_mb(schedule: Schedule, source: str = "<schedule>") -> list[float]:
    """``bucket_cap_mb_list`` that makes DDP rebuild exactly the schedule's buckets: bucket
    ``i`` of ``S`` bytes gets a cap of ``S - 1`` bytes, so it closes right after its last
    tensor and not before (a tensor is at least 2 bytes)."""
    shapes = schedule.extra.get("shapes", {})
    size = DTYPE_SIZES[schedule.buffers[0].dtype] if schedule.buffers else 4
    caps = []
    for names in planned_buckets(schedule, source):
        total = 0
        for n in names:
            e = 1
            for d in shapes[n]:
                e *= int(d)
            total += e * size
        caps.append((total - 0.5) / _MB)
    return caps


def wrap(model: torch.nn.Module, schedule: Schedule | str, **ddp_kwargs: Any) -> Any:
    """``DistributedDataParallel(model, bucket_cap_mb_list=..., **ddp_kwargs)`` whose rebuilt
    buckets are the schedule's blocks (from the second iteration on, as DDP rebuilds them after
    the first).

    Args:
        model: the module (on its device), as for DDP.
        schedule: a fence-mode schedule of whole, contiguous tensors in one buffer (the
            ``ddp-tuned`` strategy's), or its path.
        **ddp_kwargs: anything else DDP takes, except ``bucket_cap_mb``/``bucket_cap_mb_list``.

    Raises:
        UsbyteError: this torch has no ``bucket_cap_mb_list``; the schedule is one DDP cannot
            express (cut tensors, an order DDP will not keep, overlap mode, several dtypes);
            conflicting bucket arguments.
        MismatchError: the model's trainable tensors are not the schedule's.
    """
    from torch.nn.parallel import DistributedDataParallel

    from .formats import load_schedule
    from .runtime.checks import check_model
    from .runtime.default_plan import model_tensors

    source = "<schedule>"
    if not isinstance(schedule, Schedule):
        source = str(schedule)
        schedule = load_schedule(schedule)
    if not supports_bucket_list():
        raise UsbyteError(f"torch {torch.__version__}: DistributedDataParallel has no "
                          "bucket_cap_mb_list (PyTorch 2.13 or newer has it); use the "
                          "usbyte-opt runtime (usbyte_opt.runtime.DistributedOptimizer) instead")
    for key in ("bucket_cap_mb", "bucket_cap_mb_list"):
        if key in ddp_kwargs:
            raise UsbyteError(f"{key}: the schedule gives the buckets; do not pass {key} to wrap()")
    caps = bucket_caps_mb(schedule, source)
    check_model(schedule, model_tensors(model), source)
    return DistributedDataParallel(model, bucket_cap_mb_list=caps, **ddp_kwargs)


def rebuilt_bucket_sizes(ddp_model: Any) -> list[int]:
    """The bucket sizes (bytes) DDP uses after its rebuild (call after the second forward)."""
    data = ddp_model._get_ddp_logging_data()
    raw = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(x) for x in str(raw).replace(" ", "").split(",") if x]


def check_buckets(ddp_model: Any, schedule: Schedule) -> None:
    """Raise :class:`~usbyte_opt.errors.MismatchError` unless DDP's rebuilt buckets have the
    schedule's sizes (the gradients became ready in another order than the profile's)."""
    size = DTYPE_SIZES[schedule.buffers[0].dtype]
    want = [(b.end - b.start) * size for b in schedule.blocks]
    got = rebuilt_bucket_sizes(ddp_model)
    if got != want:
        raise MismatchError(f"DDP rebuilt buckets of {got} bytes, the schedule planned {want}: "
                            "gradients became ready in another order than the profile's")


__all__ = ["bucket_caps_mb", "check_buckets", "planned_buckets", "rebuilt_bucket_sizes",
           "supports_bucket_list", "wrap"]
