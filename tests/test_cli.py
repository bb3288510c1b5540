"""The optimize / simulate / schema commands, driven in-process and as a real subprocess."""

import json
import random
import subprocess
import sys

import pytest
from helpers import run_cli

from usbyte_opt.formats import load_schedule, save_profile
from usbyte_opt.planning.synthetic import random_profile


@pytest.fixture
def profile(tmp_path):
    p = tmp_path / "rand.json"
    save_profile(random_profile(random.Random(3), 30, name="rand"), p)
    return p


def test_optimize_writes_default_path_and_prints_table(capsys, profile, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "optimize", str(profile))
    assert code == 0
    for name in ("wfbp", "ddp", "mgwfbp", "bytescheduler", "usbyte", "best"):
        assert name in out
    assert "lower bound" in out
    sched = load_schedule(tmp_path / "schedules" / "rand.json")
    assert sched.strategy == "best"
    assert set(sched.predicted["baselines"]) >= {"wfbp", "ddp", "usbyte"}


def test_optimize_json_is_pure_json(capsys, profile, tmp_path):
    out_path = tmp_path / "s.json"
    code, out, _ = run_cli(capsys, "optimize", str(profile), "-o", str(out_path), "--json",
                           "--strategy", "usbyte", "--world-size", "16", "--bandwidth-gbps", "25")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) >= {"strategies", "lower_bound_ms", "chosen", "output"}
    assert doc["chosen"] == "usbyte" and doc["output"] == str(out_path)
    assert doc["world_size"] == 16
    for r in doc["strategies"].values():
        assert set(r) >= {"iteration_ms", "overlap_ms", "blocks", "solve_s"}
        assert doc["strategies"]["best"]["overlap_ms"] <= r["iteration_ms"] + 1e-9
    assert load_schedule(out_path).world_size == 16


def test_optimize_on_several_nodes(capsys, profile, tmp_path):
    """A one-node profile moved to 4 nodes of 8: best-flat beside the flat strategies, best's
    hierarchical blocks counted; the schedule records them and simulates to its prediction."""
    out_path = tmp_path / "s.json"
    nodes = ["--nodes", "4", "--ranks-per-node", "8", "--intra-gbps", "800", "--inter-gbps", "10",
             "--inter-latency-us", "20"]
    code, out, err = run_cli(capsys, "optimize", str(profile), "-o", str(out_path), "--json", *nodes)
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["world_size"], doc["nodes"], doc["ranks_per_node"]) == (32, 4, 8)
    st = doc["strategies"]
    assert list(st)[-2:] == ["best-flat", "best"]
    assert st["best"]["iteration_ms"] <= st["best-flat"]["iteration_ms"] + 1e-9
    assert st["best-flat"]["iteration_ms"] <= st["ddp"]["iteration_ms"] + 1e-9
    assert st["ddp"]["blocks_hier"] == 0 and st["best"]["blocks_hier"] > 0
    sched = load_schedule(out_path)
    assert sched.nodes == 4 and sched.hierarchical
    code, out, err = run_cli(capsys, "simulate", str(profile), str(out_path), "--json", *nodes)
    assert json.loads(out)["iteration_ms"] == pytest.approx(doc["strategies"]["best"]["iteration_ms"])
    assert "warning" not in err
    # on the one-node profile it was retargeted from: said, once
    code, out, err = run_cli(capsys, "simulate", str(profile), str(out_path), "--json")
    warned = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert code == 0 and len(warned) == 1 and "costed as flat" in warned[0], err
    code, out, _ = run_cli(capsys, "optimize", str(profile), "-o", str(out_path), *nodes)
    assert code == 0 and "hier/blocks" in out and "best-flat" in out
    code, out, _ = run_cli(capsys, "optimize", str(profile), "-o", str(out_path), "--json",
                           "--hierarchy", "off", *nodes)
    assert "best-flat" not in json.loads(out)["strategies"]
    assert not load_schedule(out_path).hierarchical


def test_a_larger_world_on_one_node_warns_once(capsys, profile, tmp_path):
    code, _, err = run_cli(capsys, "optimize", str(profile), "-o", str(tmp_path / "s.json"),
                           "--json", "--world-size", "16")
    assert code == 0
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "--nodes" in warnings[0] and "--inter-gbps" in warnings[0]


def test_simulate_and_trace(capsys, profile, tmp_path):
    sched, trace = tmp_path / "s.json", tmp_path / "t.json"
    run_cli(capsys, "optimize", str(profile), "-o", str(sched), "--json")
    code, out, _ = run_cli(capsys, "simulate", str(profile), str(sched), "--json", "--trace", str(trace))
    assert code == 0
    doc = json.loads(out)
    assert doc["iteration_ms"] == pytest.approx(doc["schedule_predicted_ms"])
    assert doc["lower_bound_ms"] <= doc["iteration_ms"]
    assert json.loads(trace.read_text())["traceEvents"]
    code, out, _ = run_cli(capsys, "simulate", str(profile), str(sched), "--mode", "fence", "--json")
    assert json.loads(out)["iteration_ms"] >= doc["iteration_ms"] - 1e-9
    code, out, _ = run_cli(capsys, "simulate", str(profile), str(sched))
    assert "iteration" in out and code == 0


def test_schema(capsys):
    code, out, _ = run_cli(capsys, "schema", "schedule")
    assert code == 0 and json.loads(out)["title"] == "usbyte-opt schedule"


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t[: len(t) // 2], "expected valid JSON"),
    (lambda t: t.replace('"forward_ms": ', '"forward_ms": "x", "_": ', 1), "forward_ms: expected"),
    (lambda t: t.replace('"ready_ms": ', '"ready_ms": -', 1), "ready_ms: expected a number in [0"),
    (lambda t: t.replace('"name": "layer1.weight"', '"name": "layer0.weight"'), "a unique name"),
])
def test_bad_profile_is_one_line_and_writes_nothing(capsys, profile, tmp_path, edit, expected):
    profile.write_text(edit(profile.read_text()))
    out_path = tmp_path / "never.json"
    code, out, err = run_cli(capsys, "optimize", str(profile), "-o", str(out_path))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err
    assert str(profile) in err and "Traceback" not in err
    assert not out_path.exists()


def test_schedule_of_another_model(capsys, profile, tmp_path):
    other = tmp_path / "other.json"
    save_profile(random_profile(random.Random(4), 12, name="other"), other)
    sched = tmp_path / "s.json"
    run_cli(capsys, "optimize", str(other), "-o", str(sched))
    code, _, err = run_cli(capsys, "simulate", str(profile), str(sched))
    assert code == 3 and err.startswith("error: ") and str(sched) in err


def test_unknown_strategy_and_bad_world_size(capsys, profile):
    code, _, err = run_cli(capsys, "optimize", str(profile), "--strategy", "nope")
    assert code == 2 and "expected one of" in err
    code, _, err = run_cli(capsys, "optimize", str(profile), "--world-size", "1")
    assert code == 2


def test_real_subprocess_and_debug_traceback(profile, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    cmd = [sys.executable, "-m", "usbyte_opt", "simulate", str(bad), str(bad)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["--debug"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" in p.stderr
    p = subprocess.run([sys.executable, "-m", "usbyte_opt", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "optimize" in p.stdout


def test_optimize_mode_fence_plans_best_in_fence_mode(capsys, profile, tmp_path):
    out_path = tmp_path / "f.json"
    code, out, _ = run_cli(capsys, "optimize", str(profile), "--mode", "fence", "-o", str(out_path))
    assert code == 0
    assert load_schedule(out_path).mode == "fence"
    code, _, err = run_cli(capsys, "optimize", str(profile), "--mode", "sideways",
                           "-o", str(tmp_path / "g.json"))
    assert code == 2 and "--mode" in err and "expected fence or overlap" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "g.json").exists()


def test_optimize_ddp_tuned_runs_with_torch_absent(profile, tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from usbyte_opt.cli.main import main\n"
            f"main(['optimize', {str(profile)!r}, '-s', 'ddp-tuned', '--json', '-o', {str(tmp_path / 't.json')!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "bucket_cap_mb_list" in json.loads(r.stdout)


# --------------------------------------------------------------------------------------------
# What a new user meets: the model a schedule was planned for, shipped files, usage errors,
# output that fits 80 columns
# --------------------------------------------------------------------------------------------


def test_schedule_records_its_model_and_a_mismatch_names_file_and_models(capsys, tmp_path):
    import dataclasses

    import torch

    from usbyte_opt.errors import MismatchError
    from usbyte_opt.models import build
    from usbyte_opt.runtime.checks import check_model, resolve_schedule
    from usbyte_opt.runtime.default_plan import model_tensors

    out = tmp_path / "x.json"
    code, _, err = run_cli(capsys, "optimize", "profiles/resnet50.json", "-o", str(out))
    assert code == 0, err
    sched = load_schedule(out)
    assert sched.model == "resnet50 (224x224 images)" and sched.path == str(out)
    cnn, _, _ = build("cnn", 1)
    for given in (str(out), sched):  # a path, or a Schedule read from that path
        s, source = resolve_schedule(given, cnn, 8)
        with pytest.raises(MismatchError) as e:
            check_model(s, model_tensors(cnn), source)
        msg = str(e.value)
        assert msg.startswith(f"{out} was planned for resnet50 (224x224 images); this model is a cnn ("), msg
        assert "tensor " in msg and "<" not in msg.split(" (")[0]
    # an old schedule without the field still loads, and the message falls back to its profile
    old = json.loads(out.read_text())
    del old["model"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    s = load_schedule(tmp_path / "old.json")
    assert s.model is None
    s2, source = resolve_schedule(dataclasses.replace(s), torch.nn.Linear(2, 2), 8)
    with pytest.raises(MismatchError,
                       match=r"old.json was planned for the profile 'resnet50'; this model is a Linear \("):
        check_model(s2, model_tensors(torch.nn.Linear(2, 2)), source)


def test_optimize_refuses_to_replace_a_shipped_schedule(capsys, tmp_path, monkeypatch):
    """In the repository itself: the default output of a shipped profile is a shipped schedule."""
    from usbyte_opt.cli.common import REPOSITORY, shipped_files

    if not shipped_files("schedules"):
        pytest.skip("not a git checkout")
    shipped = REPOSITORY / "schedules" / "resnet50.json"
    before = shipped.read_bytes()
    monkeypatch.chdir(REPOSITORY)
    code, _, err = run_cli(capsys, "optimize", "profiles/resnet50.json")
    assert code == 2 and err.count("\n") == 1 and "--force" in err, err
    code, _, err = run_cli(capsys, "optimize", "profiles/vgg16.json", "-o", str(shipped))
    assert code == 2 and "a shipped schedule" in err, err
    code, _, err = run_cli(capsys, "profile", "resnet50", "--repeats", "1")
    assert code == 2 and "a shipped profile" in err, err
    assert shipped.read_bytes() == before


@pytest.mark.parametrize("argv", [
    ["profile", "cnn", "--nproc-per-node", "0"],
    ["profile", "cnn", "--repeats", "0"],
    ["profile", "nope"],
    ["profile", "cnn", "--comm-min-kb", "100", "--comm-max-mb", "0.01"],
    ["optimize", "profiles/resnet50.json", "--bandwidth-gbps", "0"],
    ["optimize", "profiles/resnet50.json", "--nodes", "4"],
    ["optimize", "profiles/resnet50.json", "--nodes", "2", "--inter-gbps", "100", "--bandwidth-gbps", "9"],
    ["optimize", "profiles/resnet50.json", "--hierarchy", "maybe"],
    ["optimize", "profiles/resnet50.json", "--strategy", "best-flat"],
    ["bench", "cnn", "--strategies", "bogus"],
    ["bench", "cnn", "--bandwidth", "3xyz"],
    ["launch", "--schedule", "schedules/resnet50.json", "--nproc-per-node", "0", "x.py"],
])
def test_every_usage_error_exits_2(capsys, argv, tmp_path, monkeypatch):
    code, out, err = run_cli(capsys, *argv, *(["-o", str(tmp_path / "o.json")] if argv[0] == "optimize" else []))
    assert code == 2, (code, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_launch_help_is_its_own_and_points_to_torchrun(capsys):
    code, out, _ = run_cli(capsys, "launch", "--help")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 80, out
    assert any("--schedule SCHEDULE" in ln for ln in lines[:15]) and "--help-torchrun" in out
    assert "--rdzv-backend" not in out  # torchrun's own options are one command away
    code, out, _ = run_cli(capsys, "launch", "--help-torchrun")
    assert code == 0 and "--rdzv-backend" in out and "--schedule" in out


def test_tables_fit_80_columns_without_cutting_words(monkeypatch):
    import io

    from rich.console import Console

    from usbyte_opt import console

    buf = io.StringIO()
    monkeypatch.setattr(console, "out", Console(file=buf, width=80, highlight=False, soft_wrap=True))
    # optimize --shard's columns: 8 of them, wrapped between words to fit
    columns = ["strategy", "predicted ms", "vs ddp", "state MB", "state vs ddp", "blocks", "gathers",
               "solve s"]
    rows = [["best-sharded *", "92.87", "1.120x", "9.54", "0.12x", "40", "4", "2.093"],
            ["ddp (unsharded, fence)", "103.98", "1.000x", "76.35", "1.00x", "4", "-", "-"]]
    for width, wide in ((80, columns), (200, columns + ["reduce-scatters", "all-gathers"])):
        buf.truncate(0)
        buf.seek(0)
        console.out.width = width
        cells = [r + ["40", "4"][: len(wide) - len(columns)] for r in rows]
        console.table("t", wide, cells)
        text = buf.getvalue()
        assert max(len(ln) for ln in text.splitlines()) <= width, text
        assert "…" not in text
        words = set(text.replace("│", " ").replace("┃", " ").split())
        for w in " ".join(wide + [c for r in cells for c in r]).split():
            assert w in words, (w, text)
    # words that cannot fit: the table is wider, nothing is cut
    buf.truncate(0)
    buf.seek(0)
    console.out.width = 30
    console.table("t", ["bytescheduler-and-more", "predicted"], [["x" * 20, "1"]])
    assert "x" * 20 in buf.getvalue() and "bytescheduler-and-more" in buf.getvalue()
    assert console.out.width == 30


def test_piped_output_honours_columns_and_says_1_block(profile, tmp_path):
    import os

    from usbyte_opt.formats import Block, Buffer, Schedule, load_profile, save_schedule

    prof = load_profile(profile)
    names = tuple(t.name for t in prof.tensors)
    one = Schedule("hand", prof.name, prof.digest(), prof.fingerprint(), prof.comm.world_size,
                   (Buffer("float32", names),), (Block(0, 0, sum(t.numel for t in prof.tensors)),),
                   mode="fence")
    save_schedule(one, tmp_path / "one.json")
    env = dict(os.environ, COLUMNS="80")
    res = subprocess.run([sys.executable, "-m", "usbyte_opt", "simulate", str(profile), str(tmp_path / "one.json")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert max(len(ln) for ln in res.stdout.splitlines()) <= 80, res.stdout
    assert " in 1 block" in res.stdout and "1 blocks" not in res.stdout
    res = subprocess.run([sys.executable, "-m", "usbyte_opt", "optimize", str(profile), "--wide", "-o",
                          str(tmp_path / "s.json")], capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="200"), timeout=300)
    assert res.returncode == 0 and "…" not in res.stdout, res.stdout


def test_profile_of_a_factory_module_is_named_after_it_and_times_its_optimizer(tmp_path):
    import os

    (tmp_path / "tiny_net.py").write_text(
        "import torch\n"
        "def build(batch_size):\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
        "    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)\n"
        "    return m, (torch.randn(batch_size, 8),), lambda out: out.square().mean(), opt\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "usbyte_opt", "profile", "tiny_net:build", "--warmup", "1",
                          "--repeats", "2", "-b", "2"], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    prof = json.loads((tmp_path / "profiles" / "tiny_net.json").read_text())
    assert prof["name"] == "tiny_net" and prof["meta"]["optimizer"] == "adamw"
    assert "adamw, from the model's factory" in res.stdout
    res = subprocess.run([sys.executable, "-m", "usbyte_opt", "profile", "tiny_net:build", "--warmup", "1",
                          "--repeats", "2", "-b", "2", "--optimizer", "sgd", "-o", "p.json"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "p.json").read_text())["meta"]["optimizer"] == "sgd"
    assert "sgd, from --optimizer" in res.stdout
