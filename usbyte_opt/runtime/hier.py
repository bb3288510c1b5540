"""Hierarchical blocks: a block all-reduced inside each node, then across the nodes.

A schedule block with :attr:`~usbyte_opt.formats.Block.hier` on ``N`` nodes
(:attr:`~usbyte_opt.formats.Schedule.nodes`) of ``G = world_size // N`` ranks each (node
``k``: ranks ``k*G .. k*G+G-1``, as torchrun numbers them) is three collectives, in order:

1. a sum reduce-scatter over the node's ``G`` ranks: local rank ``j`` gets chunk ``j`` of the
   block's sum over its node (the block's view padded with zeros to a multiple of ``G`` where
   its length is not one);
2. a sum all-reduce of that chunk over the ``N`` ranks with the same local rank (one rank per
   node: ``G`` such groups, each carrying ``1/G`` of the block);
3. an all-gather over the node's ranks of the chunks back into the view.

The gradients were scaled by ``1 / world_size`` as they entered the buffer, as for a flat
block, so the view ends up holding the average, equal to a flat all-reduce's within float
rounding (the sum is associated as node sums added across nodes, docs/runtime.md).

:class:`HierChannel` holds this rank's groups and issues one block. On gloo (CPU gradients)
the groups are one-thread gloo groups (:func:`~usbyte_opt.collectives.issuers.serial_subgroups`,
listening where the runtime's other gloo groups listen): one for the node's reduce-scatters,
one for the cross-node all-reduces, one for the node's all-gathers. The training thread issues
the reduce-scatter; each stage's completion (a callback on the gloo worker thread that ran
it) issues the next stage on its own group. Each group thus runs its collectives one at a
time in the schedule's block order on every rank (a group's collectives must be issued in the
same order everywhere), the stages of consecutive blocks overlap as in a pipeline, and the
training thread is never blocked. The block's work (:class:`HierWork`) completes when its
all-gather has. On NCCL (CUDA gradients) the groups are ``torch.distributed.new_group``
subgroups with ``backend="nccl"`` named (one per node, one per local rank: every rank creates
every one, in that order), and the three collectives are chained on a side stream of the
channel with ``work.wait()`` (stream waits, the host is not blocked); the block's work is an
event on that stream, which the current stream of the gradients' device waits for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.issuers import (
    all_gather_issuer,
    reduce_scatter_issuer,
    serial_subgroups,
    sum_issuer,
)
from ..errors import first_line


def node_members(world_size: int, nodes: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of each node, and of each cross-node group (the ranks with the same local
    rank, one per node), for ``nodes`` nodes of ``world_size // nodes`` consecutive ranks.

    Example::

        >>> node_members(4, 2)
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    g = world_size // nodes
    return ([list(range(k * g, k * g + g)) for k in range(nodes)],
            [list(range(j, world_size, g)) for j in range(g)])


def _span(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


class HierWork:
    """The work of a hierarchical block on gloo: completed when its all-gather has (or when a
    stage failed). ``wait(timeout)`` raises ``RuntimeError`` on a failure or at the timeout
    (what :func:`~usbyte_opt.collectives.agree.wait` turns into one line);
    :meth:`get_future` completes with it.

    Example::

        >>> w = HierWork(); w.is_completed()
        False
        >>> w.done(); w.wait(), w.is_completed()
        (True, True)
    """

    __slots__ = ("_event", "_error", "_future", "stage")

    def __init__(self) -> None:
        #: The stage running (named in a timeout's message).
        self.stage = "hierarchical all-reduce"
        self._event = threading.Event()
        self._error: str | None = None
        self._future: torch.futures.Future = torch.futures.Future()

    def done(self, error: str | None = None) -> None:
        """The last stage finished (``error``: a stage failed, one line)."""
        if self._event.is_set():
            return
        self._error = error
        self._event.set()
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(RuntimeError(error))

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._event.wait(None if timeout is None else timeout.total_seconds()):
            ms = int(timeout.total_seconds() * 1000) if timeout is not None else 0
            raise RuntimeError(f"{self.stage}: timed out after {ms} ms")
        if self._error is not None:
            raise RuntimeError(self._error)
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def get_future(self) -> torch.futures.Future:
        return self._future


class StreamWork:
    """The work of a hierarchical block on NCCL: an event on the channel's side stream after
    the block's last collective (and the copy out of its padded buffer). ``wait()`` makes the
    current stream of the block's ``device`` wait for it (not the current device's, which may
    be another); the block's scratch tensors live as long as the work."""

    __slots__ = ("event", "keep", "device")

    def __init__(self, event: Any, keep: tuple[torch.Tensor, ...], device: torch.device):
        self.event, self.keep, self.device = event, keep, device

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Make the current stream of the block's device wait for the block (the host does
        not wait)."""
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def get_future(self) -> Any:
        raise NotImplementedError("a stream event has no future")


class HierChannel:
    """This rank's groups for hierarchical blocks, and their issue (see the module's text).

    A collective call: every rank of ``group`` constructs it, at the same point, with the same
    ``nodes`` (the runtime does at install, only for a schedule with hierarchical blocks).

    Args:
        group: the data-parallel group (``None``: the world); its ranks are numbered by it.
        nodes: nodes of ``world_size // nodes`` ranks (a divisor of the world size).
        device: the gradients' device (CUDA: NCCL subgroups; else gloo one-thread groups).
        timeout: the gloo groups' timeout (``None``: torch's default).
    """

    __slots__ = ("nodes", "g", "node", "local", "cuda", "device", "intra", "inter", "groups",
                 "_rs", "_ar", "_ag", "_side", "_broken", "_names")

    def __init__(self, group: dist.ProcessGroup | None, nodes: int, device: torch.device,
                 timeout: timedelta | None):
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        self.nodes, self.g = nodes, ws // nodes
        self.node, self.local = divmod(rank, self.g)
        self.intra, self.inter = node_members(ws, nodes)
        self.device = device
        self.cuda = device.type == "cuda"
        self._side: Any = None
        #: The first failed stage (one line): later stages and blocks fail with it, unissued.
        self._broken: str | None = None
        mine_intra, mine_inter = self.intra[self.node], self.inter[self.local]
        self._names = (f"reduce-scatter inside node {self.node} (ranks {_span(mine_intra)})",
                       f"all-reduce across nodes (ranks {_span(mine_inter)})",
                       f"all-gather inside node {self.node} (ranks {_span(mine_intra)})")
        rs_pg: Any
        ar_pg: Any
        ag_pg: Any
        if self.cuda:
            def glob(ranks: list[int]) -> list[int]:
                return ranks if group is None else [dist.get_global_rank(group, r) for r in ranks]

            # The backend named, not the default group's inherited: NCCL for the CUDA
            # gradients, unless the data-parallel group itself is gloo carrying CUDA tensors
            # (then gloo, as there).
            backend = "nccl" if "nccl" in str(dist.get_backend(group)).lower() else "gloo"
            kw: dict[str, Any] = {"backend": backend}
            if timeout is not None:
                kw["timeout"] = timeout
            made = [dist.new_group(glob(r), **kw) for r in self.intra + self.inter]
            rs_pg = ag_pg = made[self.node]
            ar_pg = made[nodes + self.local]
            self.groups: tuple[Any, ...] = (rs_pg, ar_pg)
            self._rs = reduce_scatter_issuer(rs_pg)
            self._ar = sum_issuer(ar_pg) if nodes > 1 else None
            self._ag = all_gather_issuer(ag_pg)
        else:
            subs = serial_subgroups(group, self.intra + self.inter + self.intra, timeout,
                                    tag="hier")
            rs_pg, ar_pg = subs[self.node], subs[nodes + self.local]
            ag_pg = subs[nodes + self.g + self.node]
            self.groups = (rs_pg, ar_pg, ag_pg)
            self._rs = _gloo_reduce_scatter(rs_pg)
            self._ar = sum_issuer(None, ar_pg) if nodes > 1 else None
            self._ag = all_gather_issuer(None, ag_pg)

    def all_reduce(self, view: torch.Tensor) -> Any:
        """Start the hierarchical sum of ``view`` (contiguous) over every rank; its work."""
        if self.cuda:
            return self._issue_stream(view)
        return self._issue_gloo(view)

    def _buffers(self, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reduce-scatter's input (``view``, or a copy padded with zeros to a multiple of
        the ranks per node) and this rank's chunk."""
        n, g = view.numel(), self.g
        c = -(-n // g)
        x = view if c * g == n else torch.cat([view, view.new_zeros(c * g - n)])
        return x, view.new_empty(c)

    def _issue_gloo(self, view: torch.Tensor) -> HierWork:
        work = HierWork()
        if self._broken is not None:
            work.done(self._broken)
            return work
        x, chunk = self._buffers(view)
        rs_name, ar_name, ag_name = self._names

        def stage(name: str, then: Callable[[], None]) -> Callable[[torch.futures.Future], None]:
            def on_done(fut: torch.futures.Future) -> None:
                # On the gloo worker thread that ran the stage (or here, if it has finished):
                # never work.wait() there, the work is marked completed after this returns.
                try:
                    if self._broken is not None:
                        raise RuntimeError(self._broken)
                    fut.value()   # the stage's own failure
                    then()
                except BaseException as e:  # noqa: BLE001 - the block's work carries it
                    msg = f"{name}: {first_line(e)}"
                    if self._broken is None:
                        self._broken = msg
                    work.done(msg)
            return on_done

        def after_ag() -> None:
            if x is not view:
                view.copy_(x[: view.numel()])
            work.done()

        def after_ar() -> None:
            work.stage = ag_name
            self._ag(x, chunk).get_future().add_done_callback(stage(ag_name, after_ag))

        def after_rs() -> None:
            parts = x_parts[0].view(self.g, -1)   # row i: chunk j of local rank i's block
            torch.add(parts[0], parts[1], out=chunk)
            for i in range(2, self.g):
                chunk.add_(parts[i])
            x_parts.clear()
            if self._ar is None:
                after_ar()
            else:
                work.stage = ar_name
                self._ar(chunk).get_future().add_done_callback(stage(ar_name, after_ar))

        x_parts = [torch.empty_like(x)]
        work.stage = rs_name
        self._rs(x_parts[0], x).get_future().add_done_callback(stage(rs_name, after_rs))
        return work

    def _issue_stream(self, view: torch.Tensor) -> StreamWork:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            x, chunk = self._buffers(view)
            self._rs(chunk, x).wait()
            if self._ar is not None:
                self._ar(chunk).wait()
            self._ag(x, chunk).wait()
            if x is not view:
                view.copy_(x[: view.numel()])
            event = torch.cuda.Event()
            event.record(side)
        return StreamWork(event, (x, chunk), view.device)

    def close(self) -> None:
        """Release the groups (call once nothing is in flight)."""
        self.groups = ()
        self._rs = self._ag = _closed
        self._ar = None


def _gloo_reduce_scatter(pg: Any) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """The reduce-scatter of the node's gloo group, as an all-to-all: ``issue(parts, x)``
    sends chunk ``i`` of ``x`` to local rank ``i`` and receives, in row ``i`` of ``parts``,
    local rank ``i``'s copy of this rank's chunk; the caller adds the rows, in local-rank
    order, once it has finished. (Gloo's own reduce-scatter is a whole all-reduce and its
    work has no future to chain on.)"""
    opts = dist.AllToAllOptions()
    return lambda parts, x: pg.alltoall_base(parts, x, [], [], opts)


def _closed(*args: Any) -> Any:
    from ..errors import UsbyteError

    raise UsbyteError("all-reduce on a closed DistributedOptimizer: create a new one to train on")
