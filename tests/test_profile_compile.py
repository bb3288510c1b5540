"""``profile --compile``: the model timed as ``torch.compile`` trains it, its graphs split
where each tensor is first used (as the runtime splits them at the plan's blocks), so the
gradients' ready times spread over the compiled backward instead of all landing at its end."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from usbyte_opt.formats import load_profile, save_profile
from usbyte_opt.profiler.options import ProfileOptions
from usbyte_opt.profiler.run import profile_model


def test_compiled_profile_has_the_split_backwards_ready_times(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # cut_probe_s=0: the first cut place is timed, then the cap stops the others.
        p = profile_model("mlp", 32, ProfileOptions(warmup=1, repeats=3, compile="aot_eager",
                                                    host_probe=False, cut_probe_s=0.0))
    meta = p.meta["compile"]
    assert meta["backend"] == "aot_eager" and meta["graphs"] >= 1
    assert meta["pieces"] >= 4, meta                  # 4 Linear layers: one piece each
    names = [t.name for t in p.tensors]
    assert names[0] == "0.weight" and not any("_orig_mod" in n for n in names), names
    # The last layer's gradients are ready well before the first layer's (not all at the end).
    by = {t.name: t for t in p.tensors}
    first, last = by["0.weight"].ready_ms, by[names[-1]].ready_ms
    assert last < first and first <= p.backward_ms, (first, last, p.backward_ms)
    assert len({round(t.ready_ms / p.backward_ms, 2) for t in p.tensors}) >= 3
    assert all(0 <= t.need_ms <= p.forward_ms for t in p.tensors)
    # Need times from the split forward's gates (each layer's piece reached in turn).
    assert meta["need_ms"].startswith("8 of 8 tensors: the split forward's gate"), meta
    needs = [by[n].need_ms for n in names]
    assert needs == sorted(needs) and needs[0] < needs[-1], needs
    # A cut between layers timed on its own (a copy compiled with that one cut beside one
    # compiled whole): what the planner charges a plan's pieces. Three places, the time cap
    # let one run, and says so; the others cost its median.
    assert meta["cut_candidates"] == 3 and list(meta["cuts"]) == ["2.weight"], meta
    assert meta["cuts"]["2.weight"] >= 0 and meta["cut_default_ms"] == meta["cuts"]["2.weight"]
    assert any("1 of 3 cut places timed within the 0 s cap" in str(w.message) for w in caught)
    save_profile(p, tmp_path / "c.json")               # a valid profile, read back
    back = load_profile(tmp_path / "c.json")
    assert back.meta["compile"]["pieces"] == meta["pieces"]
    from usbyte_opt.planning.problem import Problem

    assert Problem.from_profile(back).compiled


@pytest.mark.slow
def test_bench_compile_trains_every_strategy_compiled_and_equal(tmp_path):
    """``bench --compile``: torch DDP and best compiled (one rank, an emulated link), training
    equal, best's graphs split at its plan (about a minute)."""
    p = subprocess.run([sys.executable, "-m", "usbyte_opt", "bench", "lab-cnn", "-n", "1",
                        "--emulate", "8x1gbit", "-s", "ddp,best", "--iterations", "3",
                        "--rounds", "2", "--max-rounds", "2", "--compile", "aot_eager",
                        "-o", str(tmp_path / "out"), "--json"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["correct"] and r["compile"]["backend"] == "aot_eager", r.get("compile")
    # Split at the plan (as many pieces as its issue order lets gradients leave early: one
    # where its first block holds the first layer's tensors, ready last), gates in place.
    best = r["compile"]["split"]["best"]
    assert best["graphs"] >= 1 and best["pieces"] >= 1 and best["gated"], best
    assert not best["unsplit"] and not best["graph_break"], best
    # The profile timed the cuts; best's schedule says where its graph is cut.
    prof = json.loads((tmp_path / "out" / "profile.json").read_text())
    comp = prof["meta"]["compile"]
    assert len(comp["cuts"]) == comp["cut_candidates"] == 7, comp     # lab-cnn: every place
    sched = json.loads((tmp_path / "out" / "schedules" / "best.json").read_text())
    if sched.get("runner", "runtime") == "runtime":
        # The planner's model of the split (pieces in forward order) is the runtime's split.
        from usbyte_opt.formats import load_schedule
        from usbyte_opt.planning.compiled import block_membership, merged_pieces, plan_pieces, segments
        from usbyte_opt.planning.problem import Problem

        pb = Problem.from_profile(load_profile(tmp_path / "out" / "profile.json"))
        s = load_schedule(tmp_path / "out" / "schedules" / "best.json")
        assert s.cut_pieces is not None, sched
        groups = merged_pieces(plan_pieces(*block_membership(pb.layout(s.buffers), s.blocks)),
                               s.cut_pieces)
        assert max(segments(pb, groups)) + 1 == best["pieces"], (s.cut_pieces, best)
