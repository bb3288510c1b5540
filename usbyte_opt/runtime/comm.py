"""The one all-reduce channel of the runtime: blocks issued in order, waited, checked.

Averaging matches DDP: a block is multiplied by ``1 / world_size`` just before its all-reduce
(sum), as DDP's reducer does when it copies gradients into a bucket (``mul_out(bucket, grad,
1/world_size)``), so both produce the same floating-point values.

Streams (NCCL on CUDA). ``dist.all_reduce(..., async_op=True)`` runs on the process group's own
stream, which first waits for the *current* stream, so a block must be final on the current
stream when it is issued. Blocks are issued from the post-accumulate-grad hook, where the
current stream is the one autograd used for that gradient; a block whose tensors were finished
on other streams (multi-stream models) makes the current stream wait for those first.
``work.wait()`` on NCCL makes the current stream wait for the collective (no host spin), so
the optimizer step queued after it reads the reduced values. The flat buffers live as long as
the optimizer, so the caching allocator never hands their memory to anything else. NCCL
timeouts are left to the process group's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``);
a host-side timeout would need a blocking wait. On gloo, waits block the host and take the
``timeout`` given to :class:`~usbyte_opt.runtime.DistributedOptimizer`; a timeout or a lost
peer becomes one-line :class:`~usbyte_opt.errors.DistributedError`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from .checks import wait as _wait


class Channel:
    """Issues and waits for the collectives of one :class:`DistributedOptimizer`.

    Args:
        group: the process group (``None``: the default group).
        device: the device of the gradients.
        timeout: host-side wait limit (gloo); ``None`` keeps the process group's own.
    """

    __slots__ = ("group", "rank", "world_size", "device", "cuda", "timeout", "scale",
                 "comm_device")

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 timeout: timedelta | None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.cuda = device.type == "cuda"
        # CUDA gradients: waits are stream waits, a host-side limit would turn them into host
        # waits (the backend may be "nccl" or "cpu:gloo,cuda:nccl"; either way the gradients'
        # device decides).
        self.timeout = None if self.cuda else timeout
        self.scale = 1.0 / self.world_size
        #: Where the small tensors of the runtime (usage map, flags) live: with the gradients,
        #: so that the backend that reduces the gradients reduces them too.
        self.comm_device = device

    def all_reduce_block(self, view: torch.Tensor, streams: Sequence[torch.cuda.Stream] = ()) -> dist.Work:
        """Average ``view`` over the ranks, asynchronously (pre-divide, then sum)."""
        if streams:
            cur = torch.cuda.current_stream(self.device)
            for s in streams:
                if s != cur:
                    cur.wait_stream(s)
        if self.world_size > 1:
            view.mul_(self.scale)
        return dist.all_reduce(view, group=self.group, async_op=True)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dist.Work:
        return dist.all_reduce(t, op=op, group=self.group, async_op=True)

    def broadcast(self, t: torch.Tensor) -> dist.Work:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        return dist.broadcast(t, src, group=self.group, async_op=True)

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` (a stream wait on NCCL, a host wait with timeout on gloo)."""
        _wait(work, what, self.rank, self.timeout)
