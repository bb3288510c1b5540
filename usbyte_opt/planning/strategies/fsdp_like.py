"""FSDP-like: one reduce-scatter and one all-gather per module, as FSDP2 wraps modules.

PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) shards per wrapped module: backward
reduce-scatters each module's gradients once they are all final, and the forward all-gathers
each module's parameters before the module runs, one module after the other. This strategy
plans that for sharded mode: the tensors of each module (the name's prefix before its last
``.``, or its first ``depth`` parts) side by side in the flat buffer, one block per module,
reduce-scattered in the order backward finishes them, all-gathered in the order the forward
needs them.

Example::

    >>> from usbyte_opt.formats import Profile, TensorSpec, CommSpec
    >>> from usbyte_opt.planning.problem import Problem
    >>> T = lambda n, r, nd: TensorSpec(n, (100,), "float32", ready_ms=r, need_ms=nd)
    >>> prof = Profile("toy", 4.0, 6.0, (T("l0.weight", 6.0, 0.0), T("l0.bias", 5.5, 0.1),
    ...                                  T("l1.weight", 3.0, 2.0), T("l1.bias", 2.5, 2.1)),
    ...                CommSpec("analytic", 2, 0.1, 1.0))
    >>> p = plan(Problem.from_profile(prof))
    >>> [[prof.tensors[i].name for i in p.layout.tensors_of(k.buffer, k.start, k.end)]
    ...  for k in p.blocks]                    # backward finishes l1 first
    [['l1.bias', 'l1.weight'], ['l0.bias', 'l0.weight']]
    >>> p.gathers                              # the forward needs l0 (block 1) first
    [(1,), (0,)]
"""

from __future__ import annotations

from ...formats import Block, Buffer, Mode
from ..problem import Problem
from ..sharded import forward_gathers, sort_by_ready
from . import Plan, register


def module_of(name: str, depth: int | None = None) -> str:
    """The module a parameter belongs to: its name without the last part, or its first
    ``depth`` parts.

    Example::

        >>> module_of("encoder.layer.3.attn.q.weight"), module_of("encoder.layer.3.attn.q.weight", 3)
        ('encoder.layer.3.attn.q', 'encoder.layer.3')
    """
    parts = name.split(".")
    return ".".join(parts[:-1] if depth is None else parts[:depth])


@register("fsdp-like", sharded=True)
def plan(problem: Problem, depth: int | None = None) -> Plan:
    """One block per module (per dtype), its tensors together.

    Args:
        problem: the compiled profile.
        depth: group by the first ``depth`` parts of the names (FSDP2 wrapping, say, every
            transformer block); default: each parameter's own module.

    Returns:
        A sharded-mode :class:`Plan` with one all-gather per block, in forward order.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for i in problem.ready_order():
        groups.setdefault((problem.dtype[i], module_of(problem.names[i], depth)), []).append(i)
    ordered = sorted(groups.items(), key=lambda kv: (max(problem.ready[i] for i in kv[1]),
                                                     min(kv[1])))
    per_dtype: dict[str, list[list[int]]] = {}
    for (dt, _), members in ordered:
        per_dtype.setdefault(dt, []).append(members)
    buffers = tuple(Buffer(dt, tuple(problem.names[i] for m in mods for i in m))
                    for dt, mods in per_dtype.items())
    layout = problem.layout(buffers)
    blocks = []
    for b, mods in enumerate(per_dtype.values()):
        for m in mods:
            blocks.append(Block(b, layout.pos[m[0]][1], layout.pos[m[-1]][2]))
    blocks = sort_by_ready(problem, layout, blocks)
    return Plan(layout, blocks, Mode.SHARDED, {"modules": len(blocks), "depth": depth or 0},
                gathers=forward_gathers(problem, layout, blocks))
