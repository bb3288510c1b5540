"""PyTorch DDP's gradient buckets: whole tensors fused in ready order, 1 MiB first, then 25 MiB.

This mirrors the semantics of ``torch.distributed._compute_bucket_assignment_by_size`` as the
reducer uses it after its first iteration (when it rebuilds the buckets in the order the
gradients actually became ready):

* tensors are visited in gradient-ready order;
* each dtype has its own open bucket and its own walk through the list of size limits
  ``[first_bucket_bytes, bucket_bytes_cap]`` (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES`` is 1 MiB, so
  the bucket holding the first gradients can go out early; ``bucket_cap_mb`` defaults to 25);
* a tensor is always added whole, and the bucket closes as soon as its size *reaches* the
  limit (``size >= limit``), so a bucket can exceed its cap by up to one tensor;
* DDP all-reduces buckets strictly in bucket order: the buckets that closed, in the order they
  closed, then the buckets still open at the end (at most one per dtype). Torch appends those in
  hash-map order and, for rebuilt buckets, does not sort; here they follow the order in which
  their last gradient becomes ready. With one dtype this is exactly torch's order.

Fence mode: DDP's optimizer step waits for every bucket (docs/design.md §2.6).

Example::

    >>> from usbyte_opt.planning.synthetic import chain_profile
    >>> from usbyte_opt.planning.problem import Problem
    >>> MiB = 1 << 20
    >>> # four float32 tensors of 0.75 MiB each, all in one buffer
    >>> pb = Problem.from_profile(chain_profile([MiB * 3 // 16] * 4))
    >>> p = plan(pb, first_bucket_mb=1.0, bucket_cap_mb=1.0)
    >>> [(k.start, k.end) for k in p.blocks]     # 1.5 MiB >= 1 MiB closes each bucket at 2 tensors
    [(0, 393216), (393216, 786432)]
"""

from __future__ import annotations

from collections.abc import Sequence

from ...formats import Block, Mode
from ..problem import Layout, Problem, Runner
from . import Plan, register

MIB = 1 << 20
#: PyTorch DDP's bucket sizes: ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` and
#: ``bucket_cap_mb=25``.
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_CAP_BYTES = 25 << 20


@register("ddp")
def plan(problem: Problem, *, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0) -> Plan:
    """Fuse whole tensors into DDP buckets over the default layout.

    Args:
        problem: the compiled profile.
        bucket_cap_mb: DDP's ``bucket_cap_mb`` (MiB, as in torch: ``int(mb * 1024 * 1024)`` bytes).
        first_bucket_mb: the cap of the first bucket of each dtype (torch's 1 MiB default).

    Returns:
        A fence-mode :class:`Plan` run by torch DDP (its host cost); ``info["buckets"]`` is
        the number of buckets.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([1000] * 10))   # 40 kB in all
        >>> len(plan(pb).blocks)                                    # one bucket
        1
    """
    if not bucket_cap_mb > 0 or not first_bucket_mb > 0:
        raise ValueError(f"bucket sizes must be > 0 MiB, got bucket_cap_mb={bucket_cap_mb}, "
                         f"first_bucket_mb={first_bucket_mb}")
    layout = problem.layout()
    blocks = buckets(problem, layout, first_bucket_bytes=int(first_bucket_mb * MIB),
                     bucket_cap_bytes=int(bucket_cap_mb * MIB))
    return Plan(layout, blocks, Mode.FENCE, {"buckets": len(blocks), "bucket_cap_mb": bucket_cap_mb,
                                          "first_bucket_mb": first_bucket_mb},
                runner=Runner.DDP)


def buckets(problem: Problem, layout: Layout | None = None, order: Sequence[int] | None = None, *,
            first_bucket_bytes: int = FIRST_BUCKET_BYTES,
            bucket_cap_bytes: int = BUCKET_CAP_BYTES) -> list[Block]:
    """DDP's buckets of ``problem`` (the rule of the module docstring), as blocks of ``layout``
    (default: the problem's default layout, whose buffers hold their tensors in ready order),
    walking tensors in ``order`` (default: ready order); the runtime's default plan is these.

    Example::

        >>> from usbyte_opt.planning.synthetic import chain_profile
        >>> pb = Problem.from_profile(chain_profile([100] * 4))        # 400 B each
        >>> [(k.start, k.end) for k in buckets(pb, first_bucket_bytes=700, bucket_cap_bytes=1000)]
        [(0, 200), (200, 400)]
    """
    limits = (first_bucket_bytes, bucket_cap_bytes)
    layout = problem.layout() if layout is None else layout
    order = problem.ready_order() if order is None else list(order)
    # Per buffer (= per dtype): [start element, end element, bytes, index into limits,
    # ready position of the last tensor added].
    open_: dict[int, list[int]] = {}
    closed: list[tuple[int, Block]] = []     # (ready position of last tensor, block)
    for pos, i in enumerate(order):
        b, s, e = layout.pos[i]
        cur = open_.get(b)
        if cur is None:
            # torch starts every dtype at the first limit (its iterator is per bucket key)
            cur = open_[b] = [s, s, 0, 0, pos]
        elif cur[1] != s:  # pragma: no cover - the default layout keeps each dtype in ready order
            raise AssertionError("ddp: tensors of a buffer are not adjacent in ready order")
        cur[1] = e
        cur[2] += (e - s) * layout.itemsize[b]
        cur[4] = pos
        if cur[2] >= limits[cur[3]]:
            closed.append((pos, Block(b, cur[0], cur[1])))
            # the next bucket of this dtype uses the next limit (the last one repeats)
            open_[b] = [e, e, 0, min(cur[3] + 1, len(limits) - 1), pos]
    leftovers = sorted(((cur[4], Block(b, cur[0], cur[1])) for b, cur in open_.items()
                        if cur[1] > cur[0]), key=lambda x: x[0])
    return [blk for _, blk in closed] + [blk for _, blk in leftovers]
