"""The plan picks its runner: the schedule format's ``runner``, best over both runners, the
bound per runner and mode, and what ``optimize`` says about it (docs/planner.md, "Host cost")."""

import copy
import dataclasses
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from usbyte_opt.errors import FormatError
from usbyte_opt.formats import (
    HostCost,
    Runner,
    dump_schedule,
    load_profile,
    load_schedule,
    parse_schedule,
    save_profile,
    save_schedule,
    schedule_schema,
)
from usbyte_opt.planning.bounds import lower_bound
from usbyte_opt.planning.ddp import MIB, bucket_caps_mb, expressible
from usbyte_opt.planning.fastsim import evaluate
from usbyte_opt.planning.planner import compare
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.simulate import simulate
from usbyte_opt.planning.synthetic import chain_profile, random_profile

CPU = HostCost(10.5, 34.0, 7.4, 22.1, True, "test")
#: one rank, many small tensors: nothing to win, so torch DDP's lower host cost wins
MANY_SMALL = dataclasses.replace(
    chain_profile([2000] * 200, 5.0, 10.0, alpha_ms=0.05, algbw_gbs=5.0, world_size=1,
                  update_ms=[0.001] * 200), host=CPU)


def _ddp_report():
    report = compare(MANY_SMALL, strategies=["wfbp", "ddp", "ddp-tuned", "mgwfbp", "best"])
    assert report.results["best"].plan.runner is Runner.DDP
    return report


# --------------------------------------------------------------------------------------------
# The format
# --------------------------------------------------------------------------------------------


def test_a_ddp_runner_schedule_round_trips_with_its_bucket_list(tmp_path):
    report = _ddp_report()
    sched = report.schedule("best")
    assert sched.runner is Runner.DDP and sched.mode == "fence"
    save_schedule(sched, tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["runner"] == "ddp"
    caps = doc["bucket_cap_mb_list"]
    assert caps == sched.bucket_cap_mb_list() == bucket_caps_mb(sched)
    back = load_schedule(tmp_path / "s.json")
    assert back.runner is Runner.DDP and back.digest() == sched.digest()
    # DDP reads each cap as int(cap * MiB) bytes: one less than its bucket's bytes
    lay = report.results["best"].plan.layout
    sizes = [(k.end - k.start) * lay.itemsize[0] for k in sched.blocks]
    assert [int(c * MIB) for c in caps] == [b - 1 for b in sizes]
    # the digest says which runner every rank agreed on
    assert dataclasses.replace(sched, runner=Runner.RUNTIME).digest() != sched.digest()


def test_files_without_the_field_are_the_runtimes_and_are_written_as_before():
    sched = load_schedule("schedules/resnet50.json")
    assert sched.runner is Runner.RUNTIME
    assert "runner" not in dump_schedule(sched) and "bucket_cap_mb_list" not in dump_schedule(sched)
    assert schedule_schema()["properties"]["runner"]["enum"] == ["runtime", "ddp"]


def _doc():
    return dump_schedule(_ddp_report().schedule("best"))


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(runner="torch"), r"^s\.json: runner: expected one of runtime\|ddp, got 'torch'$"),
    (lambda d: d.update(mode="overlap"),
     r"^s\.json: runner: expected \"runtime\" in overlap mode \(torch DDP steps after its last "
     r"bucket: fence mode only\), got 'ddp'$"),
    (lambda d: d["blocks"].reverse(), r"^s\.json: blocks\[0\]: expected a block starting at element 0 "),
    (lambda d: _cut_first(d), r"^s\.json: blocks\[0\]: expected whole tensors \(DDP cannot cut a "
                              r"tensor\), got \[0, \d+\) which cuts one$"),
    (lambda d: d.pop("shapes"), r"^s\.json: shapes: expected the per-tensor shapes"),
    (lambda d: d["bucket_cap_mb_list"].append(1.0), r"^s\.json: bucket_cap_mb_list: expected one cap "
                                                    r"per block \(\d+\), got \d+ caps$"),
    (lambda d: d["bucket_cap_mb_list"].__setitem__(0, 1e-6),
     r"^s\.json: bucket_cap_mb_list\[0\]: expected a cap that closes block 0 after its last tensor"),
    (lambda d: d.update(runner="runtime"), r"^s\.json: bucket_cap_mb_list: expected no bucket list "
                                           r"unless runner is \"ddp\" \(runner \"runtime\"\)$"),
])
def test_a_schedule_ddp_cannot_express_is_refused_in_one_line(change, message):
    doc = _doc()
    assert len(doc["blocks"]) >= 2
    change(doc)
    with pytest.raises(FormatError, match=message) as e:
        parse_schedule(doc, "s.json")
    assert "\n" not in str(e.value)


def _cut_first(d):
    """The first block ends one element into the next tensor (and the second starts there)."""
    b0, b1 = d["blocks"][0], d["blocks"][1]
    b0["end"] += 1
    b1["start"] += 1


def test_a_buffer_of_each_dtype_cannot_name_ddp():
    prof = dataclasses.replace(random_profile(random.Random(3), 12, dtypes=("float32", "bfloat16")),
                               host=CPU)
    report = compare(prof, strategies=["ddp", "best"])
    sched = report.schedule("ddp")              # DDP's own buckets, but two buffers
    assert len(sched.buffers) == 2 and sched.runner is Runner.RUNTIME
    doc = dump_schedule(sched)
    doc["runner"], doc["mode"] = "ddp", "fence"
    with pytest.raises(FormatError, match=r"^s\.json: runner: expected \"runtime\" with 2 buffers"):
        parse_schedule(doc, "s.json")


def test_simulate_charges_the_schedules_runner(tmp_path):
    report = _ddp_report()
    save_profile(MANY_SMALL, tmp_path / "p.json")
    save_schedule(report.schedule("best"), tmp_path / "s.json")
    got = simulate(load_profile(tmp_path / "p.json"), load_schedule(tmp_path / "s.json"))
    assert got.iteration_ms == pytest.approx(report.results["best"].iteration_ms)


# --------------------------------------------------------------------------------------------
# best over both runners, and the bound per runner and mode
# --------------------------------------------------------------------------------------------

hosts = st.sampled_from([None, CPU, dataclasses.replace(CPU, launch_bound=False),
                         HostCost(300.0, 2000.0, 40.0, 700.0, True, "test"),
                         HostCost(5.0, 10.0, 40.0, 700.0, True, "test")])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 30), host=hosts,
       ratio=st.sampled_from([0.05, 0.5, 2.0]), world=st.sampled_from([1, 8]),
       cpu=st.sampled_from([(0.0, 0.0), (0.3, 4.0)]), dtypes=st.sampled_from([1, 2]))
def test_best_is_never_predicted_slower_than_any_row_and_the_bound_holds(seed, n, host, ratio, world,
                                                                         cpu, dtypes):
    rng = random.Random(seed)
    prof = random_profile(rng, n, comm_ratio=ratio, dtypes=("float32", "bfloat16")[:dtypes])
    prof = prof.with_comm(dataclasses.replace(prof.comm, world_size=world,
                                              cpu_ms_per_block=cpu[0], cpu_ms_per_mb=cpu[1]))
    prof = dataclasses.replace(prof, host=host)
    report = compare(prof, options={"best": {"time_budget_s": 0.05}})
    best = report.results["best"]
    several = len(report.problem.layout().buffers) > 1
    for name, r in report.results.items():
        if not (several and name == "ddp"):   # DDP's own buckets of several dtypes: no bucket list
            assert best.iteration_ms <= r.iteration_ms * (1 + 1e-12) + 1e-9, name
        assert report.lower_bound_ms <= r.iteration_ms + 1e-9, name
    # best's runner is what the schedule says, and it can run it
    sched = report.schedule("best")
    assert sched.runner is best.plan.runner
    if best.plan.runner is Runner.DDP:
        assert best.mode == "fence" and len(sched.bucket_cap_mb_list()) == best.blocks
        assert expressible(report.problem, best.plan.layout, best.plan.blocks, ties=False)
    assert evaluate(report.problem, best.plan.layout, best.plan.blocks, best.mode,
                    best.plan.runner) == pytest.approx(best.iteration_ms)


def test_the_bound_is_per_runner_and_mode():
    # torch DDP's host cost is lower but it runs fence mode only: where overlap wins, the
    # bound is the runtime's, above what DDP's host floor in overlap mode would allow
    prof = dataclasses.replace(chain_profile([2_500_000] * 20, 20.0, 40.0, alpha_ms=0.5,
                                             algbw_gbs=1.0), host=CPU)
    pb = Problem.from_profile(prof)
    rt, ddp, both = lower_bound(pb, "runtime"), lower_bound(pb, "ddp"), lower_bound(pb)
    assert both == min(rt, ddp) and ddp > rt
    floor_only = lower_bound(pb.host_floor())     # the cheaper runner's floor in every mode
    assert floor_only < both
    report = compare(prof)
    assert report.lower_bound_ms == both <= report.results["best"].iteration_ms


# --------------------------------------------------------------------------------------------
# optimize: the caption, the caps, the warning
# --------------------------------------------------------------------------------------------


def test_optimize_writes_and_shows_a_ddp_runner_plan(tmp_path, capsys):
    from usbyte_opt.cli.main import main

    save_profile(MANY_SMALL, tmp_path / "p.json")
    code = None
    try:
        main(["optimize", str(tmp_path / "p.json"), "-o", str(tmp_path / "s.json"), "--json"])
    except SystemExit as e:
        code = e.code
    assert code in (None, 0)
    doc = json.loads(capsys.readouterr().out)
    assert doc["chosen"] == "best" and doc["runner"] == "ddp"
    assert doc["strategies"]["best"]["runner"] == "ddp"
    assert doc["bucket_cap_mb_list"] == load_schedule(tmp_path / "s.json").bucket_cap_mb_list()
    ddp = doc["strategies"]["ddp"]["iteration_ms"]
    for v in doc["strategies"].values():
        assert v["speedup_vs_ddp"] == pytest.approx(ddp / v["iteration_ms"])


def test_optimize_warns_once_when_the_written_plan_is_slower_than_any_row(tmp_path, capsys):
    from usbyte_opt.cli.main import main

    save_profile(MANY_SMALL, tmp_path / "p.json")
    try:
        main(["optimize", str(tmp_path / "p.json"), "-o", str(tmp_path / "s.json"), "--strategy", "wfbp"])
    except SystemExit as e:
        assert e.code in (None, 0)
    out = capsys.readouterr()
    text = out.out + out.err
    warns = [ln for ln in text.splitlines() if ln.startswith("warning: wfbp is predicted slower than")]
    assert len(warns) == 1 and "--strategy best" in warns[0]
    assert "speedup over ddp" in text and ">1 is faster" in " ".join(text.split())
    capsys.readouterr()
    try:
        main(["optimize", str(tmp_path / "p.json"), "-o", str(tmp_path / "b.json"), "--force"])
    except SystemExit as e:
        assert e.code in (None, 0)
    out = capsys.readouterr()
    assert "warning:" not in out.out + out.err
    assert "run by torch DDP's reducer" in " ".join((out.out + out.err).split())


def test_best_held_to_overlap_mode_says_so_not_a_planner_fault(tmp_path, capsys):
    """``--mode overlap`` where torch DDP's fence wins: best is slower than ddp by the user's
    choice of mode, and the warning says that (it used to call it a planner fault)."""
    from usbyte_opt.cli.main import main

    save_profile(MANY_SMALL, tmp_path / "p.json")
    try:
        main(["optimize", str(tmp_path / "p.json"), "-o", str(tmp_path / "s.json"), "--mode", "overlap"])
    except SystemExit as e:
        assert e.code in (None, 0)
    out = capsys.readouterr()
    warns = [ln for ln in " ".join((out.out + out.err).split()).split("warning: ")[1:]]
    assert len(warns) == 1 and warns[0].startswith("best is predicted slower than ddp")
    assert "--mode overlap plans best in overlap mode only" in warns[0]
    assert "planner fault" not in warns[0]
    assert load_schedule(tmp_path / "s.json").mode == "overlap"


def test_old_style_doc_copy_is_not_mutated():
    doc = _doc()
    before = copy.deepcopy(doc)
    parse_schedule(doc, "s.json")
    assert doc == before
