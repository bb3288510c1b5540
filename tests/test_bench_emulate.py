"""``usbyte-opt bench --emulate``: one rank whose collectives occupy an emulated link.

One short run (mlp, batch 4, a link slow enough that communication dominates) checks what must
hold on any machine: the job trains at world size 1, DDP and ``best`` train to the same
parameters, the result names the link, the predictions are the link's (DDP's predicted time is
the compute plus most of its buckets' link time), and every measured iteration is at least
the link time of its blocks (the emulated channel is never early). The option errors are one
line and exit code 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from usbyte_opt.bench import EMULATED, emulate_left_out, emulated_profile
from usbyte_opt.collectives.emulate import comm_spec, parse_emulate
from usbyte_opt.formats import load_profile, load_schedule

REPO = Path(__file__).resolve().parents[1]
LINK = "8x1gbit@50us"


def cli(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "usbyte_opt", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_the_link_line_is_the_links_cost():
    spec = parse_emulate(LINK)
    c = comm_spec(spec)
    for nbytes in (4096, 1e6, 25e6):
        assert c.alpha_ms + nbytes / (c.algbw_gbs * 1e6) == pytest.approx(spec.allreduce_s(nbytes) * 1e3)
        rs = c.reduce_scatter
        assert rs is not None
        assert rs.alpha_ms + nbytes / (rs.algbw_gbs * 1e6) == pytest.approx(spec.reduce_scatter_s(nbytes) * 1e3)
    assert c.world_size == 8


def test_sharded_fsdp2_and_auto_are_left_out_with_a_note_each():
    kept, notes = emulate_left_out(["ddp", "best", "best-sharded", "fsdp2", "auto", "no-comm"])
    assert kept == ["ddp", "best", "no-comm"]
    assert len(notes) == 3 and all("left out under --emulate" in n for n in notes)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("emu") / "b"
    p = cli("bench", "mlp", "--nproc-per-node", "1", "--device", "cpu", "--emulate", LINK,
            "--batch-size", "4", "--iterations", "2", "--rounds", "2", "--max-rounds", "2",
            "--strategies", "ddp,best", "--no-reference", "--json", "--output-dir", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout), out


@pytest.mark.slow   # a bench run on the emulated link, about 45 s; test_emulate covers the link
def test_emulated_bench_trains_one_rank_equal_to_ddp_and_says_the_link(emulated):
    res, out = emulated
    assert res["world_size"] == 1 and res["single_rank"] is None
    assert [r["strategy"] for r in res["runs"]] == ["ddp", "best"]
    assert res["correct"] is True, [(r["strategy"], r["max_param_diff"]) for r in res["runs"]]
    net = res["network"]
    assert net["kind"] == "emulated" and net["link"]["spec"] == LINK and net["link"]["ranks"] == 8
    assert net["description"].startswith("emulated link: 8 ranks at 1 Gbit/s, alpha 50 µs")
    assert res["emulated"] == LINK
    assert res["emulated_link"]["collectives"] > 0 and res["emulated_link"]["busy_s"] > 0
    assert "emulated link" in (out / "report.md").read_text()
    # The profile the ranks planned with: this rank's compute, the link's communication.
    prof = load_profile(out / "profile.json")
    assert prof.meta[EMULATED] == LINK and prof.comm.world_size == 8
    assert prof.comm.alpha_ms == pytest.approx(0.05)
    # Its host cost was measured with every collective going through the link's submission,
    # as the run pays it (a GPU run of 284 small blocks paid far more per block than a probe
    # without the link had measured).
    assert prof.host is not None and "through an emulated link of 8 ranks" in prof.host.method


@pytest.mark.slow   # a bench run on the emulated link, about 45 s; test_emulate covers the link
def test_predictions_and_measurements_carry_the_links_time(emulated):
    res, out = emulated
    spec = parse_emulate(LINK)
    by = {r["strategy"]: r for r in res["runs"]}
    compute = res["forward_ms"] + res["backward_ms"] + res["update_ms"]
    for s in ("ddp", "best"):
        sched = load_schedule(out / "schedules" / f"{s}.json")
        item = [torch.empty(0, dtype=getattr(torch, b.dtype)).element_size() for b in sched.buffers]
        link_ms = sum(spec.allreduce_s((b.end - b.start) * item[b.buffer]) for b in sched.blocks) * 1e3
        # The link is serial and carries every block after the forward: no prediction is
        # below the forward plus the link time, none above the compute plus the link time.
        pred = by[s]["predicted_ms"]
        assert pred >= 0.99 * (res["forward_ms"] + link_ms), (s, pred, res["forward_ms"], link_ms)
        assert pred < compute + link_ms + 5.0 * len(sched.blocks) + 5.0, (s, pred, compute, link_ms)
        if s == "ddp":   # torch DDP steps after its last bucket: the update is never hidden
            assert pred >= 0.99 * (res["forward_ms"] + link_ms + res["update_ms"])
        # The channel carries every block of every iteration, one after another: an iteration
        # cannot take less than its link time.
        assert by[s]["measured_ms"] > 0.95 * link_ms
    prof = load_profile(out / "profile.json")
    assert res["lower_bound_ms"] >= (prof.comm.alpha_ms
                                     + res["gradient_bytes"] / (prof.comm.algbw_gbs * 1e6)) * 0.99


def test_emulated_profile_keeps_compute_and_host():
    from usbyte_opt.planning.synthetic import chain_profile

    p = chain_profile([1000, 2000])
    e = emulated_profile(p, parse_emulate(LINK))
    assert e.tensors == p.tensors and e.host == p.host and e.forward_ms == p.forward_ms
    assert e.meta[EMULATED] == LINK and EMULATED not in p.meta


@pytest.mark.parametrize("argv, words", [
    (["--emulate", "8x1GB"], "--emulate '8x1GB': expected RANKSxRATE"),
    (["--emulate", "1x1gbit"], "expected at least 2 ranks"),
    (["--emulate", "8x1gbit@fast"], "--emulate '8x1gbit@fast'"),
    (["--emulate", "8x1gbit", "--nproc-per-node", "2"], "use --nproc-per-node 1, not 2"),
    (["--emulate", "8x1gbit", "--bandwidth", "200mbit"], "leave out --bandwidth"),
    (["--emulate", "8x1gbit", "--nodes", "2"], "leave out --nodes"),
])
def test_bad_emulate_is_one_line_and_exit_2(tmp_path, capsys, argv, words):
    from usbyte_opt.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "lab-cnn", "--nproc-per-node", "1", *argv, "-o", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
