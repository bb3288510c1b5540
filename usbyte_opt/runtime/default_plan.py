"""A plan for a model without a profile: a synthetic profile and DDP-like buckets.

:class:`~usbyte_opt.runtime.DistributedOptimizer` falls back to :func:`default_schedule` when it
is given no schedule (with a warning): whole tensors fused into buckets in reverse registration
order, the first bucket 1 MiB and the others 25 MiB, as PyTorch DDP does. Tests and examples
use :func:`profile_from_model` to get a :class:`~usbyte_opt.planning.problem.Problem` for the model and
cut their own blocks from it.

What a model's schedule covers (the fingerprint): the parameters of
``model.named_parameters()`` that require grad. Tied (shared) parameters appear once, under
their first name, because ``named_parameters()`` deduplicates; frozen parameters
(``requires_grad=False``) are not trainable, get no gradient and are not in the schedule.

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    >>> [(n, s, d) for n, s, d in model_tensors(model)][:2]
    [('0.weight', (3, 4), 'float32'), ('0.bias', (3,), 'float32')]
    >>> sched = default_schedule(model, world_size=2)
    >>> sched.buffers[0].tensors       # ready order: the output layer's gradients come first
    ('1.bias', '1.weight', '0.bias', '0.weight')
    >>> [(k.start, k.end) for k in sched.blocks]   # all 23 elements fit one 1 MiB bucket
    [(0, 23)]
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..formats import DTYPE_SIZES, Block, CommSpec, Mode, Profile, Schedule, TensorSpec
from ..planning.ddp import BUCKET_CAP_BYTES, FIRST_BUCKET_BYTES
from ..planning.ddp import buckets as ddp_buckets
from ..planning.problem import Layout, Problem


def dtype_name(dtype: torch.dtype) -> str:
    """The schedule format's name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(module)`` wraps (its ``_orig_mod``), else ``model``: the
    module whose tensors a schedule names (a profile of the plain model, a run of the compiled
    one, and the other way round, name the same tensors).

    Example (``uncompiled(torch.compile(m)) is m`` too; that call imports dynamo)::

        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> uncompiled(m) is m
        True
    """
    orig = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(orig, torch.nn.Module):
        return orig
    return model


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every trainable tensor, in registration order, tied ones once
    (of the module a compiled ``model`` runs: names without ``torch.compile``'s ``_orig_mod.``)."""
    return [(n, p) for n, p in uncompiled(model).named_parameters() if p.requires_grad]


def model_tensors(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of the model's trainable tensors: what the fingerprint covers."""
    return [(n, tuple(p.shape), dtype_name(p.dtype)) for n, p in trainable_parameters(model)]


def profile_from_model(model: torch.nn.Module, world_size: int = 1, name: str = "model",
                       alpha_ms: float = 0.05, algbw_gbs: float = 5.0) -> Profile:
    """A synthetic profile of ``model``: 1 ms of compute per tensor in each direction.

    Forward is assumed to use tensors in registration order (``need_ms = i``) and backward to
    finish their gradients in reverse order (``ready_ms = n - 1 - i``). The communication
    figures are placeholders; a measured profile (``usbyte-opt profile``) replaces all of this.

    Args:
        model: the module whose trainable parameters become the profile's tensors.
        world_size: recorded in ``comm.world_size`` (and so in schedules made from it).
        name: the profile's name.
        alpha_ms, algbw_gbs: the cost model of the synthetic process group.

    Returns:
        A :class:`~usbyte_opt.formats.Profile` whose fingerprint matches the model's.

    Example::

        >>> import torch
        >>> p = profile_from_model(torch.nn.Linear(2, 2), world_size=4)
        >>> [(t.name, t.ready_ms, t.need_ms) for t in p.tensors], p.comm.world_size
        ([('weight', 1.0, 0.0), ('bias', 0.0, 1.0)], 4)
    """
    specs = model_tensors(model)
    if not specs:
        from ..errors import UsbyteError

        raise UsbyteError(f"model {type(model).__name__}: expected at least one parameter with "
                          "requires_grad=True, got none")
    for nm, _, dt in specs:
        if dt not in DTYPE_SIZES:
            from ..errors import UsbyteError

            raise UsbyteError(f"parameter {nm!r}: dtype {dt} cannot be all-reduced by usbyte-opt; "
                              f"expected one of {', '.join(DTYPE_SIZES)}")
    n = len(specs)
    tensors = tuple(TensorSpec(nm, shape, dt, ready_ms=float(n - 1 - i), need_ms=float(i))
                    for i, (nm, shape, dt) in enumerate(specs))
    return Profile(name, float(n), float(n), tensors,
                   CommSpec("analytic", int(world_size), alpha_ms, algbw_gbs),
                   {"source": "usbyte_opt.runtime.default_plan"})


def default_schedule(model: torch.nn.Module, world_size: int = 1,
                     first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                     bucket_cap_bytes: int = BUCKET_CAP_BYTES) -> Schedule:
    """DDP-like schedule for ``model``: DDP's buckets (:func:`usbyte_opt.planning.ddp.buckets`,
    one rule for the planner's ``ddp`` strategy and this plan) of whole tensors in reverse
    registration order.

    Args:
        model: the module to plan for (its trainable parameters).
        world_size: recorded in the schedule.
        first_bucket_bytes, bucket_cap_bytes: bucket caps (DDP's defaults: 1 MiB, 25 MiB).

    Returns:
        A validated :class:`~usbyte_opt.formats.Schedule` with strategy ``"default"``.

    Example::

        >>> import torch
        >>> m = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(3)])
        >>> [(k.start, k.end) for k in default_schedule(m).blocks]  # 1 MiB, then up to 25 MiB
        [(0, 262144), (262144, 786432)]
    """
    problem = Problem.from_profile(profile_from_model(model, world_size))
    layout = problem.layout()
    blocks = ddp_buckets(problem, layout, first_bucket_bytes=first_bucket_bytes,
                         bucket_cap_bytes=bucket_cap_bytes)
    return problem.schedule("default", layout, blocks)


def fallback_schedule(model: torch.nn.Module, world_size: int = 1) -> Schedule:
    """What the runtime falls back on, and compares a plan with: the DDP-like default plan in
    fence mode (all blocks, then all updates), which trains exactly as DDP does.

    Example::

        >>> import torch
        >>> s = fallback_schedule(torch.nn.Linear(3, 2))
        >>> s.strategy, str(s.mode)
        ('ddp-like', 'fence')
    """
    import dataclasses

    return dataclasses.replace(default_schedule(model, world_size), strategy="ddp-like",
                               mode=Mode.FENCE)


def split_blocks(problem: Problem, layout: Layout, pieces: int,
                 order: Iterable[int] | None = None) -> list[Block]:
    """Every tensor cut into ``pieces`` near-equal blocks (fewer for small tensors), issued
    tensor by tensor in ``order`` (default: ready order). A helper for tests and experiments.

    Example::

        >>> import torch
        >>> pb = Problem.from_profile(profile_from_model(torch.nn.Linear(3, 2)))
        >>> [(k.start, k.end) for k in split_blocks(pb, pb.layout(), 2)]
        [(0, 1), (1, 2), (2, 5), (5, 8)]
    """
    order = problem.ready_order() if order is None else list(order)
    out: list[Block] = []
    for i in order:
        b, s, e = layout.pos[i]
        k = max(1, min(pieces, e - s))
        cuts = [s + (e - s) * j // k for j in range(k + 1)]
        out.extend(Block(b, lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo)
    return out
