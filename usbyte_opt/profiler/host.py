"""What the runtime and torch DDP cost the host per tensor and per block (the profile's
``host`` section, docs/profiles.md; the planner charges it, docs/planner.md "Host cost").

The runtime is Python: each trainable tensor costs a post-accumulate-grad hook and some
bookkeeping per iteration, and each block the issue of one asynchronous all-reduce and its
wait; torch DDP's reducer is C++ and pays much less per tensor. Neither shows in forward,
backward or the all-reduce line, so :func:`host_cost` measures them on the profiling ranks,
on their device and backend:

* a synthetic model of many tiny tensors (a stack of ``Linear(8, 8)``, compute negligible);
* five arms, each its own copy of it, timed **side by side**: rounds in which every arm runs
  a few iterations, the order rotated each round, so that load on the machine falls on all
  alike — a plain optimizer loop; the runtime with all tensors in one block and with one
  block per tensor; DDP with one bucket and with one bucket per tensor
  (``bucket_cap_mb_list``, where this torch has it);
* on a process group of this rank alone (same backend), so that no communication latency
  enters: the all-reduce line already counts it; with one rank, the profile's own group;
* per round, the arms' median iteration (forward, backward, ``step()``, ``zero_grad()``;
  on CUDA up to a device synchronize) gives ``block = (per-tensor blocks - one block) /
  (n - 1)`` and ``tensor = (one block - plain - block) / n`` (a per-iteration constant of
  the runner, such as its step's bookkeeping, is spread over the ``n`` tensors); the median
  over rounds, then the maximum over ranks (the slowest rank gates every block).

Under ``usbyte-opt bench --emulate`` (``host_cost(link=)``) every arm's collectives
also go through an emulated link of the same kind as the run's, with no link time: the run
pays the link's own submission per block and per bucket (on CUDA events, a stream switch and
a CUDA-aware future each), so the profile charges it too.

On CUDA it also tells whether the iteration of the real model is **launch-bound**
(:func:`launch_bound`): the host's time to issue one iteration against the GPU's time to run
it, measured with CUDA events while the GPU first sleeps, so that it runs the iteration's
kernels back to back without waiting for the host. On CPU the host is the device, and the
section says ``launch_bound: true``: nothing hides the host's cost.

About 1–3 s on a 2-core CPU.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..formats import Block, HostCost

#: Layers of the synthetic model (each ``Linear(8, 8)``: two tensors).
LAYERS = 48
#: Rounds of the side-by-side timing, and timed iterations of each arm in each round.
ROUNDS = 8
PER_ROUND = 3
#: Untimed iterations of each arm before the first round.
WARMUP = 3

#: The arms, in the order of the first round.
ARMS = ("plain", "runtime-1", "runtime-n", "ddp-1", "ddp-n")


class ManyTiny(nn.Module):
    """``layers`` stacked ``Linear(8, 8)``: many tiny tensors, negligible compute.

    Example::

        >>> m = ManyTiny(3)
        >>> len(list(m.parameters())), tuple(m(torch.ones(2, 8)).shape)
        (6, ())
    """

    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@dataclass(slots=True)
class HostProbe:
    """What :func:`host_cost` measured on this rank: per round, each arm's median iteration
    (µs), and the costs fitted to them."""

    tensors: int
    rounds: dict[str, list[float]] = field(default_factory=dict)
    runtime_tensor_us: float = 0.0
    runtime_block_us: float = 0.0
    ddp_tensor_us: float = 0.0
    ddp_bucket_us: float = 0.0
    ddp_buckets_measured: bool = True
    seconds: float = 0.0
    #: ``"N ranks"`` when the arms' collectives went through an emulated link of N ranks
    #: (``host_cost(link=)``), else ``None``.
    emulated: str | None = None


def fit(rounds: Mapping[str, Sequence[float]], n: int) -> dict[str, float]:
    """Per-tensor and per-block costs (µs) from the arms' median iterations per round
    (module docstring): each round's differences, then their median over rounds; negative
    values (noise) are 0. An arm missing from ``rounds`` leaves its cost at 0.

    Example::

        >>> r = {"plain": [1000.0, 1010.0], "runtime-1": [1850.0, 1860.0],
        ...      "runtime-n": [5850.0, 5860.0], "ddp-1": [1200.0, 1210.0], "ddp-n": [1400.0, 1410.0]}
        >>> {k: round(v, 3) for k, v in fit(r, 101).items()}   # blocks: 4000/100; (850-40)/101
        {'runtime_block_us': 40.0, 'runtime_tensor_us': 8.02, 'ddp_bucket_us': 2.0, 'ddp_tensor_us': 1.96}
    """
    def med(xs: list[float]) -> float:
        return max(0.0, statistics.median(xs)) if xs else 0.0

    plain = rounds["plain"]
    out: dict[str, float] = {}
    for one, many, tensor_key, block_key in (
            ("runtime-1", "runtime-n", "runtime_tensor_us", "runtime_block_us"),
            ("ddp-1", "ddp-n", "ddp_tensor_us", "ddp_bucket_us")):
        if one not in rounds:
            out[block_key] = out[tensor_key] = 0.0
            continue
        blocks = [(m - o) / max(n - 1, 1) for o, m in zip(rounds[one], rounds.get(many, ()))]
        block = med(blocks)
        out[block_key] = block
        out[tensor_key] = med([(o - p - block) / n for o, p in zip(rounds[one], plain)])
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No warnings, and no trace file or schedule from the environment, for the probe's own
    optimizers (they are not the user's training)."""
    from ..env import SCHEDULE_ENV, TRACE_ENV

    saved = {k: os.environ.pop(k) for k in (TRACE_ENV, SCHEDULE_ENV) if k in os.environ}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def _probe_group(dev: torch.device, group: Any) -> Iterator[Any]:
    """A process group of this rank alone, on the profile's backend: the profile's own with one
    rank; else a new one (``use_local_synchronization``: no other rank takes part); without
    any process group, a temporary one of one rank (gloo on CPU, NCCL on CUDA)."""
    if not (dist.is_available() and dist.is_initialized()):
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        try:
            yield None
        finally:
            dist.destroy_process_group()
        return
    if dist.get_world_size(group) == 1:
        yield group
        return
    me = dist.get_rank()
    pg = dist.new_group([me], use_local_synchronization=True)
    try:
        yield pg
    finally:
        dist.destroy_process_group(pg)


def host_cost(dev: torch.device, group: Any = None, *, layers: int = LAYERS, rounds: int = ROUNDS,
              per_round: int = PER_ROUND, warmup: int = WARMUP,
              optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
              link: Any = None) -> HostProbe:
    """Measure this rank's host cost per tensor and per block of the runtime and of DDP (the
    module docstring), on ``dev``; ``group``: the profile's process group (default the world,
    or none). Every rank of ``group`` may call it at once (it runs no collective on
    ``group``); the caller takes the maximum over ranks. ``link``: a
    :class:`~usbyte_opt.collectives.emulate.LinkSpec` whose ranks every arm's collectives also
    go through with no link time (``bench --emulate``: the link's submission is part of what
    each block of the run costs), or ``None``.

    Example (CPU, one rank, no process group)::

        >>> p = host_cost(torch.device("cpu"), layers=8, rounds=2, per_round=1, warmup=1)
        >>> p.tensors, sorted(p.rounds)
        (16, ['ddp-1', 'ddp-n', 'plain', 'runtime-1', 'runtime-n'])
        >>> p.runtime_tensor_us >= 0 and p.runtime_block_us >= 0
        True
        >>> from usbyte_opt.collectives.emulate import parse_emulate
        >>> host_cost(torch.device("cpu"), layers=4, rounds=1, per_round=1, warmup=1,
        ...           link=parse_emulate("8x1gbit")).emulated
        '8 ranks'
    """
    from ..ddp import supports_bucket_list
    from ..planning.problem import Problem
    from ..runtime import DistributedOptimizer, profile_from_model

    t0 = time.perf_counter()
    make_opt = optimizer or (lambda ps: torch.optim.SGD(ps, lr=1e-3))
    x = torch.randn(4, 8, device=dev)
    with _quiet(), _probe_group(dev, group) as pg, _emulation(link, dev, pg) as (on_channel, on_ddp):
        def model() -> nn.Module:
            torch.manual_seed(0)
            return ManyTiny(layers).to(dev)

        arms: dict[str, tuple[nn.Module, Any]] = {}
        net = model()
        arms["plain"] = (net, make_opt(net.parameters()))
        pb = Problem.from_profile(profile_from_model(net, 1))
        lay = pb.layout()
        n = pb.n
        one = pb.schedule("host-probe-1", lay, [Block(0, 0, lay.numel[0])])
        many = pb.schedule("host-probe-n", lay, [lay.whole(i) for i in pb.ready_order()])
        for name, sched in (("runtime-1", one), ("runtime-n", many)):
            net = model()
            arms[name] = (net, DistributedOptimizer(make_opt(net.parameters()), net, sched,
                                                    process_group=pg, verify=False,
                                                    check_every=0))
            on_channel(arms[name][1])
        ddp_n = supports_bucket_list()
        for name in ("ddp-1", "ddp-n") if ddp_n else ("ddp-1",):
            net = model()
            kw: dict[str, Any] = {"process_group": pg}
            if dev.type == "cuda":
                kw["device_ids"] = [dev.index]
            if name == "ddp-n":
                # one bucket per tensor: each cap half a byte under its tensor
                kw["bucket_cap_mb_list"] = [(p.numel() * p.element_size() - 0.5) / (1 << 20)
                                            for p in net.parameters()]
            wrapped = nn.parallel.DistributedDataParallel(net, **kw)
            on_ddp(wrapped)
            arms[name] = (wrapped, make_opt(net.parameters()))

        def iteration(net: nn.Module, opt: Any) -> float:
            t = time.perf_counter()
            net(x).backward()
            opt.step()
            opt.zero_grad()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return (time.perf_counter() - t) * 1e6

        for net, opt in arms.values():
            for _ in range(warmup):
                iteration(net, opt)
        names = list(arms)
        per: dict[str, list[float]] = {k: [] for k in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                net, opt = arms[k]
                per[k].append(statistics.median(iteration(net, opt) for _ in range(per_round)))
        for k in ("runtime-1", "runtime-n"):
            arms[k][1].close()
        # Torch DDP's reducers hold the group: they go while the group still has its other
        # owners. Freed after it is destroyed, a reducer would drop the group's last
        # reference with the GIL held, and the group's worker threads, still freeing a
        # finished all-reduce whose saved state holds a Python object, need the GIL to end:
        # its destructor, joining them, would wait for ever (seen once in the test suite).
        arms.clear()
        net = opt = wrapped = None
        gc.collect()
    costs = fit(per, n)
    return HostProbe(n, {k: [round(v, 3) for v in xs] for k, xs in per.items()}, **costs,
                     ddp_buckets_measured=ddp_n, seconds=time.perf_counter() - t0,
                     emulated=None if link is None else f"{link.ranks} ranks")


@contextlib.contextmanager
def _emulation(spec: Any, dev: torch.device, pg: Any) -> Iterator[tuple[Callable[[Any], None],
                                                                        Callable[[Any], None]]]:
    """``(on_channel, on_ddp)``: put a runtime's blocks and a DDP's buckets on an emulated
    link of ``spec``'s ranks with no link time (``spec`` ``None``: both do nothing); the link
    is closed on leaving."""
    if spec is None:
        yield (lambda opt: None), (lambda ddp: None)
        return
    from ..collectives.emulate import (
        EmulatedHookState,
        EmulatedLink,
        LinkSpec,
        emulated_allreduce_hook,
        install_on_channel,
    )

    free = LinkSpec(spec.ranks, 1e30, 0.0)   # the link's submission, no time on it
    link = EmulatedLink(dev)

    def on_ddp(ddp: Any) -> None:
        ddp.register_comm_hook(EmulatedHookState(free, pg, link), emulated_allreduce_hook)

    try:
        yield (lambda opt: install_on_channel(opt._chan, free, link)), on_ddp
    finally:
        link.close()


def launch_bound(step: Callable[[], None], dev: torch.device, repeats: int = 5) -> tuple[bool | None, dict[str, Any]]:
    """Whether one training iteration (``step``: forward, backward, optimizer step) is
    launch-bound on CUDA device ``dev``: the host's time to issue it at least the GPU's time
    to run it. ``(None, record)`` where it cannot tell (CPU, or an iteration that waits for
    the GPU itself, so that the host's time cannot be told apart).

    Each sample: the GPU first sleeps (``torch.cuda._sleep``) for at least twice a whole
    synchronised iteration, so that the host issues the whole iteration while the GPU is still
    asleep; the host's time is the issue (``perf_counter`` around ``step``), the GPU's the
    span between CUDA events recorded right after the sleep and right after the iteration,
    in which the GPU runs its kernels back to back. A sample whose issue outlasted the sleep
    (the host waited for the GPU) is not used; medians over ``repeats`` samples.
    """
    rec: dict[str, Any] = {"method": "host: perf_counter around one iteration's issue while the "
                                     "GPU sleeps; GPU: CUDA events around the iteration after the "
                                     "sleep; medians"}
    if dev.type != "cuda":
        return None, rec
    with torch.cuda.device(dev):     # the events, the sleep and the step on dev's current stream
        return _launch_bound(step, dev, repeats, rec)


def _launch_bound(step: Callable[[], None], dev: torch.device, repeats: int,
                  rec: dict[str, Any]) -> tuple[bool | None, dict[str, Any]]:
    sync = torch.cuda.synchronize
    step()
    sync(dev)
    t = time.perf_counter()
    step()
    sync(dev)
    whole_ms = (time.perf_counter() - t) * 1e3
    # cycles per millisecond of the sleep kernel
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(1_000_000)
    b.record()
    sync(dev)
    per_ms = 1_000_000 / max(a.elapsed_time(b), 1e-3)
    sleep_ms = max(2.0 * whole_ms, 5.0)
    host, gpu = [], []
    for _ in range(repeats):
        sync(dev)
        torch.cuda._sleep(int(per_ms * sleep_ms))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t = time.perf_counter()
        step()
        h = (time.perf_counter() - t) * 1e3
        e1.record()
        sync(dev)
        if h < 0.9 * sleep_ms:
            host.append(h)
            gpu.append(e0.elapsed_time(e1))
    rec.update(whole_ms=round(whole_ms, 6), sleep_ms=round(sleep_ms, 6), samples=len(host))
    if not host:
        rec["note"] = "every issue outlasted the GPU's sleep: the iteration waits for the GPU"
        return None, rec
    h, g = statistics.median(host), statistics.median(gpu)
    rec.update(host_ms=round(h, 6), gpu_ms=round(g, 6))
    return h >= g, rec


def to_host_cost(probes: Sequence[HostProbe], bound: Sequence[bool | None], dev: torch.device,
                 backend: str) -> tuple[HostCost, dict[str, Any]]:
    """The profile's ``host`` section from every rank's probe and launch-bound verdict (the
    maximum over ranks of each cost; launch-bound where any rank is), and the record kept in
    ``meta.host_probe``.

    Example::

        >>> a = HostProbe(96, {}, 8.0, 45.0, 1.0, 6.0)
        >>> b = HostProbe(96, {}, 9.0, 40.0, 1.2, 5.0)
        >>> host, rec = to_host_cost([a, b], [None, None], torch.device("cpu"), "gloo")
        >>> host.runtime_tensor_us, host.runtime_block_us, host.launch_bound
        (9.0, 45.0, True)
    """
    def mx(key: str) -> float:
        return round(max(getattr(p, key) for p in probes), 3)

    known = [b for b in bound if b is not None]
    if dev.type != "cuda":
        lb, how = True, "CPU: the host is the device, nothing hides its cost"
    elif known:
        lb, how = any(known), "CUDA events, the slowest rank (launch-bound where any rank is)"
    else:
        lb, how = True, "CUDA, not measurable (the iteration waits for the GPU): assumed launch-bound"
    host = HostCost(mx("runtime_tensor_us"), mx("runtime_block_us"), mx("ddp_tensor_us"),
                    mx("ddp_bucket_us"), lb,
                    method=f"usbyte_opt.profiler.host: {probes[0].tensors} tiny tensors on "
                           f"{dev.type}/{backend}, a group of each rank alone; the runtime with "
                           "one block and one block per tensor, DDP with one bucket and one per "
                           "tensor, and a plain loop, side by side; max over ranks; "
                           + (f"through an emulated link of {probes[0].emulated} (its "
                              "submission, no link time); " if probes[0].emulated else "")
                           + f"launch_bound: {how}")
    rec = {"tensors": probes[0].tensors, "rounds": ROUNDS, "per_round": PER_ROUND,
           "ddp_buckets_measured": all(p.ddp_buckets_measured for p in probes),
           "seconds": round(max(p.seconds for p in probes), 3),
           "per_rank": [{"rounds_us": p.rounds,
                         **{k: round(getattr(p, k), 3) for k in
                            ("runtime_tensor_us", "runtime_block_us", "ddp_tensor_us",
                             "ddp_bucket_us")}} for p in probes]}
    return host, rec


__all__ = ["ARMS", "HostProbe", "LAYERS", "ManyTiny", "fit", "host_cost", "launch_bound",
           "to_host_cost"]
