"""The collectives of the runtime: blocks issued in order, control messages, waits.

Averaging matches DDP: each gradient is multiplied by ``1 / world_size`` as it is put into the
flat buffer (:meth:`~usbyte_opt.runtime.buffers.FlatGrads.take`, DDP's
``mul_out(bucket_view, grad, 1/world_size)``), and blocks are summed; both produce the same
floating-point values.

Streams (NCCL on CUDA). ``dist.all_reduce(..., async_op=True)`` runs on the process group's own
stream, which first waits for the *current* stream, so a block must be final on the current
stream when it is issued. Blocks are issued from the post-accumulate-grad hook or from the
autograd final callback, where the current stream is the one autograd used; a block whose
tensors were finished on other streams makes the current stream wait for those first.
``work.wait()`` on NCCL makes the current stream wait for the collective (no host wait), so
work queued after it reads the reduced values. The flat buffers live as long as the
optimizer, so the caching allocator never hands their memory to anything else. NCCL timeouts
are left to the process group's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``); a host-side
timeout would need a blocking wait. On gloo, waits block the host and take the ``timeout``
given to :class:`~usbyte_opt.runtime.DistributedOptimizer`; a timeout or a lost peer becomes a
one-line :class:`~usbyte_opt.errors.DistributedError`.

Control messages (the per-step usage map) go through a gloo group of their own
(:meth:`Channel.control_all_reduce`) on host tensors: they never queue behind the blocks on
the NCCL stream, never move to the device, and are read on the host when needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..collectives.agree import wait as _wait
from ..collectives.issuers import backend_for, serial_group, sum_issuer, wants_serial
from ..errors import DistributedError, UsbyteError
from .hier import HierChannel

#: Seconds between two looks at :attr:`Channel.cause` while a host wait is blocked.
CAUSE_POLL_S = 0.5


def _closed(x: torch.Tensor) -> dist.Work:
    raise UsbyteError("all-reduce on a closed DistributedOptimizer: create a new one to train on")


class Channel:
    """Issues and waits for the collectives of one :class:`DistributedOptimizer`.

    A collective call on more than one rank: it creates the gloo groups below, so every rank
    of ``group`` constructs its channels in the same order.

    Args:
        group: the process group (``None``: the default group).
        device: the device of the gradients.
        timeout: host-side wait limit (gloo); ``None`` keeps the process group's own.
        serial: blocks one at a time through
            :func:`~usbyte_opt.collectives.issuers.serial_group` (``None``: on gloo with more
            than one rank).
    """

    __slots__ = ("group", "rank", "world_size", "device", "cuda", "timeout", "host_timeout",
                 "serial", "control", "_issue", "cause", "hier", "stream_waits")

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 timeout: timedelta | None, serial: bool | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.cuda = device.type == "cuda"
        #: A wait for a block is a stream wait (NCCL on CUDA tensors), not a host wait: the
        #: updates can be queued on a stream behind the collectives (overlap mode on CUDA).
        self.stream_waits = self.cuda and backend_for(group, device) == "nccl"
        # CUDA gradients: waits are stream waits, a host-side limit would turn them into host
        # waits (the backend may be "nccl" or "cpu:gloo,cuda:nccl"; either way the gradients'
        # device decides).
        self.timeout = None if self.cuda else timeout
        #: The limit of host waits on the gloo groups (control messages), on any device.
        self.host_timeout = timeout
        if serial is None:
            serial = wants_serial(group, device)
        #: The one-thread gloo group the blocks go through, or None (blocks on ``group``).
        self.serial = serial_group(group, timeout) if serial else None
        #: The gloo group of the control messages (host tensors), or None on one rank.
        self.control = (serial_group(group, timeout, threads=2, tag="control")
                        if self.world_size > 1 else None)
        self._issue = sum_issuer(group, self.serial)
        #: Why this channel's collectives no longer match across the ranks, if known (a
        #: callable returning a one-line cause or None, consulted when a wait fails): set by
        #: sharded mode's collective state dicts (:class:`~.sharded.CallBook`).
        self.cause: Callable[[], str | None] | None = None
        #: The groups of hierarchical blocks (:meth:`hier_channel`), or None: made only for a
        #: schedule that has such blocks.
        self.hier: HierChannel | None = None

    def hier_channel(self, nodes: int) -> HierChannel:
        """The groups of hierarchical blocks on ``nodes`` nodes, made at the first call (a
        collective call: every rank makes them at the same install) and kept for the
        channel's life (a later schedule with the same ``nodes`` reuses them)."""
        if self.hier is None or self.hier.nodes != nodes:
            if self.hier is not None:
                self.hier.close()
            self.hier = HierChannel(self.group, nodes, self.device, self.host_timeout)
        return self.hier

    def hier_all_reduce_block(self, view: torch.Tensor,
                              streams: Sequence[torch.cuda.Stream] = ()) -> dist.Work:
        """:meth:`all_reduce_block` of a hierarchical block (:mod:`.hier`), on the groups of
        :meth:`hier_channel`."""
        if self.hier is None:
            raise UsbyteError("all-reduce on a closed DistributedOptimizer: create a new one to "
                              "train on")
        self.after(streams)
        return self.hier.all_reduce(view)  # type: ignore[no-any-return]

    def all_reduce_block(self, view: torch.Tensor, streams: Sequence[torch.cuda.Stream] = ()) -> dist.Work:
        """Sum ``view`` over the ranks, asynchronously (its gradients are already scaled by
        ``1 / world_size``). ``streams``: CUDA streams the block's gradients were finished on,
        which the current stream waits for first."""
        self.after(streams)
        return self._issue(view)

    def after(self, streams: Sequence[torch.cuda.Stream]) -> None:
        """Make the current stream wait for ``streams`` (those a block's gradients were
        finished on), where they differ from it."""
        if streams:
            cur = torch.cuda.current_stream(self.device)
            for s in streams:
                if s != cur:
                    cur.wait_stream(s)

    def control_all_reduce(self, t: torch.Tensor,
                           op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dist.Work | None:
        """Reduce a host tensor over the ranks (sum, or ``op``) on the control group (``None``
        on one rank)."""
        if self.control is None:
            return None
        opts = dist.AllreduceOptions()
        opts.reduceOp = op  # type: ignore[assignment]  # the stub says ReduceOp; it takes ReduceOp.SUM's RedOpType
        return self.control.allreduce([t], opts)

    def control_broadcast(self, t: torch.Tensor) -> dist.Work | None:
        """Rank 0's host tensor to every rank, on the control group (``None`` on one rank)."""
        if self.control is None:
            return None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.control.broadcast([t], opts)

    def broadcast(self, t: torch.Tensor) -> dist.Work:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        return dist.broadcast(t, src, group=self.group, async_op=True)

    def close(self) -> None:
        """Release the gloo groups (their destructors join their worker threads): call once
        nothing is in flight. Later blocks raise :class:`~usbyte_opt.errors.UsbyteError`."""
        self._issue = _closed
        self.serial = None
        self.control = None
        if self.hier is not None:
            self.hier.close()
            self.hier = None

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` (a stream wait on NCCL, a host wait with timeout on gloo)."""
        if self.cause is None and work.is_completed():
            try:   # finished already: nothing to wait for but its outcome
                work.wait()
                return
            except RuntimeError:
                pass   # a failure: reported below, in one line
        self._wait(work, what, self.timeout, host=not self.cuda)

    def wait_host(self, work: dist.Work, what: str) -> None:
        """Wait on the host for a control message (gloo, with the timeout)."""
        self._wait(work, what, self.host_timeout, host=True)

    def _wait(self, work: dist.Work, what: str, timeout: timedelta | None, host: bool) -> None:
        """A wait failing in one line. With a :attr:`cause` set, a ``host`` wait (gloo) runs in
        slices of :data:`CAUSE_POLL_S`, asking it between them: a rank whose peers will never
        issue this collective fails within a slice of the cause being known, not at the
        timeout. The cause also names a failure's reason when it knows one."""
        why = self.cause
        if why is not None and host:
            deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
            while True:
                left = CAUSE_POLL_S if deadline is None else min(CAUSE_POLL_S,
                                                                 deadline - time.monotonic())
                if left <= 0:
                    timeout = timedelta(milliseconds=1)   # the timeout, reported below
                    break
                try:
                    work.wait(timedelta(seconds=left))
                    return
                except RuntimeError:
                    if work.is_completed():
                        break   # a failure: reported below
                found = why()
                if found:
                    raise DistributedError(f"rank {self.rank}: {what} failed: {found}")
        try:
            _wait(work, what, self.rank, timeout)
        except DistributedError as e:
            found = why() if why is not None else None
            if found:
                raise DistributedError(f"rank {self.rank}: {what} failed: {found}") from e
            raise
