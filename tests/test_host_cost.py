"""Host cost: the profile's ``host`` section, the one scorer and the lower bound charging it,
``best`` choosing few blocks where the runtime's host cost makes many slow, and one rank's
prediction (compute plus host cost, no network)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from helpers import random_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from usbyte_opt.bench import bench_profile, plan_reports
from usbyte_opt.bench.report import SINGLE_RANK_NOTE, markdown, summarize
from usbyte_opt.errors import FormatError
from usbyte_opt.formats import (
    DEFAULT_HOST_US,
    Block,
    HostCost,
    Profile,
    dump_profile,
    load_profile,
    parse_profile,
    save_profile,
)
from usbyte_opt.planning.bounds import RUNNER_MODES, lower_bound
from usbyte_opt.planning.fastsim import evaluate
from usbyte_opt.planning.planner import compare
from usbyte_opt.planning.problem import HostLine, Problem, Runner, UpdateRule
from usbyte_opt.planning.simulate import simulate, simulate_blocks
from usbyte_opt.planning.synthetic import chain_profile, random_profile

#: A CPU's host cost (µs), of the order the profiler measures on a 2-core machine.
CPU_HOST = HostCost(10.5, 34.0, 7.4, 22.1, True, method="test")


def many_small(n: int = 128, host: HostCost | None = CPU_HOST) -> Profile:
    """``n`` tensors of 64 float32 elements, compute spread evenly, cheap communication
    (20 µs of latency, 1 GB/s): without host cost one block per tensor is optimal."""
    p = chain_profile([64] * n, forward_ms=3.0, backward_ms=6.0, alpha_ms=0.02, algbw_gbs=1.0,
                      compute=[1] * n, name="many-small")
    return dataclasses.replace(p, meta={"device": "cpu", "world_size": 2}, host=host)


# --------------------------------------------------------------------------------------------
# The profile's section
# --------------------------------------------------------------------------------------------


def test_the_section_round_trips_and_a_file_without_it_reads_with_the_defaults(tmp_path):
    prof = many_small()
    save_profile(prof, tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["host"] == {"runtime_tensor_us": 10.5, "runtime_block_us": 34.0, "ddp_tensor_us": 7.4,
                           "ddp_bucket_us": 22.1, "launch_bound": True, "method": "test"}
    assert load_profile(tmp_path / "p.json") == prof
    del doc["host"]
    for device, bound in (("cpu", True), ("cuda (V100-class, rescaled)", False), (None, True)):
        doc["meta"] = {} if device is None else {"device": device}
        old = parse_profile(doc, "old.json")
        assert old.host == HostCost.default(device)
        assert old.host.defaulted and old.host.launch_bound is bound
        assert dataclasses.asdict(old.host) | {"launch_bound": bound} == {
            **DEFAULT_HOST_US, "launch_bound": bound, "method": old.host.method, "defaulted": True}
        # the defaults are not written back: the file and its digest stay as they were
        assert dump_profile(old) == doc
        pb = Problem.from_profile(old)
        assert pb.host_line(Runner.RUNTIME) == HostLine(DEFAULT_HOST_US["runtime_tensor_us"] / 1e3,
                                                        DEFAULT_HOST_US["runtime_block_us"] / 1e3)
        assert pb.host_line("ddp") == HostLine(DEFAULT_HOST_US["ddp_tensor_us"] / 1e3,
                                               DEFAULT_HOST_US["ddp_bucket_us"] / 1e3)
        assert pb.host_hidden is not bound


def test_shipped_profiles_keep_their_bytes_and_get_the_defaults(tmp_path):
    for name in ("resnet50", "gpt2"):
        path = f"profiles/{name}.json"
        prof = load_profile(path)
        assert prof.host is not None and prof.host.defaulted and not prof.host.launch_bound
        save_profile(prof, tmp_path / "p.json")
        assert (tmp_path / "p.json").read_bytes() == open(path, "rb").read()


@pytest.mark.parametrize("host, expected", [
    ({"launch_bound": "yes"}, "p.json: host.launch_bound: expected true or false, got 'yes'"),
    ({"runtime_block_us": -1}, "p.json: host.runtime_block_us: expected a number in [0, 1000000], got -1"),
    ({"ddp_tensor_us": "7"}, "p.json: host.ddp_tensor_us: expected a number in [0, 1000000], got '7'"),
    ({"ddp_bucket_us": None}, "p.json: host.ddp_bucket_us: expected a number in [0, 1000000], got None"),
])
def test_a_malformed_section_is_one_line_naming_the_field(host, expected):
    doc = dump_profile(many_small())
    doc["host"].update(host)
    with pytest.raises(FormatError) as e:
        parse_profile(doc, "p.json")
    assert str(e.value) == expected


def test_a_missing_field_and_a_section_of_the_wrong_type_are_one_line():
    doc = dump_profile(many_small())
    del doc["host"]["runtime_tensor_us"]
    with pytest.raises(FormatError, match=r"^p.json: host.runtime_tensor_us: expected a value "
                                          r"\(field is missing\)$"):
        parse_profile(doc, "p.json")
    doc["host"] = [1, 2]
    with pytest.raises(FormatError, match=r"^p.json: host: expected an object, got 'list'$"):
        parse_profile(doc, "p.json")


# --------------------------------------------------------------------------------------------
# The model: hand-computed, the scorer against the simulator, the bound
# --------------------------------------------------------------------------------------------


def test_hand_computed_host_cost_on_the_critical_path_and_hidden():
    # three tensors ready at 1, 2, 3 ms (backward 3 ms), forward 3 ms, 10 elements each;
    # 0.1 ms per tensor and 0.5 ms per block on the runtime, 0.05 and 0.2 on DDP
    prof = dataclasses.replace(chain_profile([10, 10, 10], 3.0, 3.0, alpha_ms=1.0, algbw_gbs=1e5,
                                             compute=[1, 1, 1]),
                               host=HostCost(100.0, 500.0, 50.0, 200.0, True))
    pb = Problem.from_profile(prof)
    lay = pb.layout()
    one = [Block(0, 0, 30)]
    each = [lay.whole(i) for i in pb.ready_order()]
    # one block: issued at 3 + 3 x 0.1 + 0.5 = 3.8, 1 ms on the wire, then the 3 ms forward
    assert evaluate(pb, lay, one, "fence") == pytest.approx(3.8 + 1.0 + 3.0)
    assert evaluate(pb, lay, one, "fence", Runner.DDP) == pytest.approx(3 + 0.15 + 0.2 + 1 + 3)
    # a block per tensor: released at 1 + 0.1 + 0.5, 2 + 0.2 + 1.0, 3 + 0.3 + 1.5
    assert evaluate(pb, lay, each, "fence") == pytest.approx(4.8 + 1 + 3)
    tl = simulate_blocks(pb, lay, each, "fence")
    assert [round(b.start_ms, 9) for b in tl.blocks] == [1.6, 3.2, 4.8]
    assert tl.backward_ms == pytest.approx(3 + 0.3 + 1.5) and tl.meta["host_ms"] == pytest.approx(1.8)
    # the host ahead of the device (CUDA, not launch-bound): only what exceeds compute counts
    hidden = Problem.from_profile(dataclasses.replace(prof, host=dataclasses.replace(
        prof.host, launch_bound=False)))
    assert evaluate(hidden, lay, one, "fence") == pytest.approx(3 + 1 + 3)
    assert evaluate(hidden, lay, each, "fence") == pytest.approx(3 + 1 + 3)
    assert [b.start_ms for b in simulate_blocks(hidden, lay, each, "fence").blocks] == \
        pytest.approx([1.0, 2.0, 3.0])
    # the bound: every tensor's hook (the cheaper runner's, DDP) and at least one block
    assert lower_bound(pb) >= 3 + 3 * 0.05 + 0.2 + 3 - 1e-9
    # (torch DDP runs fence mode only: the bound is per runner, in the modes it runs)
    assert lower_bound(pb) <= evaluate(pb, lay, one, "fence", Runner.DDP) + 1e-9
    assert lower_bound(pb, Runner.DDP) <= evaluate(pb, lay, one, "fence", Runner.DDP) + 1e-9
    assert lower_bound(pb, Runner.RUNTIME) <= min(evaluate(pb, lay, one, "fence"),
                                                  evaluate(pb, lay, one, "overlap")) + 1e-9


host_costs = st.sampled_from([CPU_HOST, dataclasses.replace(CPU_HOST, launch_bound=False),
                              HostCost(300.0, 2000.0, 40.0, 700.0, True),
                              HostCost(300.0, 2000.0, 40.0, 700.0, False),
                              HostCost(0.0, 900.0, 0.0, 0.0, True)])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 25), cuts=st.integers(0, 30), host=host_costs,
       cpu=st.sampled_from([(0.0, 0.0), (0.3, 0.0), (0.5, 6.0)]),
       rule=st.sampled_from([UpdateRule.AVAIL, UpdateRule.GATE]))
def test_fast_scorer_equals_simulator_and_the_bound_holds_for_either_runner(seed, n, cuts, host,
                                                                            cpu, rule):
    rng = random.Random(seed)
    prof = random_profile(rng, n, dtypes=("float32", "bfloat16"))
    prof = dataclasses.replace(prof.with_comm(dataclasses.replace(
        prof.comm, cpu_ms_per_block=cpu[0], cpu_ms_per_mb=cpu[1])), host=host)
    pb = Problem.from_profile(prof, update_rule=rule)
    bare = Problem.from_profile(dataclasses.replace(prof, host=None), update_rule=rule)
    lay = pb.layout()
    blocks = random_blocks(rng, lay, cuts)
    lb = lower_bound(pb)
    per_runner = {r: lower_bound(pb, r) for r in Runner}
    for mode in ("overlap", "fence"):
        for runner in Runner:
            full = simulate_blocks(pb, lay, blocks, mode, runner).iteration_ms
            assert evaluate(pb, lay, blocks, mode, runner) == pytest.approx(full, rel=1e-12, abs=1e-9)
            if mode in RUNNER_MODES[runner]:     # torch DDP runs fence mode only
                assert lb <= per_runner[runner] + 1e-9
                assert per_runner[runner] <= full + 1e-9
            # host cost never makes an iteration of the same runner faster (torch DDP steps
            # after its last bucket, the runtime per tensor: either may be the faster one)
            assert full >= simulate_blocks(bare, lay, blocks, mode, runner).iteration_ms - 1e-9


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 40), host=host_costs,
       ratio=st.sampled_from([0.1, 1.0, 3.0]))
def test_best_is_at_most_every_plan_on_either_runner_and_the_bound_below_all(seed, n, host, ratio):
    prof = dataclasses.replace(random_profile(random.Random(seed), n, comm_ratio=ratio), host=host)
    report = compare(prof)
    pb = report.problem
    best = report.results["best"]
    for name, r in report.results.items():
        assert report.lower_bound_ms <= r.iteration_ms + 1e-9, name
        assert r.iteration_ms == pytest.approx(evaluate(pb, r.plan.layout, r.plan.blocks, r.mode,
                                                        r.plan.runner)), name
        # best is seeded with every plan and scores it on the runtime, and torch DDP's on DDP
        on_runtime = min(evaluate(pb, r.plan.layout, r.plan.blocks, m) for m in ("overlap", "fence"))
        assert best.iteration_ms <= min(on_runtime, r.iteration_ms) + 1e-9, name
    assert report.results["ddp"].plan.runner is Runner.DDP
    assert report.results["ddp-tuned"].plan.runner is Runner.DDP
    assert report.schedule("best").runner is best.plan.runner


# --------------------------------------------------------------------------------------------
# best picks few blocks where each costs the host
# --------------------------------------------------------------------------------------------


def test_best_picks_few_blocks_on_many_small_tensors(tmp_path):
    path = tmp_path / "many-small.json"
    save_profile(many_small(), path)
    prof = load_profile(path)
    assert not prof.host.defaulted
    report = compare(prof)
    best, ddp = report.results["best"], report.results["ddp"]
    n = len(prof.tensors)
    assert best.blocks <= n // 10
    # never slower than DDP's own buckets would run on the runtime: DDP's time plus the
    # difference of the two runners' host cost
    ddp_on_runtime = evaluate(report.problem, ddp.plan.layout, ddp.plan.blocks, ddp.mode)
    assert ddp_on_runtime > ddp.iteration_ms
    assert best.iteration_ms <= ddp_on_runtime + 1e-9
    # without host cost, one block per tensor looked best: what ran 2.6x slower
    free = compare(dataclasses.replace(prof, host=None)).results["best"]
    assert free.blocks == n
    assert evaluate(report.problem, free.plan.layout, free.plan.blocks, free.mode) > \
        1.3 * best.iteration_ms


def test_without_the_section_the_defaults_are_charged(tmp_path):
    doc = dump_profile(many_small())
    del doc["host"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    prof = load_profile(tmp_path / "old.json")
    assert prof.host == HostCost.default("cpu")
    report = compare(prof)
    bare = compare(dataclasses.replace(prof, host=None))
    h = DEFAULT_HOST_US
    ddp = report.results["ddp"]
    # ddp: one bucket after backward (fence), every tensor's hook and the bucket's issue on the host
    assert ddp.iteration_ms == pytest.approx(
        bare.results["ddp"].iteration_ms + (len(prof.tensors) * h["ddp_tensor_us"] + h["ddp_bucket_us"]) / 1e3)
    assert report.results["best"].blocks <= len(prof.tensors) // 10
    assert report.lower_bound_ms > bare.lower_bound_ms


def test_simulate_charges_the_runner_of_the_schedule():
    prof = many_small()
    report = compare(prof)
    for name in ("ddp", "ddp-tuned", "wfbp", "best"):
        sched = report.schedule(name)
        assert simulate(prof, sched).iteration_ms == pytest.approx(report.results[name].iteration_ms)
    ddp = report.schedule("ddp")
    assert simulate(prof, ddp, runner="runtime").iteration_ms > simulate(prof, ddp).iteration_ms


# --------------------------------------------------------------------------------------------
# One rank: compute plus host cost
# --------------------------------------------------------------------------------------------


def test_one_rank_predicts_compute_plus_host_cost_not_a_network(tmp_path):
    # a profile taken on one rank: an analytic 8-worker link, the host measured there
    prof = dataclasses.replace(
        chain_profile([250_000] * 16, 20.0, 40.0, alpha_ms=1.3, algbw_gbs=1.7857, world_size=8,
                      update_ms=[0.1] * 16),
        meta={"device": "cpu", "world_size": 1}, host=CPU_HOST)
    save_profile(prof, tmp_path / "one.json")
    prof = load_profile(tmp_path / "one.json")
    report, _ = plan_reports(prof, ["ddp", "best"], world_size=1)
    h, n = CPU_HOST, len(prof.tensors)
    ddp = report.results["ddp"]
    compute = prof.forward_ms + prof.backward_ms + sum(t.update_ms for t in prof.tensors)
    host = (n * h.ddp_tensor_us + ddp.blocks * h.ddp_bucket_us) / 1e3
    assert ddp.mode == "fence"
    # (the last bucket's all-reduce on one rank: 16 MB at the format's largest bandwidth, 0.16 µs)
    assert ddp.iteration_ms == pytest.approx(compute + host, abs=1e-3)
    best = report.results["best"]
    # on one rank nothing is won: best is torch DDP (the lower host cost) with one bucket
    assert best.plan.runner is Runner.DDP and best.iteration_ms <= ddp.iteration_ms
    assert best.iteration_ms >= prof.forward_ms + prof.backward_ms + (
        n * h.ddp_tensor_us + h.ddp_bucket_us) / 1e3 - 1e-6
    assert best.iteration_ms == pytest.approx(
        evaluate(report.problem, best.plan.layout, best.plan.blocks, "fence", Runner.DDP))
    # not the 8-worker link the profile assumes
    eight, _ = plan_reports(prof, ["ddp", "best"], world_size=8)
    assert eight.results["ddp"].iteration_ms > ddp.iteration_ms + 5
    assert bench_profile(prof, 1).comm.world_size == 1 and bench_profile(prof, 2) is prof


def test_one_rank_says_so_in_one_line(tmp_path, capsys):
    from usbyte_opt.cli.bench import render

    raw = {
        "job": {"model": "mlp", "iterations": 3, "rounds": 1},
        "profile": str(tmp_path / "missing.json"), "profile_name": "toy", "world_size": 1,
        "backend": "gloo", "device": "cpu", "threads": 1, "torch": "x", "batch_size": 4,
        "forward_ms": 30.0, "backward_ms": 50.0,
        "comm": {"backend": "analytic", "alpha_ms": 1.3, "algbw_gbs": 1.7857},
        "gradient_bytes": 1_000_000,
        "planned": {"lower_bound_ms": 80.0, "compute_ms": 80.0, "update_ms": 2.0, "all": {},
                    "predicted": {"ddp": {"ms": 82.1, "refined_ms": 82.1, "mode": "fence", "blocks": 1}}},
        "schedules": {}, "traces": {},
        "runs": {"ddp": {"durations_ms": [83.0, 84.0], "final_loss": 1.0, "max_param_diff": 0.0,
                         "state_bytes_by_rank": [4_000_000]}},
        "phases_s": {"profile": 1.0, "plan": 0.1, "train": 2.0}, "reference": "ddp",
    }
    res = summarize(raw, {"kind": "loopback", "short": "loopback", "description": "lo"}, tmp_path)
    assert res["single_rank"] == SINGLE_RANK_NOTE and res["host"] is None
    md = markdown(res)
    assert md.count(SINGLE_RANK_NOTE) == 1 and "alpha 1.300" not in md
    render(res, "bench")
    out, err = capsys.readouterr()
    assert err.count(SINGLE_RANK_NOTE) == 1 and "no communication (one rank)" in out
    assert "alpha" not in out
    two = summarize({**raw, "world_size": 2}, {"kind": "x", "short": "x", "description": "x"}, tmp_path)
    assert two["single_rank"] is None and SINGLE_RANK_NOTE not in markdown(two)
