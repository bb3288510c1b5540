"""Profiler parts in one process: sweep sizes, the fit, the analytic fallback, the sweep on a
one-rank gloo group, hooks on models with control flow, aggregation helpers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import play, played
from torch import nn

from usbyte_opt.collectives.issuers import backend_for
from usbyte_opt.collectives.sweep import Sweep, analytic_comm, default_sizes, fit_comm, sweep_allreduce
from usbyte_opt.errors import UsbyteError
from usbyte_opt.profiler.optimizers import make_optimizer
from usbyte_opt.profiler.timing import IterationTimer, Timings, apportion_update, quantile, summarize


def test_default_sweep_is_log_spaced_4kib_to_64mib():
    s = default_sizes()
    assert len(s) == 12 and s[0] == 4096 and s[-1] == 64 << 20
    assert all(b % 4 == 0 for b in s) and all(a < b for a, b in zip(s, s[1:]))
    ratios = [b / a for a, b in zip(s, s[1:])]
    assert max(ratios) / min(ratios) < 1.01


@pytest.mark.parametrize("args, match", [((4096, 1024, 4), "min bytes <= max bytes"),
                                         ((4096, 8192, 1), "--comm-points")])
def test_bad_sweeps_are_rejected(args, match):
    with pytest.raises(UsbyteError, match=match):
        default_sizes(*args)


def test_analytic_comm_is_the_8_worker_25_gbit_ring_and_can_be_overridden():
    c = analytic_comm()
    assert (c.backend, c.world_size) == ("analytic", 8)
    assert c.alpha_ms == pytest.approx(1.3) and c.algbw_gbs == pytest.approx(25 / 8 * 8 / 14)
    o = analytic_comm(alpha_ms=0.2, algbw_gbs=12.0)
    assert (o.alpha_ms, o.algbw_gbs) == (0.2, 12.0)
    with pytest.raises(UsbyteError, match="--algbw-gbs"):
        analytic_comm(algbw_gbs=0)
    with pytest.raises(UsbyteError, match="--alpha-ms"):
        analytic_comm(alpha_ms=-1)


def test_fit_recovers_a_line_and_keeps_samples():
    sizes = default_sizes(4096, 16 << 20, 6)
    sw = Sweep(sizes, raw_ms=[[0.3 + b / 1.5e6] * 3 for b in sizes],
               medians_ms=[0.3 + b / 1.5e6 for b in sizes])
    comm, record = fit_comm(sw, "gloo", 2)
    assert comm.alpha_ms == pytest.approx(0.3, rel=1e-3) and comm.algbw_gbs == pytest.approx(1.5, rel=1e-3)
    assert [b for b, _ in comm.samples] == sizes
    assert record["fit"]["max_rel_error"] < 1e-3 and len(record["raw_ms"]) == 6


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sweep_runs_on_a_real_group_and_counts_more_small_samples(one_rank_group):
    seen = []
    sw = sweep_allreduce([4096, 2 << 20], repeats=2, progress=lambda *a: seen.append(a))
    assert [len(r) for r in sw.raw_ms] == [6, 2]
    assert all(m > 0 for m in sw.medians_ms)
    assert seen[-1] == ("all-reduce", 8, 8)
    assert backend_for(None, torch.device("cpu")) == "gloo"
    assert sw.chains == [4, 1]


def test_sweep_times_the_given_channel_in_chains_below_one_mib(one_rank_group):
    calls = []

    def issue(x):
        calls.append(x.numel() * 4)
        return dist.all_reduce(x, async_op=True)

    sw = sweep_allreduce([4096, 2 << 20], repeats=2, warmup=0, issue=issue, chain=3)
    # 6 samples of 3 chained calls at 4 KiB, 2 single calls at 2 MiB.
    assert calls.count(4096) == 18 and calls.count(2 << 20) == 2
    assert sw.chains == [3, 1] and [len(r) for r in sw.raw_ms] == [6, 2]
    with pytest.raises(UsbyteError, match="chain"):
        sweep_allreduce([4096], chain=0)


class Looping(nn.Module):
    """Calls ``block`` once in the first forward and twice afterwards: the hook sequence
    differs from the discovery pass, so need_ms falls back to owner pre-hooks."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.block = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x = self.first(x)
        for _ in range(1 if self.calls == 1 else 2):
            x = self.block(x)
        return x


def test_changing_control_flow_falls_back_to_owner_hooks():
    m = Looping()
    t = IterationTimer(m, (torch.randn(4, 8),), lambda o: o.sum(), make_optimizer("sgd", list(m.parameters())))
    tm = t.run(warmup=0, repeats=2)
    assert tm.fallback_passes == 2
    need = dict(zip(tm.names, tm.need_ms[-1]))
    assert 0 <= need["first.weight"] <= need["block.weight"]


class LossParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra = nn.Parameter(torch.ones(4))  # used only by the loss function

    def forward(self, x):
        return self.lin(x)


def test_parameters_used_only_in_the_loss_are_anchored_and_get_gradients():
    m = LossParam()
    t = IterationTimer(m, (torch.ones(2, 4),), lambda o: (o * m.extra).sum(), None)
    tm = t.run(warmup=0, repeats=1)
    assert tm.no_grad == [] and tm.unused == [] and tm.functional == []
    need = dict(zip(tm.names, tm.need_ms[0]))
    assert need["extra"] == need["lin.weight"]  # the last hook before its use is lin's


def test_unhooked_runs_time_without_per_tensor_data():
    m = nn.Linear(4, 2)
    t = IterationTimer(m, (torch.randn(3, 4),), lambda o: o.sum(), None, hooks=False)
    tm = t.run(warmup=0, repeats=2)
    assert len(tm.forward_ms) == 2 and all(math.isnan(x) for x in tm.need_ms[0])
    assert not m._forward_pre_hooks and all(not p._post_accumulate_grad_hooks for p in m.parameters())


def test_hooks_are_removed_after_a_run():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    IterationTimer(m, (torch.randn(2, 4),), lambda o: o.sum(), None).run(warmup=0, repeats=1)
    assert all(not mod._forward_pre_hooks for mod in m.modules())
    assert all(not p._post_accumulate_grad_hooks for p in m.parameters())


def test_bad_repeat_counts():
    m = nn.Linear(2, 1)
    with pytest.raises(UsbyteError, match="--repeats"):
        IterationTimer(m, (torch.randn(1, 2),), lambda o: o.sum(), None).run(repeats=0)
    with pytest.raises(UsbyteError, match="--warmup"):
        IterationTimer(m, (torch.randn(1, 2),), lambda o: o.sum(), None).run(warmup=-1)


def test_summary_clamps_and_fills_missing_values():
    t = Timings(["a", "b", "c"], [(1,), (1,), (2,)], ["float32"] * 3, [1, 1, 2],
                forward_ms=[2.0, 2.0], backward_ms=[3.0, 3.0], step_ms=[0.4, 0.4],
                ready_ms=[[3.5, math.nan, 1.0]] * 2, need_ms=[[-0.1, math.nan, 1.0]] * 2)
    s = summarize(t)
    assert s.ready_ms == [3.0, 3.0, 1.0] and s.need_ms == [0.0, 2.0, 1.0]
    assert s.update_ms == pytest.approx([0.4 / 3, 0.0, 0.8 / 3])
    assert s.spread["forward_ms"] == {"p10": 2.0, "p50": 2.0, "p90": 2.0}


def test_quantile_and_apportion_edges():
    assert math.isnan(quantile([], 0.5)) and quantile([1.0], 0.9) == 1.0
    assert apportion_update(5.0, [3, 4], [False, False]) == [0.0, 0.0]


def test_unknown_optimizer():
    with pytest.raises(UsbyteError, match="--optimizer"):
        make_optimizer("lion", [nn.Parameter(torch.zeros(1))])


def test_cuda_without_a_gpu_is_a_clear_error():
    from usbyte_opt.device import resolve_device

    assert resolve_device("cpu").type == "cpu"
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(UsbyteError, match="--device cuda: expected a CUDA device"):
        resolve_device("cuda")
    with pytest.raises(UsbyteError, match="expected cpu or cuda"):
        resolve_device("meta")


def _sweep_with_own_time_caps(rank: int, ws: int) -> int:
    # Rank 0 is past its cap at once, rank 1 keeps asking (a tolerance no sample meets): the
    # ranks must still take the same branches, round by round, and agree on the samples.
    cap = 1e-6 if rank == 0 else 0.5
    sw = sweep_allreduce([4096, 1 << 20], repeats=2, warmup=0, max_seconds=cap, rel_tol=0.0)
    return sum(len(ts) for ts in sw.raw_ms)


@pytest.fixture(scope="module")
def two_ranks():
    """``two_ranks(name)``: the results of :func:`_sweep_with_own_time_caps` (``sweep``) and
    :func:`_shard_collectives`, played in one spawned run of two ranks."""
    from usbyte_opt.launcher import run_local

    return played(run_local(play, 2, args=({"sweep": (_sweep_with_own_time_caps, ()),
                                            "shard_collectives": (_shard_collectives, ())},),
                            timeout_s=180, pg_timeout_s=60))


def test_sweep_rounds_are_decided_together_whatever_each_rank_clock_says(two_ranks):
    from usbyte_opt.collectives.sweep import SMALL_REPEAT_FACTOR
    from usbyte_opt.launcher import values

    counts = values(two_ranks("sweep"))
    first_rounds = 2 * SMALL_REPEAT_FACTOR + 2   # 4 KiB is below 1 MiB: more repeats
    assert counts[0] == counts[1] > first_rounds  # rank 1's extra rounds ran on both


def _shard_collectives(rank: int, ws: int) -> dict:
    # The runtime channel's issuers (gloo: one serial group for all three), their results, and
    # a short sweep of each on that channel.
    from usbyte_opt.collectives.issuers import block_issuers
    from usbyte_opt.collectives.sweep import fit_collective, shard_sizes, sweep_collective, sweep_collectives

    issuers, channel = block_issuers(None, torch.device("cpu"), ("all-reduce", "reduce-scatter", "all-gather"))
    x = torch.arange(8, dtype=torch.float32) + 10 * rank
    shard = torch.empty(8 // ws)
    issuers["reduce-scatter"](shard, x).wait()
    # On gloo with 2 ranks an all-to-all and one add: bitwise the all-reduce's shard, for
    # values whose sum rounds; torch's own reduce-scatter for other dtypes.
    g = torch.Generator().manual_seed(rank)
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        y = (torch.randn(1 << 12, generator=g) * 1e3).to(dt)
        mine = torch.empty(y.numel() // ws, dtype=dt)
        work = issuers["reduce-scatter"](mine, y)
        work.wait()
        work.wait()   # a second wait adds nothing
        ref = y.clone()
        issuers["all-reduce"](ref).wait()
        assert torch.equal(mine, ref.view(ws, -1)[rank]), dt
        assert (type(work).__name__ == "SummedWork") == (dt != torch.bfloat16)
    whole = torch.empty(8)
    issuers["all-gather"](whole, shard).wait()
    sizes = shard_sizes([4096, 1 << 20, 4 << 20], ws)
    out = {"channel": channel, "shard": shard.tolist(), "whole": whole.tolist(), "sizes": sizes}
    seen = []
    numels: list[int] = []

    def counted(x: torch.Tensor):   # the channel's all-reduce, each call's size noted
        numels.append(x.numel())
        return issuers["all-reduce"](x)

    swept = sweep_collectives({"all-reduce": [4096, 8192], "reduce-scatter": sizes, "all-gather": sizes},
                              repeats=2, warmup=0, issues={**issuers, "all-reduce": counted},
                              progress=lambda *a: seen.append(a))
    out["progress"] = seen[-1]
    # Every reduce-scatter and all-gather sample ends with one 4-byte all-reduce on the channel.
    out["tails"] = numels.count(1)
    out["all-reduce"] = [len(ts) for ts in swept["all-reduce"].raw_ms]
    for kind in ("reduce-scatter", "all-gather"):
        sw = swept[kind]
        cost, record = fit_collective(sw)
        out[kind] = (sw.kind, [len(ts) for ts in sw.raw_ms], cost, record["collective"])
    with pytest.raises(UsbyteError, match="multiples of 8 bytes"):
        sweep_collective("all-gather", [4100], issue=issuers["all-gather"])
    return out


def test_reduce_scatter_and_all_gather_run_on_the_runtime_channel_of_two_ranks(two_ranks):
    from usbyte_opt.launcher import values

    got = values(two_ranks("shard_collectives"))
    total = [float(i) + float(i) + 10 for i in range(8)]          # rank 0's x plus rank 1's
    assert got[0]["shard"] == total[:4] and got[1]["shard"] == total[4:]
    assert got[0]["whole"] == got[1]["whole"] == total
    assert "runtime channel" in got[0]["channel"]
    assert got[0]["sizes"] == [4096, 1 << 20, 4 << 20]
    assert got[0]["all-reduce"] == [6, 6] and got[0]["progress"] == ("collectives", 32, 32)
    assert got[0]["tails"] == got[1]["tails"] == 2 * (6 + 2 + 2)
    for kind in ("reduce-scatter", "all-gather"):
        name, counts, cost, label = got[0][kind]
        assert name == label == kind and counts == [6, 2, 2]
        assert cost.alpha_ms >= 0 and cost.algbw_gbs > 0 and len(cost.samples) == 3
        assert got[1][kind][2] == cost      # the last-arriving rank's samples: the same on both


def test_collective_sweeps_refuse_unknown_kinds_and_uneven_sizes(one_rank_group):
    from usbyte_opt.collectives.sweep import shard_sizes, sweep_collective

    with pytest.raises(UsbyteError, match="expected one of all-reduce.reduce-scatter.all-gather"):
        sweep_collective("broadcast", [4096])
    assert shard_sizes([4, 8, 4096, 4100, 4120], 2) == [8, 4096, 4120]   # 4100: nearest is 4096
    sw = sweep_collective("reduce-scatter", [4096, 8192], repeats=1, warmup=0)   # one rank: a copy
    assert sw.kind == "reduce-scatter" and all(m > 0 for m in sw.medians_ms)


def test_steady_state_iterations_set_the_total_and_the_hooked_ones_the_shares():
    t = Timings(["a", "b"], [(1,), (3,)], ["float32"] * 2, [1, 3],
                forward_ms=[2.0, 2.0], backward_ms=[6.0, 6.0], step_ms=[2.0, 2.0],
                ready_ms=[[4.0, 6.0]] * 2, need_ms=[[0.0, 1.0]] * 2,
                steady_ms=[15.0, 12.0, 18.0])
    s = summarize(t)
    assert (s.forward_ms, s.backward_ms, s.step_ms) == pytest.approx((3.0, 9.0, 3.0))
    assert s.ready_ms == pytest.approx([6.0, 9.0]) and s.need_ms == pytest.approx([0.0, 1.5])
    assert sum(s.update_ms) == pytest.approx(3.0)
    assert s.spread["scale"] == pytest.approx(1.5) and s.spread["hooked_ms"] == 10.0
    assert s.spread["forward_ms"]["p50"] == 2.0 and s.spread["steady_ms"]["p50"] == 15.0
    assert "steady_ms" not in summarize(Timings(["a"], [(1,)], ["float32"], [1], [1.0], [1.0], [1.0],
                                                [[0.5]], [[0.0]])).spread


def test_steady_rounds_run_without_hooks_and_as_many_as_the_repeats():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    seen = []
    m[0].register_forward_pre_hook(lambda *_: seen.append(len(m[0]._forward_pre_hooks)))
    t = IterationTimer(m, (torch.randn(4, 8),), lambda o: o.sum(), make_optimizer("sgd", list(m.parameters())))
    tm = t.run(warmup=1, repeats=4, steady=True)
    assert len(tm.forward_ms) == 4 and len(tm.steady_ms) == 4 and all(x > 0 for x in tm.steady_ms)
    # 1 discovery + 1 warm-up + 4 timed with the timer's hook (2 pre-hooks); 4 + 2 steady
    # iterations (one round of 3, one of 1, each with one more to end it) with ours alone
    assert seen.count(2) == 6 and seen.count(1) == 6
    assert all(not p._post_accumulate_grad_hooks for p in m.parameters())
