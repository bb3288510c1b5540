"""Flat gradient buffers in a schedule's layout, and the maps between tensors and blocks.

One flat tensor per schedule buffer (one per dtype, docs/design.md §3); tensor ``t`` owns the
element range of its layout position, and its *view* is that range seen with ``p``'s shape and
strides (a ``channels_last`` weight gets a ``channels_last`` view, as DDP's bucket views do, so
the optimizer's elementwise kernels see matching layouts). A block is a slice of a flat
buffer: the all-reduce needs no copy in or out. Tensors are indexed ``0..n-1`` in layout order
(buffer by buffer).

With ``align_bytes`` (16 on CUDA: NCCL's vectorised kernels want it) every tensor starts on a
multiple of that many bytes of its buffer: the padding after a tensor is zeros, belongs to
the block that ends there, and is all-reduced with it (zeros sum to zeros). A block boundary
inside a tensor keeps its distance from the tensor's start, so it is aligned when the
schedule cut it on such a multiple (:func:`usbyte_opt.planning.problem.align_cuts`).

While a step's gradients are being produced, ``p.grad`` *is* the view (:meth:`FlatGrads.take`
puts a fresh gradient there); between ``step()`` and the next backward the views belong to
the pending update, and ``p.grad`` is ``None`` (:meth:`FlatGrads.release`), so nothing the
user does to ``p.grad`` in between can reach the averaged gradient the update will read.

Example::

    >>> import torch
    >>> from usbyte_opt.runtime.default_plan import default_schedule, trainable_parameters
    >>> model = torch.nn.Linear(3, 2)
    >>> g = FlatGrads(default_schedule(model), dict(trainable_parameters(model)), torch.device("cpu"))
    >>> g.names, g.region, [len(ts) for ts in g.block_tensors]
    (['bias', 'weight'], [(0, 0, 2), (0, 2, 8)], [2])
    >>> g.take(1, torch.ones(2, 3), scale=0.5)
    >>> model.weight.grad.data_ptr() == g.flats[0][2:].data_ptr(), g.flats[0].tolist()
    (True, [0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence

import torch

from ..formats import Schedule


def dense_strides(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` covers exactly ``numel`` consecutive
    elements (any dimension order, no gaps, no overlap): then a view of a flat range can have
    those strides.

    Example::

        >>> dense_strides((8, 3, 3, 3), (27, 1, 9, 3)), dense_strides((4, 4), (8, 1))
        (True, False)
    """
    expected = 1
    for size, st in sorted((int(s), int(d)) for s, d in zip(shape, stride) if int(s) != 1):
        if size == 0:
            return True
        if st != expected:
            return False
        expected *= size
    return True


def _place(starts: Sequence[int], at: Sequence[int], end: int, o: int) -> int:
    """Where schedule offset ``o`` of a buffer lies in its flat tensor: at the same distance
    from its tensor's start (``starts`` packed, ``at`` in the flat tensor, whose last entry is
    its length); the buffer's end is the flat tensor's end, padding included."""
    if o >= end:
        return at[-1]
    j = bisect_right(starts, o) - 1
    return at[j] + (o - starts[j])


class FlatGrads:
    """The flat buffers of one model and the maps between tensors and blocks.

    Args:
        schedule: a schedule already checked against the model (:func:`checks.check_model`).
        params: trainable parameters by name (every name the schedule lists).
        device: where the buffers live (the parameters' device).
        align_bytes: start every tensor on a multiple of this many bytes (0: packed).
        stored: keep the flat buffers (``False``: layout only, see above).

    Example::

        >>> import torch
        >>> from usbyte_opt.runtime.default_plan import default_schedule, trainable_parameters
        >>> model = torch.nn.Linear(3, 2)
        >>> g = FlatGrads(default_schedule(model), dict(trainable_parameters(model)),
        ...               torch.device("cpu"), align_bytes=16)
        >>> g.region, g.flats[0].numel(), [tuple(v.shape) for v in g.block_views]
        ([(0, 0, 2), (0, 4, 10)], 12, [(12,)])
    """

    __slots__ = ("names", "params", "flats", "views", "region", "block_views", "block_tensors",
                 "tensor_blocks", "index", "cuda", "device", "stored")

    def __init__(self, schedule: Schedule, params: Mapping[str, torch.nn.Parameter],
                 device: torch.device, align_bytes: int = 0, stored: bool = True):
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self.region: list[tuple[int, int, int]] = []
        self.flats: list[torch.Tensor] = []
        self.cuda = device.type == "cuda"
        self.device, self.stored = device, stored
        where = device if stored else torch.device("meta")
        starts: list[list[int]] = []      # packed: the schedule's element offsets
        phys: list[list[int]] = []        # where each tensor starts in the flat buffer
        packed_end: list[int] = []
        members: list[list[int]] = []
        for b, buf in enumerate(schedule.buffers):
            dtype = params[buf.tensors[0]].dtype
            a = max(1, align_bytes // torch.empty((), dtype=dtype).element_size())
            offs, at, idx, off, pos = [], [], [], 0, 0
            for name in buf.tensors:
                p = params[name]
                offs.append(off)
                at.append(pos)
                idx.append(len(self.names))
                self.names.append(name)
                self.params.append(p)
                self.region.append((b, pos, pos + p.numel()))
                off += p.numel()
                pos += -(-p.numel() // a) * a
            starts.append(offs)
            packed_end.append(off)
            phys.append(at + [pos])
            members.append(idx)
            self.flats.append(torch.zeros(pos, dtype=dtype, device=where))
        self.index = {n: i for i, n in enumerate(self.names)}
        self.views = self._tensor_views(device)
        self._block_views(schedule, starts, phys, packed_end, members)

    def _tensor_views(self, device: torch.device) -> list[torch.Tensor]:
        """Each tensor's view of its flat buffer, with the parameter's own strides where they
        are dense; without stored buffers, an expanded zero of its dtype (no memory)."""
        views: list[torch.Tensor] = []
        zero: dict[torch.dtype, torch.Tensor] = {}
        for t, p in enumerate(self.params):
            if not self.stored:
                z = zero.get(p.dtype)
                if z is None:
                    z = zero[p.dtype] = torch.zeros((), dtype=p.dtype, device=device)
                views.append(z.expand(p.shape))
                continue
            b, s, e = self.region[t]
            flat = self.flats[b]
            if dense_strides(p.shape, p.stride()):
                view = flat.as_strided(p.shape, p.stride(), flat.storage_offset() + s)
            else:
                view = flat[s:e].view(p.shape)
            views.append(view)
        return views

    def _block_views(self, schedule: Schedule, starts: list[list[int]], phys: list[list[int]],
                     packed_end: list[int], members: list[list[int]]) -> None:
        """Each block's view of its flat buffer (its packed offsets placed at the tensors'
        aligned starts), the tensors it covers, and each tensor's blocks."""
        self.block_views: list[torch.Tensor] = []
        self.block_tensors: list[list[int]] = []
        self.tensor_blocks: list[list[int]] = [[] for _ in self.names]
        for k, blk in enumerate(schedule.blocks):
            st, at, end = starts[blk.buffer], phys[blk.buffer], packed_end[blk.buffer]
            lo, hi = _place(st, at, end, blk.start), _place(st, at, end, blk.end)
            self.block_views.append(self.flats[blk.buffer][lo:hi])
            lo = max(bisect_right(st, blk.start) - 1, 0)
            hi = bisect_left(st, blk.end)
            ts = members[blk.buffer][lo:hi]
            self.block_tensors.append(ts)
            for t in ts:
                self.tensor_blocks[t].append(k)

    @property
    def n(self) -> int:
        return len(self.names)

    def take(self, t: int, grad: torch.Tensor | None, scale: float | None = None) -> None:
        """Put ``grad`` (times ``scale``, when given) into tensor ``t``'s view and make the view
        ``p.grad``; ``None`` puts zeros. ``grad`` may be dropped afterwards: on CUDA it is
        marked as used by the current stream, so its memory is not handed out before the copy
        has read it. Only with the flat buffers stored."""
        assert self.stored, "no flat buffer to take a gradient into"
        p, v = self.params[t], self.views[t]
        if grad is None:
            v.zero_()
        elif grad is not v:
            if grad.requires_grad:   # a backward with create_graph=True: record no copy
                grad = grad.detach()
            if scale is None:
                v.copy_(grad)
            else:
                torch.mul(grad, scale, out=v)
            if self.cuda and grad.is_cuda:
                grad.record_stream(torch.cuda.current_stream(grad.device))
        p.grad = v

    def release(self, ts: Sequence[int] | None = None) -> None:
        """``p.grad = None`` for the tensors ``ts`` (default: all) that still hold their view."""
        params, views = self.params, self.views
        for t in range(len(params)) if ts is None else ts:
            p = params[t]
            if p.grad is views[t]:
                p.grad = None

    def detach(self) -> None:
        """Give every parameter whose gradient is its view a gradient of its own (a copy);
        without stored buffers, ``None`` (the placeholder holds no gradient)."""
        for p, v in zip(self.params, self.views):
            if p.grad is v:
                p.grad = v.clone() if self.stored else None
