"""The profiler end to end: two real gloo ranks through the CLI, world size 1 through the API,
and bad model specs turned into one-line errors.

The multi-process tests run ``python -m usbyte_opt profile ... --nproc-per-node 2`` in a new
session with a hard timeout; on expiry the whole session is killed, so nothing hangs.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from usbyte_opt.formats import load_profile
from usbyte_opt.profiler import ProfileOptions, ProfileWarning, profile_model

REPO = Path(__file__).resolve().parents[1]

# A model with every case the profiler must get right; written to a temporary module so
# that the spawned ranks can import it as ``edgemodels:factory``.
EDGE_MODULE = textwrap.dedent('''
    import os
    import torch
    from torch import nn
    from torch.nn import functional as F


    class Edge(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(512, 64)
            self.scale = nn.Parameter(torch.ones(64))      # used by this (non-leaf) module
            self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
            self.side = nn.Linear(64, 64)                  # weight used functionally, never called
            self.unused = nn.Linear(64, 64)                # no gradient at all
            self.frozen = nn.Linear(64, 64).requires_grad_(False)
            self.head = nn.Linear(64, 512, bias=False)
            self.head.weight = self.emb.weight             # tied: one tensor, two uses

        def forward(self, ids):
            x = self.frozen(self.emb(ids))
            x = self.body(x) * self.scale
            x = F.linear(x, self.side.weight)
            return self.head(x)


    def factory(batch_size):
        torch.manual_seed(0)
        ids = torch.randint(512, (batch_size, 32), generator=torch.Generator().manual_seed(1))
        target = torch.randint(512, (batch_size * 32,), generator=torch.Generator().manual_seed(2))
        return Edge(), (ids,), lambda out: F.cross_entropy(out.reshape(-1, 512), target)


    def returns_model_only(batch_size):
        return Edge()


    def vector_loss(batch_size):
        model, inputs, _ = factory(batch_size)
        return model, inputs, lambda out: out.sum(dim=-1)


    def fails_on_rank_1(batch_size):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("no such dataset on this host")
        return factory(batch_size)

    def broken_forward(batch_size):
        model, _, loss_fn = factory(batch_size)
        return model, (torch.zeros(batch_size, 32),), loss_fn   # float ids: embedding raises

    not_callable = 3
''')


@pytest.fixture(scope="module")
def edge_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("edge")
    (d / "edgemodels.py").write_text(EDGE_MODULE)
    return d


def run_cli(args: list[str], cwd: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``python -m usbyte_opt <args>`` in its own session, killed whole on timeout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(cwd), str(REPO)]), COLUMNS="200")
    env.pop("RANK", None)
    proc = subprocess.Popen([sys.executable, "-m", "usbyte_opt", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"usbyte-opt {' '.join(args)} did not finish in {timeout} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def autograd_order(model: torch.nn.Module, inputs, loss_fn) -> list[str]:
    """The order in which autograd produces each gradient, seen through tensor hooks (a
    different mechanism from the profiler's post-accumulate-grad hooks)."""
    order: list[str] = []
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, n=n: order.append(n))
    loss_fn(model(*inputs)).backward()
    return order


# --------------------------------------------------------------------------------------------
# Two gloo ranks through the CLI
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_profile(edge_dir):
    out = edge_dir / "profiles" / "edge.json"
    r = run_cli(["profile", "edgemodels:factory", "--nproc-per-node", "2", "--batch-size", "8",
                 "--warmup", "1", "--repeats", "5", "--comm-max-mb", "16", "--comm-points", "8",
                 "--comm-repeats", "7", "--name", "edge", "--timeout-s", "60", "--stable-s", "3"],
                edge_dir)
    assert r.returncode == 0, r.stderr
    return load_profile(out), json.loads(out.read_text()), r


def test_two_ranks_profile_validates_and_records_the_run(two_rank_profile):
    prof, raw, r = two_rank_profile
    assert raw["format"] == "usbyte-profile"
    m = prof.meta
    assert (m["world_size"], m["backend"], m["hosts"], m["batch_size"]) == (2, "gloo", 1, 8)
    assert m["device"] == "cpu" and m["dtype"] == "float32" and m["torch"] == torch.__version__
    assert len(m["per_rank"]) == 2 and m["created"]
    assert {"p10", "p50", "p90"} <= set(m["spread"]["rank0"]["forward_ms"])
    assert prof.comm.backend == "gloo" and prof.comm.world_size == 2
    assert "edge" in r.stdout and "gloo" in r.stdout


def test_two_ranks_times_are_within_forward_and_backward(two_rank_profile):
    prof, _, _ = two_rank_profile
    for t in prof.tensors:
        assert 0 <= t.ready_ms <= prof.backward_ms, t
        assert 0 <= t.need_ms <= prof.forward_ms, t
        assert t.update_ms >= 0


def test_two_ranks_ready_order_matches_autograd(two_rank_profile, edge_dir, monkeypatch):
    prof, _, _ = two_rank_profile
    monkeypatch.syspath_prepend(str(edge_dir))
    import edgemodels

    want = autograd_order(*edgemodels.factory(8))
    no_grad = set(prof.meta["no_grad_tensors"])
    got = [t.name for t in sorted(prof.tensors, key=lambda t: t.ready_ms) if t.name not in no_grad]
    assert got == want


def test_two_ranks_tied_parent_functional_and_no_grad_tensors(two_rank_profile):
    prof, _, _ = two_rank_profile
    names = [t.name for t in prof.tensors]
    t = {x.name: x for x in prof.tensors}
    # Tied: listed once, ready only after its second use (the embedding, first op of forward)
    # has been accumulated: last of all gradients.
    assert "head.weight" not in names and names.count("emb.weight") == 1
    assert t["emb.weight"].ready_ms == max(x.ready_ms for x in prof.tensors if x.name in
                                           {"emb.weight", "body.0.weight", "scale", "side.weight"})
    # Parameter of the root module, used after its children ran: anchored after body.2's hook.
    assert t["scale"].need_ms == t["body.2.weight"].need_ms > t["body.0.weight"].need_ms
    # Used through F.linear by another module; its own module never runs.
    assert "side.weight" in prof.meta["functional_use_tensors"]
    assert t["side.weight"].need_ms == t["body.2.weight"].need_ms
    # No gradient: ready at the end of backward; never used in forward: need at its end.
    assert set(prof.meta["no_grad_tensors"]) == {"side.bias", "unused.weight", "unused.bias"}
    for n in ("side.bias", "unused.weight", "unused.bias"):
        assert t[n].ready_ms == prof.backward_ms and t[n].need_ms == prof.forward_ms
        assert t[n].update_ms == 0
    # Frozen parameters are not trainable tensors.
    assert not any(n.startswith("frozen.") for n in names)


def test_two_ranks_allreduce_fit_is_within_2x_of_samples(two_rank_profile):
    prof, _, _ = two_rank_profile
    c = prof.comm
    sizes = [b for b, _ in c.samples]
    assert len(sizes) == 8 and sizes[0] == 4096 and sizes[-1] == 16 << 20
    assert c.alpha_ms >= 0 and c.algbw_gbs > 0
    # The fitted line against the sampled medians: within 2x at the median over sizes and
    # within 3x at every size of 1 MiB or more, where bandwidth dominates. Small gloo
    # all-reduces between two single-threaded ranks on a 2-core machine vary up to 3x from run
    # to run (13 KiB measured slower than 144 KiB in one quiet run), so single small sizes are
    # not checked; and this shared host has spells of several seconds in which a core runs at
    # half speed, which moves one size's median by up to 2x.
    fit = prof.meta["comm_sweep"]["fit"]
    ratio = {b: (fit["alpha_ms"] + b / (fit["algbw_gbs"] * 1e6)) / ms for b, ms in c.samples}
    assert 0.5 <= statistics.median(ratio.values()) <= 2.0, ratio
    assert all(1 / 3 <= r <= 3.0 for b, r in ratio.items() if b >= 1 << 20), ratio
    raw = prof.meta["comm_sweep"]["raw_ms"]
    # 3x the repeats below 1 MiB, and rounds added while a median is uncertain.
    assert all(len(r) >= n for r, n in zip(raw, [21] * 5 + [7] * 3)), [len(r) for r in raw]
    spread = prof.meta["comm_sweep"]["spread"]
    assert spread["alpha_ms"][0] <= spread["alpha_ms"][1]
    assert spread["algbw_gbs"][0] <= spread["algbw_gbs"][1]
    # Timed on the channel the runtime's blocks take (gloo: one collective at a time), small
    # sizes in chains of back-to-back calls.
    assert "runtime channel" in prof.meta["comm_sweep"]["channel"]
    # The alpha planned with is the sweep's; the latency under training is recorded beside it.
    assert c.alpha_ms == fit["alpha_ms"] and prof.meta["cpu_probe"]["alpha_ms"] >= 0
    assert prof.meta["comm_sweep"]["chain"] == [4] * 5 + [1] * 3


def test_two_ranks_sweep_reduce_scatter_and_all_gather_beside_all_reduce(two_rank_profile):
    prof, raw, r = two_rank_profile
    c = prof.comm
    ar = dict(c.samples)
    for key, cost in (("reduce_scatter", c.reduce_scatter), ("all_gather", c.all_gather)):
        assert cost is not None, key
        assert key in raw["comm"] and raw["comm"][key]["alpha_ms"] == cost.alpha_ms
        assert cost.alpha_ms >= 0 and cost.algbw_gbs > 0
        # All-reduce's sizes (the whole block's bytes), each to the nearest multiple of
        # 2 ranks * 4 bytes.
        sizes = [b for b, _ in cost.samples]
        assert len(sizes) == len(c.samples) and all(b % 8 == 0 for b in sizes), key
        assert all(abs(b - a) <= 4 for b, (a, _) in zip(sizes, c.samples)), key
        # The line against its own medians, as all-reduce's: within 3x at the median over
        # sizes and at every size of 1 MiB or more (small gloo collectives on 2 shared cores
        # vary several-fold run to run).
        ratio = {b: (cost.alpha_ms + b / (cost.algbw_gbs * 1e6)) / ms for b, ms in cost.samples}
        assert 1 / 3 <= statistics.median(ratio.values()) <= 3.0, (key, ratio)
        # (Reduce-scatter, an all-to-all and an add on 2 gloo ranks, varies most on loopback;
        # with the suite's other processes on the same two cores a size can be 3-4x off.)
        lim = 6.0 if key == "reduce_scatter" else 5.0
        assert all(1 / lim <= x <= lim for b, x in ratio.items() if b >= 1 << 20), (key, ratio)
        rec = prof.meta["comm_sweep"][key]
        assert rec["collective"] == key.replace("_", "-") and "runtime channel" in rec["channel"]
        assert rec["sizes_bytes"] == [b for b, _ in cost.samples]
        assert all(len(ts) >= n for ts, n in zip(rec["raw_ms"], [21] * 5 + [7] * 3))
        assert rec["fit"]["alpha_ms"] == cost.alpha_ms
    # At the largest size (16 MiB), on the fitted lines (each read from all its sizes, so one
    # median hit by load from elsewhere on this shared host does not decide). The reduce-scatter
    # on 2 gloo ranks is an all-to-all and an add (torch's is a whole all-reduce and a copy): on
    # loopback, where memory copies rather than the wire set the pace, measured 0.6-1.4x
    # all-reduce.
    largest = max(ar)

    def at(x):
        return x.alpha_ms + largest / (x.algbw_gbs * 1e6)

    # Which of the three is cheaper is a measurement for the benchmarks, not a test: on two
    # shared cores all-gather's line has come out 0.6-1.1x all-reduce's. Here only that each
    # line is of all-reduce's order at the largest size.
    for x in (c.all_gather, c.reduce_scatter):
        assert 0.2 * at(c) <= at(x) <= 5.0 * at(c), (at(x), at(c))
    assert "reduce-scatter" in r.stdout and "all-gather" in r.stdout


def test_two_ranks_record_what_allreduce_costs_the_training_thread(two_rank_profile):
    prof, raw, _ = two_rank_profile
    probe = prof.meta["cpu_probe"]
    # The planner's compute-cost option, in the profile's comm and in the file.
    assert prof.comm.cpu_ms_per_block == probe["cpu_ms_per_block"] >= 0
    assert prof.comm.cpu_ms_per_mb == probe["cpu_ms_per_mb"] >= 0
    assert prof.comm.cpu_ms_per_block + prof.comm.cpu_ms_per_mb > 0  # gloo on 2 shared cores
    assert raw["comm"].get("cpu_ms_per_block", 0.0) == prof.comm.cpu_ms_per_block
    # A chain of 32 blocks of 4 KiB, then chains of 4 up to the whole gradient; one sample
    # (ms per block) per chain.
    chains = probe["chains"]
    assert chains[0] == {"bytes": 32 * 4096, "blocks": 32}
    assert all(c["blocks"] == 4 for c in chains[1:])
    assert [s["bytes"] for s in probe["samples"]] == [c["bytes"] // c["blocks"] for c in chains]
    assert all(s["ms"] > 0 for s in probe["samples"]) and probe["step_alone_ms"] > 0


def test_two_ranks_record_the_host_cost_of_the_runtime_and_of_ddp(two_rank_profile):
    prof, raw, r = two_rank_profile
    host = prof.host
    assert host is not None and not host.defaulted and host.launch_bound     # CPU
    assert raw["host"]["runtime_tensor_us"] == host.runtime_tensor_us
    rec = prof.meta["host_probe"]
    assert len(rec["per_rank"]) == 2
    for key in ("runtime_tensor_us", "runtime_block_us", "ddp_tensor_us", "ddp_bucket_us"):
        # the slowest rank's, each measured on a group of its own
        assert getattr(host, key) == max(p[key] for p in rec["per_rank"]) >= 0
    assert "host cost" in r.stdout


@pytest.mark.slow
def test_no_cpu_probe_nor_shard_sweep_leaves_the_options_out(edge_dir):
    """(A whole two-rank profile; the default run profiles with both, and without the host
    probe in test_host_cost_profiler.)"""
    out = edge_dir / "profiles" / "noprobe.json"
    r = run_cli(["profile", "edgemodels:factory", "--nproc-per-node", "2", "--batch-size", "4",
                 "--warmup", "1", "--repeats", "2", "--comm-max-mb", "1", "--comm-points", "3",
                 "--comm-repeats", "2", "--no-cpu-probe", "--no-shard-sweep", "--name", "noprobe",
                 "-o", str(out), "--timeout-s", "60", "--stable-s", "0"], edge_dir)
    assert r.returncode == 0, r.stderr
    raw = json.loads(out.read_text())
    assert "cpu_ms_per_block" not in raw["comm"] and "cpu_probe" not in raw["meta"]
    assert "reduce_scatter" not in raw["comm"] and "all_gather" not in raw["comm"]
    assert "reduce_scatter" not in raw["meta"]["comm_sweep"]


# --------------------------------------------------------------------------------------------
# World size 1 through the API
# --------------------------------------------------------------------------------------------


def test_world_size_1_uses_analytic_comm_with_a_warning_and_overrides():
    with pytest.warns(ProfileWarning, match="world size 1"):
        p = profile_model("transformer", 2, ProfileOptions(warmup=0, repeats=2, alpha_ms=0.5,
                                                           algbw_gbs=3.0))
    assert p.comm.backend == "analytic" and (p.comm.alpha_ms, p.comm.algbw_gbs) == (0.5, 3.0)
    assert p.meta["warnings"] and p.meta["world_size"] == 1
    # nn.MultiheadAttention uses out_proj.weight functionally: anchored to its own hook.
    t = {x.name: x for x in p.tensors}
    for k in range(4):
        pre = f"blocks.layers.{k}.self_attn."
        assert pre + "out_proj.weight" in p.meta["functional_use_tensors"]
        assert t[pre + "out_proj.weight"].need_ms == t[pre + "in_proj_weight"].need_ms
    # Tied output projection: one tensor; the position embedding of the root is anchored to
    # the token embedding's hook, which runs just before it is used.
    assert "head.weight" not in t and t["pos"].need_ms == t["tok.weight"].need_ms


def test_world_size_1_ready_order_matches_autograd():
    from usbyte_opt.models import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileWarning)
        p = profile_model("transformer", 2, ProfileOptions(warmup=0, repeats=3))
    got = [t.name for t in sorted(p.tensors, key=lambda t: t.ready_ms)]
    assert got == autograd_order(*build("transformer", 2))


def test_update_ms_sums_to_the_step_and_follows_numel():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileWarning)
        p = profile_model("mlp", 2, ProfileOptions(warmup=0, repeats=2, optimizer="adam"))
    assert p.meta["optimizer"] == "adam"
    assert sum(t.update_ms for t in p.tensors) == pytest.approx(p.meta["step_ms"], rel=1e-3)
    big, small = p.tensor("2.weight"), p.tensor("2.bias")
    assert big.update_ms / small.update_ms == pytest.approx(2048, rel=1e-3)


# --------------------------------------------------------------------------------------------
# Bad input: one line, non-zero exit, no traceback
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, expected", [
    ("nosuchmodel", "unknown model 'nosuchmodel': expected a built-in name"),
    ("no_such_module_xyz:factory", "cannot import module 'no_such_module_xyz'"),
    ("edgemodels:missing", "has no attribute 'missing'; expected factory(batch_size: int)"),
    ("edgemodels:not_callable", "not callable"),
    ("edgemodels:returns_model_only", "expected factory(batch_size: int) -> (model"),
    ("edgemodels:vector_loss", "must return a scalar tensor, got a tensor of shape (2, 32)"),
    ("edgemodels:broken_forward", "the first training iteration raised RuntimeError: "),
])
def test_bad_model_specs_are_one_line_errors(spec, expected, edge_dir, monkeypatch, capsys, tmp_path):
    from usbyte_opt.cli.main import main

    monkeypatch.syspath_prepend(str(edge_dir))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["profile", spec, "--batch-size", "2", "--warmup", "0", "--repeats", "1"])
    err = capsys.readouterr().err
    assert e.value.code != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert not (tmp_path / "profiles").exists()


def test_a_rank_failing_alone_stops_every_rank_with_one_error(edge_dir):
    r = run_cli(["profile", "edgemodels:fails_on_rank_1", "--nproc-per-node", "2", "--batch-size", "2",
                 "--warmup", "0", "--repeats", "1", "--timeout-s", "30"], edge_dir, timeout=60)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "rank 1" in lines[0] and "no such dataset" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (edge_dir / "profiles" / "fails_on_rank_1.json").exists()
