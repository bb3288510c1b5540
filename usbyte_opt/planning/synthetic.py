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

import math
import random
from collections.abc import Sequence

from ..formats import CommSpec, Profile, TensorSpec


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


def moe_profile(layers: int = 27, experts: int = 64, d_model: int = 1024, d_expert: int = 512,
                top_k: int = 6, shared_experts: int = 0, vocab: int = 32_000, tokens: int = 65_536,
                tflops: float = 100.0, hbm_gbs: float = 2_000.0, world_size: int = 16,
                bandwidth_gbps: float = 100.0, latency_us: float = 25.0, dtype: str = "bfloat16",
                name: str | None = None) -> Profile:
    """A mixture-of-experts decoder, shaped like Mixtral / DeepSeek-MoE: one gradient tensor per
    expert matrix per layer. No torch; the timing is derived from FLOPs, not measured.

    Tensors in forward order: the embedding; per layer an attention norm, q/k/v/o
    (``d_model`` x ``d_model``), an FFN norm, the router (``experts`` x ``d_model``) and three
    matrices per routed and per shared expert (``d_expert`` x ``d_model``, ``d_model`` x
    ``d_expert``, ``d_expert`` x ``d_model``); a final norm and the LM head. So a model has
    ``layers * (7 + 3 * (experts + shared_experts)) + 3`` tensors: 995 for Mixtral's 32 x 8,
    5,376 for DeepSeek's 27 x 64, 11,691 for 24 layers of 160 experts.

    Timing: each matrix costs ``2 x tokens it sees x numel`` forward FLOPs (a routed expert sees
    ``tokens * top_k / experts`` tokens, every other matrix all ``tokens`` of this rank; a norm
    costs as if it were a matrix of its size), at ``tflops``; backward costs twice the forward,
    layer by layer in reverse (the chain of :func:`chain_profile`); the optimizer step of a
    tensor is Adam's 20 bytes per element at ``hbm_gbs``. Communication: an analytic ring of
    ``world_size`` ranks at ``bandwidth_gbps`` per link and ``latency_us`` per ring step
    (:func:`usbyte_opt.planning.cost.retarget`).

    Example::

        >>> p = moe_profile(layers=32, experts=8)
        >>> len(p.tensors), p.tensors[10].name, p.comm.world_size
        (995, 'layers.0.experts.0.w3', 16)
        >>> len(moe_profile(layers=27, experts=64).tensors)
        5376
    """
    from .cost import retarget

    if layers < 1 or experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"moe_profile: expected layers >= 1 and 1 <= top_k <= experts, got "
                         f"layers={layers}, experts={experts}, top_k={top_k}")
    specs: list[tuple[str, tuple[int, ...], float]] = []   # name, shape, tokens that use it

    def add(nm: str, shape: tuple[int, ...], seen: float) -> None:
        specs.append((nm, shape, seen))

    add("embed.weight", (vocab, d_model), 0.0)
    routed = tokens * top_k / experts
    for l in range(layers):
        p = f"layers.{l}"
        add(f"{p}.attn_norm.weight", (d_model,), tokens)
        for m in ("q", "k", "v", "o"):
            add(f"{p}.attn.{m}.weight", (d_model, d_model), tokens)
        add(f"{p}.ffn_norm.weight", (d_model,), tokens)
        add(f"{p}.router.weight", (experts, d_model), tokens)
        for kind, count, seen in (("experts", experts, routed), ("shared", shared_experts, tokens)):
            for e in range(count):
                add(f"{p}.{kind}.{e}.w1", (d_expert, d_model), seen)
                add(f"{p}.{kind}.{e}.w2", (d_model, d_expert), seen)
                add(f"{p}.{kind}.{e}.w3", (d_expert, d_model), seen)
    add("norm.weight", (d_model,), tokens)
    add("lm_head.weight", (vocab, d_model), tokens)
    numel = [math.prod(s) for _, s, _ in specs]
    flops = [max(2.0 * seen * n, float(n)) for (_, _, seen), n in zip(specs, numel)]
    per_ms = tflops * 1e9
    F = round(sum(flops) / per_ms, 9)
    B = round(2.0 * F, 9)
    tensors = []
    done_fwd = 0.0
    left_bwd = B
    for (nm, shape, _), n, fl in zip(specs, numel, flops):
        tensors.append(TensorSpec(nm, shape, dtype, min(max(round(left_bwd, 9), 0.0), B),
                                  min(round(done_fwd, 9), F), 20.0 * n / (hbm_gbs * 1e6)))
        done_fwd += fl / per_ms
        left_bwd -= 2.0 * fl / per_ms
    comm = retarget(CommSpec("analytic", 8, 1.0, 1.0), world_size=world_size,
                    bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)
    return Profile(name or f"moe-{layers}x{experts}", F, B, tuple(tensors), comm,
                   {"source": "synthetic", "generator": "usbyte_opt.planning.synthetic.moe_profile",
                    "layers": layers, "experts": experts, "d_model": d_model,
                    "d_expert": d_expert, "top_k": top_k, "shared_experts": shared_experts,
                    "tokens": tokens, "tflops": tflops})
