"""Issuers of the sharded runtime's collectives: reduce-scatter and all-gather of flat tensors.

The counterparts of :func:`~usbyte_opt.collectives.issuers.sum_issuer` for ZeRO-1
(:mod:`usbyte_opt.runtime.sharded`): each returns a function that starts one asynchronous
collective and returns its work, on ``serial`` (a
:func:`~usbyte_opt.collectives.issuers.serial_group`, so that the collectives run one at a time
in issue order, as the blocks' all-reduces do) when given, else on ``group``. Both take tensors
whose sizes divide exactly: ``len(full) == world_size * len(shard)``; rank ``r``'s shard is
``full[r * len(shard):(r + 1) * len(shard)]``.

Example (one rank)::

    >>> import os, tempfile, torch, torch.distributed as dist
    >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
    >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    >>> rs, ag = reduce_scatter_issuer(None), all_gather_issuer(None)
    >>> out = torch.zeros(3); _ = rs(out, torch.arange(3.0)).wait(); out.tolist()
    [0.0, 1.0, 2.0]
    >>> full = torch.zeros(3); _ = ag(full, out * 2).wait(); full.tolist()
    [0.0, 2.0, 4.0]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Issuer = Callable[[torch.Tensor, torch.Tensor], dist.Work]

# torch 2.13 renamed the tensor forms (the old names warn); older releases have only those.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_issuer(group: dist.ProcessGroup | None,
                          serial: dist.ProcessGroup | None = None) -> Issuer:
    """``issue(shard, full)``: start summing ``full`` over the ranks, this rank's shard of the
    sum landing in ``shard``."""
    if serial is not None:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # the stub says ReduceOp; it takes RedOpType
        return lambda shard, full: serial._reduce_scatter_base(shard, full, opts)  # type: ignore[attr-defined]
    return lambda shard, full: _reduce_scatter(shard, full, group=group, async_op=True)


def all_gather_issuer(group: dist.ProcessGroup | None,
                      serial: dist.ProcessGroup | None = None) -> Issuer:
    """``issue(full, shard)``: start gathering every rank's ``shard`` into ``full``, in rank
    order."""
    if serial is not None:
        return lambda full, shard: serial._allgather_base(full, shard)  # type: ignore[attr-defined]
    return lambda full, shard: _all_gather(full, shard, group=group, async_op=True)
