"""Flat gradient buffers in a schedule's layout, with every ``p.grad`` a view into them.

One flat tensor per schedule buffer (one per dtype, DESIGN.md §2); tensor ``t`` owns the
element range of its layout position, and ``p.grad`` is that range viewed in ``p``'s shape,
so autograd accumulates straight into the buffer and a block is a slice of it: no copies in
or out. Tensors are indexed ``0..n-1`` in layout order (buffer by buffer).

Example::

    >>> import torch
    >>> from usbyte_opt.runtime.default_plan import default_schedule, trainable_parameters
    >>> model = torch.nn.Linear(3, 2)
    >>> g = FlatGrads(default_schedule(model), dict(trainable_parameters(model)), torch.device("cpu"))
    >>> g.names, g.region, [len(ts) for ts in g.block_tensors]
    (['bias', 'weight'], [(0, 0, 2), (0, 2, 8)], [2])
    >>> model.weight.grad.data_ptr() == g.flats[0][2:].data_ptr()
    True
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Mapping

import torch

from ..formats import Schedule


class FlatGrads:
    """The flat buffers of one model and the maps between tensors and blocks.

    Args:
        schedule: a schedule already checked against the model (:func:`checks.check_model`).
        params: trainable parameters by name (every name the schedule lists).
        device: where the buffers live (the parameters' device).
    """

    __slots__ = ("names", "params", "flats", "views", "region", "block_views", "block_tensors",
                 "tensor_blocks", "index")

    def __init__(self, schedule: Schedule, params: Mapping[str, torch.nn.Parameter],
                 device: torch.device):
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self.region: list[tuple[int, int, int]] = []
        self.flats: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []
        starts: list[list[int]] = []
        members: list[list[int]] = []
        for b, buf in enumerate(schedule.buffers):
            offs, idx, off = [], [], 0
            for name in buf.tensors:
                p = params[name]
                offs.append(off)
                idx.append(len(self.names))
                self.names.append(name)
                self.params.append(p)
                self.region.append((b, off, off + p.numel()))
                off += p.numel()
            starts.append(offs)
            members.append(idx)
            self.flats.append(torch.zeros(off, dtype=params[buf.tensors[0]].dtype, device=device))
        self.index = {n: i for i, n in enumerate(self.names)}
        for t, p in enumerate(self.params):
            b, s, e = self.region[t]
            self.views.append(self.flats[b][s:e].view(p.shape))
        self.block_views: list[torch.Tensor] = []
        self.block_tensors: list[list[int]] = []
        self.tensor_blocks: list[list[int]] = [[] for _ in self.names]
        for k, blk in enumerate(schedule.blocks):
            self.block_views.append(self.flats[blk.buffer][blk.start:blk.end])
            st = starts[blk.buffer]
            lo = max(bisect_right(st, blk.start) - 1, 0)
            hi = bisect_left(st, blk.end)
            ts = members[blk.buffer][lo:hi]
            self.block_tensors.append(ts)
            for t in ts:
                self.tensor_blocks[t].append(k)
        self.attach()

    @property
    def n(self) -> int:
        return len(self.names)

    def attach(self) -> None:
        """Make every ``p.grad`` its view (an existing gradient is copied in first)."""
        with torch.no_grad():
            for p, v in zip(self.params, self.views):
                if p.grad is not None and p.grad is not v:
                    v.copy_(p.grad)
                p.grad = v

    def relink(self, t: int) -> bool:
        """Put tensor ``t``'s gradient back in its view if something replaced ``p.grad``
        (autograd does when the gradient was ``None``, or with ``create_graph=True``).
        Returns whether it had been replaced."""
        p, v = self.params[t], self.views[t]
        g = p.grad
        if g is v:
            return False
        with torch.no_grad():
            if g is None:
                v.zero_()
            else:
                v.copy_(g)
        p.grad = v
        return True

    def detach(self) -> None:
        """Give every parameter a gradient of its own again (a copy of its view)."""
        for p, v in zip(self.params, self.views):
            if p.grad is v:
                p.grad = v.clone()
