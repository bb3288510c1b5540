"""The two-level lab (nodes of several ranks joined by a shaped link) and ``bench --nodes``.

Without root: the layout (names, addresses, torchrun's node variables, the commands built),
the refusals, the link counter, and, on one spawned pair of gloo ranks, the traces sent to
rank 0 over the process group (no shared folder) and the bytes counted per turn. As root, one
short run: 2 nodes x 2 ranks started in their namespaces, where an all-reduce
inside a node leaves the shaped link idle and one across nodes crosses it (the kernel's
counters and tc's agree), and nothing of the lab is left afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_lab import PREFIX, SKIP, ours

from usbyte_opt.bench import BenchConfig, default_out_dir, network_info, run_bench
from usbyte_opt.bench.netlab import IFNAME, Lab, LoopbackNodes, check_nodes, node_env, tx_bytes
from usbyte_opt.errors import UsbyteError
from usbyte_opt.launcher import run_local, values

# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


def test_two_nodes_of_two_ranks_one_namespace_per_node():
    lab = Lab(4, "200mbit", prefix=PREFIX, ranks_per_node=2)
    pid = os.getpid()
    assert (lab.nodes, lab.ranks_per_node) == (2, 2)
    assert lab.namespaces == [f"{PREFIX}{pid}-n0", f"{PREFIX}{pid}-n1"] and lab.hub is None
    assert lab.addresses == [f"10.231.{lab.subnet}.1", f"10.231.{lab.subnet}.2"]
    # A node's ranks run in its namespace and meet at node 0's address over usb0.
    assert [lab.command(r, ["x"])[3] for r in range(4)] == [lab.namespaces[k] for k in (0, 0, 1, 1)]
    env = lab.env(3)
    assert env["MASTER_ADDR"] == lab.addresses[0] and env["GLOO_SOCKET_IFNAME"] == IFNAME
    assert {k: env[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")} \
        == {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    assert lab.torchrun(1, ["t.py", "--x"])[:4] == ["ip", "netns", "exec", lab.namespaces[1]]
    assert lab.torchrun(1, ["t.py", "--x"])[5:] == [
        "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1",
        "--master-addr", lab.addresses[0], "--master-port", "29500", "t.py", "--x"]
    assert "2 nodes of 2 ranks" in lab.describe() and "veth pair" in lab.describe()
    # One rank per namespace stays as it was (no node variables: each rank is its own node).
    flat = Lab(2, "200mbit", prefix=PREFIX)
    assert flat.namespaces == [f"{PREFIX}{pid}-r0", f"{PREFIX}{pid}-r1"]
    assert "LOCAL_RANK" not in flat.env(1)


def test_three_nodes_meet_through_the_hub():
    lab = Lab(6, "1gbit", prefix=PREFIX, ranks_per_node=2)
    assert lab.nodes == 3 and lab.hub == f"{PREFIX}{os.getpid()}-hub"
    assert lab.command(5, ["x"])[3] == lab.namespaces[2]
    assert "bridge, 3 veth pairs" in lab.describe()


@pytest.mark.parametrize("world,per,match", [(2, 2, "at least 2 nodes"), (6, 4, "at least 2 nodes"),
                                             (5, 2, "at least 2 nodes")])
def test_a_layout_that_is_no_two_level_lab_is_refused(world, per, match):
    with pytest.raises(UsbyteError, match=match):
        Lab(world, "200mbit", prefix=PREFIX, ranks_per_node=per)


def test_node_variables_number_ranks_as_torchrun():
    for rank in range(8):
        e = node_env(rank, 8, 4)
        assert int(e["RANK"]) == int(e["GROUP_RANK"]) * int(e["LOCAL_WORLD_SIZE"]) + int(e["LOCAL_RANK"])
    with pytest.raises(UsbyteError, match="--nodes 0"):
        check_nodes(0, 2)
    with pytest.raises(UsbyteError, match="at most 250 ranks"):
        check_nodes(200, 2)


def test_nodes_on_loopback_and_what_the_report_calls_them():
    with LoopbackNodes(4, 2) as nodes:
        env = nodes.env(2)
        assert env["GROUP_RANK"] == "1" and env["LOCAL_RANK"] == "0" and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert int(env["MASTER_PORT"]) > 0 and nodes.command(2, ["x"]) == ["x"]
        net = network_info(nodes)
    assert net["kind"] == "loopback" and (net["nodes"], net["ranks_per_node"]) == (2, 2)
    net = network_info(Lab(4, "200mbit", prefix=PREFIX, ranks_per_node=2))
    assert net["kind"] == "lab" and net["nodes"] == 2 and "2 nodes x 2" in net["short"]
    assert "nodes" not in network_info(Lab(2, "200mbit", prefix=PREFIX))
    cfg = BenchConfig(model="cnn", nodes=2, nproc=2, bandwidth="200mbit")
    assert default_out_dir(cfg).name == "cnn-200mbit-2x2"
    job = cfg.job(Path("out"))
    assert job.link == IFNAME and job.threads == max(1, (os.cpu_count() or 1) // 4)
    assert BenchConfig(model="cnn").job(Path("out")).link is None


def test_the_link_counter_reads_this_namespaces_table():
    assert isinstance(tx_bytes("lo"), int)   # every namespace has lo
    assert tx_bytes("no-such-link0") is None
    assert tx_bytes("lo", "/no/such/table") is None


def test_nodes_under_torchrun_and_without_root_are_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsbyteError, match="--nodes 2: under torchrun the nodes are torchrun's own"):
        run_bench(BenchConfig(model="cnn", nodes=2, out_dir=tmp_path / "t"))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    from usbyte_opt.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "lab-cnn", "--nodes", "2", "--bandwidth", "200mbit", "-o", str(tmp_path / "o")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs root" in err[0]


def test_bench_help_shows_the_multinode_command():
    p = subprocess.run([sys.executable, "-m", "usbyte_opt", "bench", "--help"], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert p.returncode == 0
    assert "--nodes 2 --nproc-per-node 2 --bandwidth 200mbit" in p.stdout and "--nodes" in p.stdout


# --------------------------------------------------------------------------------------------
# Two gloo ranks: traces to rank 0 over the group, bytes per turn
# --------------------------------------------------------------------------------------------


def tiny(batch_size: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    return model, (torch.randn(batch_size or 2, 4),), lambda out: out.pow(2).mean()


def gather_rank(rank: int, world: int, root: str) -> dict:
    """Rank 0 records into ``root/out/traces``, rank 1 into a folder of its own; both traces
    end in rank 0's folder, and rank 1's folder is removed. A turn with a link counter adds
    the bytes it counted and the iterations it ran."""
    from usbyte_opt.bench.train import Trainee, turn
    from usbyte_opt.bench.worker import _gather_traces
    from usbyte_opt.runtime.trace import path_for_rank

    folder = Path(root) / ("out/traces" if rank == 0 else f"own{rank}")
    folder.mkdir(parents=True)
    traces = {"best": str(folder / "best.measured.json")}
    Path(path_for_rank(traces["best"], rank)).write_text(json.dumps({"rank": rank}))
    _gather_traces(traces, rank, world)
    t = Trainee("x", "local", tiny, 2, torch.device("cpu"), "sgd", rank=rank)
    counter = iter(range(0, 10_000, 1000))
    turn(t, 1, 2, torch.device("cpu"), lambda: next(counter))
    return {"own_left": folder.exists(), "bytes": t.link_bytes, "iterations": t.link_iterations}


def test_traces_reach_rank_0_over_the_group_and_turns_count_bytes(tmp_path):
    got = values(run_local(gather_rank, 2, args=(str(tmp_path),), timeout_s=120))
    out = tmp_path / "out" / "traces"
    assert json.loads((out / "best.measured.json").read_text()) == {"rank": 0}
    assert json.loads((out / "best.measured.rank1.json").read_text()) == {"rank": 1}
    assert got[1]["own_left"] is False and not (tmp_path / "own1").exists()
    assert all(g["bytes"] == 1000 and g["iterations"] == 4 for g in got)


def test_bytes_per_iteration_sum_the_nodes_counted():
    from usbyte_opt.bench.worker import _link_per_iteration

    ranks = [{"link_bytes": 800, "link_iterations": 4}, {"link_bytes": None, "link_iterations": 4},
             {"link_bytes": 1200, "link_iterations": 4}, {"link_bytes": None, "link_iterations": 4}]
    assert _link_per_iteration(ranks) == 500.0
    assert _link_per_iteration([{"link_bytes": None, "link_iterations": 0}]) is None


# --------------------------------------------------------------------------------------------
# As root: torchrun per node, bytes where they belong
# --------------------------------------------------------------------------------------------

RANK_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
from usbyte_opt.bench.netlab import tx_bytes

dist.init_process_group("gloo")
r, n = dist.get_rank(), dist.get_world_size()
g = int(os.environ["LOCAL_WORLD_SIZE"])
intra = [dist.new_group(list(range(k * g, k * g + g))) for k in range(n // g)]
inter = [dist.new_group(list(range(j, n, g))) for j in range(g)]
x = torch.ones(1 << 20)                                   # 4 MiB
dist.barrier(); a = tx_bytes()
dist.all_reduce(x, group=intra[r // g]); dist.barrier(); b = tx_bytes()
dist.all_reduce(x, group=inter[r % g]); dist.barrier(); c = tx_bytes()
json.dump({"intra": b - a, "inter": c - b, "value": float(x[0]), "group": os.environ["GROUP_RANK"]},
          open(os.path.join(sys.argv[1], f"rank{r}.json"), "w"))
dist.destroy_process_group()
"""


@pytest.mark.skipif(SKIP is not None, reason=f"lab: {SKIP}")
def test_intra_node_bytes_stay_off_the_shaped_link(tmp_path):
    """The ranks started as the bench starts them (:func:`usbyte_opt.launcher.run_ranks` with
    the lab: torchrun's variables, each rank in its node's namespace)."""
    from usbyte_opt.launcher import run_ranks

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    with Lab(4, "200mbit", prefix=PREFIX, ranks_per_node=2) as lab:
        assert sorted(ours()) == sorted(lab.namespaces)
        before = lab.link_bytes()
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
        res = run_ranks([sys.executable, str(script), str(tmp_path)], 4, lab=lab, env=env,
                        logs=tmp_path / "logs", timeout_s=120)
        assert res.ok, [(tmp_path / "logs" / f"rank{r}.log").read_text()[-500:] for r in res.failed]
        sent = [a - b for a, b in zip(lab.link_bytes(), before)]
    assert ours() == []
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [x["group"] for x in ranks] == ["0", "0", "1", "1"]
    assert all(x["value"] == 4.0 for x in ranks)            # summed in the node, then across
    mib = 1 << 20
    # Inside a node: a few control bytes on the link, no data. Across: each node's two ranks
    # send their 4 MiB all-reduce's share (half of it each way, twice: 4 MiB per rank).
    assert all(x["intra"] < 0.1 * 4 * mib for x in ranks)  # not the 4 MiB through the link
    assert all(x["inter"] >= 2 * 4 * mib * 0.95 for x in ranks)
    assert all(s >= 2 * 4 * mib * 0.95 for s in sent)       # tc's counter saw the same bytes
