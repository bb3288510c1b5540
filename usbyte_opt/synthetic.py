"""Synthetic profiles of layer chains: for tests, examples and property checks. No torch.

A chain of ``L`` layers in forward order (input side first): forward reaches layer l after
the forward time of the layers before it; backward runs output side first, so layer l's
gradient is final after the backward time of layers l..L-1.

Example::

    >>> p = chain_profile([1000, 4000, 2000], forward_ms=3.0, backward_ms=6.0, compute=[1, 1, 1])
    >>> [(t.name, t.ready_ms, t.need_ms) for t in p.tensors]
    [('layer0.weight', 6.0, 0.0), ('layer1.weight', 4.0, 1.0), ('layer2.weight', 2.0, 2.0)]
"""

from __future__ import annotations

import random
from typing import Sequence

from .formats import CommSpec, Profile, TensorSpec


def chain_profile(numels: Sequence[int], forward_ms: float = 10.0, backward_ms: float = 20.0,
                  alpha_ms: float = 0.1, algbw_gbs: float = 1.0, world_size: int = 2,
                  compute: Sequence[float] | None = None, update_ms: Sequence[float] | None = None,
                  dtype: str = "float32", name: str = "chain") -> Profile:
    """A chain whose layer l has ``numels[l]`` elements and compute share ``compute[l]``
    (default: proportional to size)."""
    L = len(numels)
    w = list(compute) if compute is not None else [float(n) for n in numels]
    tot = sum(w)
    fw = [forward_ms * x / tot for x in w]
    bw = [backward_ms * x / tot for x in w]
    tensors = []
    need = 0.0
    for l in range(L):
        ready = min(sum(bw[l:]), backward_ms)
        tensors.append(TensorSpec(f"layer{l}.weight", (int(numels[l]),), dtype,
                                  min(round(ready, 9), backward_ms), min(round(need, 9), forward_ms),
                                  float(update_ms[l]) if update_ms is not None else 0.0))
        need += fw[l]
    return Profile(name, forward_ms, backward_ms, tuple(tensors),
                   CommSpec("analytic", world_size, alpha_ms, algbw_gbs), {"source": "synthetic"})


def random_profile(rng: random.Random, n: int, comm_ratio: float = 1.0, alpha_ms: float = 0.2,
                   dtypes: Sequence[str] = ("float32",), name: str = "random",
                   shuffle_need: float = 0.25) -> Profile:
    """A random but plausible profile: ``n`` tensors, sizes log-uniform 1e2..1e7 elements,
    random compute per layer, communication time about ``comm_ratio`` x compute, and
    random (not chain-shaped) ready/need orders in a quarter of the cases."""
    numels = [int(10 ** rng.uniform(2, 7)) for _ in range(n)]
    comp = [rng.uniform(0.2, 2.0) for _ in range(n)]
    F = rng.uniform(5, 50)
    B = F * rng.uniform(1.5, 2.5)
    total_bytes = sum(numels) * 4
    algbw = max(total_bytes / (comm_ratio * (F + B)) / 1e6, 1e-3)
    dts = [rng.choice(list(dtypes)) for _ in range(n)]
    p = chain_profile(numels, F, B, alpha_ms, algbw, compute=comp, name=name,
                      update_ms=[rng.choice([0.0, 0.0, rng.uniform(0, 0.3)]) for _ in range(n)])
    ts = list(p.tensors)
    if rng.random() < shuffle_need:  # shuffle need times: branches, tied weights, odd models
        needs = [t.need_ms for t in ts]
        rng.shuffle(needs)
        ts = [TensorSpec(t.name, t.shape, t.dtype, t.ready_ms, nd, t.update_ms)
              for t, nd in zip(ts, needs)]
    ts = [TensorSpec(t.name, t.shape, dt, t.ready_ms, t.need_ms, t.update_ms) for t, dt in zip(ts, dts)]
    return Profile(name, F, B, tuple(ts), p.comm, p.meta)
