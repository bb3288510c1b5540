"""Several nodes: the topology a profile records (from torchrun's variables), the sweeps per
level, the pre-flight that stops a gloo world whose ranks the other nodes cannot reach, the
rank prefix said once, and the first failed rank named with its node.

One real run of two torchrun "nodes" of two ranks each on loopback (``GLOO_SOCKET_IFNAME=lo``),
shared by the tests that read its profile; the rest are pure functions and one CLI run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from usbyte_opt.cli.launch import _failure
from usbyte_opt.errors import DistributedError, ExitError, with_rank
from usbyte_opt.formats import load_profile
from usbyte_opt.launcher import Failure, RankError, first_failure, free_port
from usbyte_opt.preflight import gloo_preflight, spans_nodes
from usbyte_opt.profiler.topology import Place, Topology, place_from_env, topology

ROOT = Path(__file__).resolve().parent.parent
#: The fewest iterations and sweep sizes the profiler takes: the run is about the topology.
FAST = ["--batch-size", "2", "--warmup", "1", "--repeats", "2", "--comm-points", "2",
        "--comm-repeats", "1", "--comm-max-mb", "0.0625", "--no-cpu-probe", "--no-shard-sweep",
        "--stable-s", "0"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


# --------------------------------------------------------------------------------------------
# The one real run: 2 torchrun nodes x 2 ranks
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """``usbyte-opt profile mlp`` under two torchrun processes, ``--nnodes 2 --nproc-per-node 2``,
    meeting on 127.0.0.1: the profile written and each node's outcome."""
    out = tmp_path_factory.mktemp("nodes") / "mlp.json"
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "usbyte_opt", "profile", "mlp", "-o", str(out), *FAST],
        env=_env(GLOO_SOCKET_IFNAME="lo"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=ROOT) for k in (0, 1)]
    done = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=150)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out, done


@pytest.mark.slow   # two torchrun nodes, about 40 s; the world's topology without them below
def test_two_nodes_of_two_ranks_record_their_topology_and_three_lines(two_nodes):
    path, runs = two_nodes
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    prof = load_profile(path)
    c = prof.comm
    assert (c.world_size, c.nodes, c.ranks_per_node, c.hierarchical) == (4, 2, 2, True)
    assert prof.meta["ranks_per_node"] == 2 and prof.meta["hosts"] == 1
    for line in (c, c.intra, c.inter):
        assert line is not None and line.alpha_ms >= 0 and line.algbw_gbs > 0
        assert [b for b, _ in line.samples] == [b for b, _ in c.samples]
    sweep = prof.meta["comm_sweep"]
    assert len(sweep["intra"]["node_medians_ms"]) == 2 and "slowest node" in sweep["intra"]["fit_from"]
    assert "local rank 0" in sweep["inter"]["group"]


@pytest.mark.slow   # two torchrun nodes, about 40 s; the world's topology without them below
def test_the_summary_shows_the_nodes_and_the_lines_per_level(two_nodes):
    _, runs = two_nodes
    shown = runs[0].stdout + runs[0].stderr
    assert "on 2 nodes of 2" in shown and "intra-node" in shown and "inter-node" in shown
    assert "profile mlp" not in runs[1].stdout  # node 1 has no rank 0: it prints nothing


# --------------------------------------------------------------------------------------------
# Topology: pure
# --------------------------------------------------------------------------------------------


def test_without_torchrun_variables_the_world_is_one_node():
    assert place_from_env({"RANK": "0", "WORLD_SIZE": "2"}) == Place()
    assert topology([place_from_env({})] * 3) == Topology(1, 3)
    assert topology([Place(0, 2)] * 2) == Topology(1, 2)
    assert not Topology(2, 1).hierarchical and Topology(2, 8).hierarchical


@pytest.mark.parametrize("places, words", [
    ([Place(0, 2), Place(0, 2), Place(1, 1)], "different numbers of ranks"),
    ([Place(0, 2), Place(1, 2), Place(0, 2), Place(1, 2)], "not numbered node by node: rank 1"),
    ([Place(0, 2), Place(0, 2), Place(1, 2)], "do not fill nodes of 2"),
])
def test_uneven_or_interleaved_worlds_are_refused_in_one_line(places, words):
    with pytest.raises(DistributedError, match=words) as e:
        topology(places)
    assert "\n" not in str(e.value)


def test_a_shipped_profile_loads_as_one_node():
    prof = load_profile(ROOT / "profiles" / "resnet50.json")
    assert prof.comm.nodes == 1 and prof.comm.intra is None and not prof.comm.hierarchical


# --------------------------------------------------------------------------------------------
# Pre-flight
# --------------------------------------------------------------------------------------------


def test_preflight_refuses_a_loopback_hostname_only_when_the_world_spans_nodes():
    ranks = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"}
    kw = dict(host="gpu7", host_addr="127.0.1.1", route=lambda h: "10.0.0.7",
              interface=lambda a: "ens5" if a == "10.0.0.7" else None)
    line = gloo_preflight(ranks, **kw)
    assert line is not None and "\n" not in line
    assert "GLOO_SOCKET_IFNAME=ens5" in line and "ip route get 10.0.0.1" in line and "/etc/hosts" in line
    assert gloo_preflight({**ranks, "GLOO_SOCKET_IFNAME": "ens5"}, **kw) is None
    assert gloo_preflight({**ranks, "LOCAL_WORLD_SIZE": "16"}, **kw) is None      # one node
    assert gloo_preflight({**ranks, "MASTER_ADDR": "127.0.0.1"}, **kw) is None    # all here
    assert gloo_preflight(ranks, **{**kw, "host_addr": "10.0.0.7"}) is None      # reachable
    # launch: --nnodes, the master from its options; no interface found: the command to ask
    line = gloo_preflight({}, nnodes=2, master="node0", host="gpu7", host_addr="127.0.1.1")
    assert line is not None and "`ip route get node0` names" in line
    assert spans_nodes({}, 2) and not spans_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"})


def test_profile_on_a_loopback_hostname_spanning_nodes_stops_before_the_rendezvous(tmp_path):
    # A real CLI run on a rank of a 2-node world; the resolver answers as Debian's /etc/hosts
    # does (this machine's own name may resolve anywhere). MASTER_ADDR is never contacted.
    code = ("import socket; socket.gethostbyname = lambda name: '127.0.1.1'\n"
            "from usbyte_opt.cli.main import main; main()")
    env = _env(RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", GROUP_RANK="1",
               MASTER_ADDR="192.0.2.1", MASTER_PORT="29500")
    env.pop("GLOO_SOCKET_IFNAME", None)
    res = subprocess.run([sys.executable, "-c", code, "profile", "mlp", "--device", "cpu",
                          "-o", str(tmp_path / "p.json")], env=env, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1, res.stderr
    assert lines[0].startswith("error: profile: ") and "GLOO_SOCKET_IFNAME" in lines[0]
    assert "Traceback" not in res.stderr and not (tmp_path / "p.json").exists()


# --------------------------------------------------------------------------------------------
# Rank prefix, said once
# --------------------------------------------------------------------------------------------


def test_an_error_that_names_its_rank_is_printed_with_one_prefix(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        from usbyte_opt.errors import DistributedError, MismatchError
        import sys
        if sys.argv[1:] == ["own"]:
            raise DistributedError("rank 0: the schedule differs across ranks")
        raise MismatchError("tensor 'w': expected shape [2]")
    """))
    env = _env(RANK="0")
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    for arg, want in (("own", "error: rank 0: the schedule differs across ranks"),
                      ("bare", "error: rank 0: tensor 'w': expected shape [2]")):
        res = subprocess.run([sys.executable, "-m", "usbyte_opt.cli.rank", str(script), arg],
                             env=env, capture_output=True, text=True, timeout=60)
        assert res.stderr.strip() == want and res.returncode in (3, 4), res.stderr
    assert with_rank(3, "rank 3: x") == "rank 3: x" and with_rank("3", "x") == "rank 3: x"


# --------------------------------------------------------------------------------------------
# The first failed rank, named with its node
# --------------------------------------------------------------------------------------------


def _torchrun_failure(exitcode: int, timestamp: int, error: dict | None = None) -> SimpleNamespace:
    """What torchrun's ChildFailedError holds per rank (a ProcessFailure's fields used here)."""
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, error_file_data=error or {})


def _error_file(message: str, time: float, *, peer: bool = False, usbyte: bool = True,
                code: int = 4) -> dict:
    return {"message": {"message": message, "extraInfo": {
        "timestamp": str(int(time)), "time": time, "exit_code": code, "peer": peer, "usbyte": usbyte}}}


def test_first_failure_skips_peers_and_stopped_ranks_and_orders_by_time():
    peer = RankError("rank 0: a collective failed", peer=True)
    gloo = RankError("RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    own = RankError("rank 2: tensor 'w': expected shape [2]", 3, usbyte=True, timestamp=50.7)
    failures = [Failure(0, 4, 50.1, peer, 0), Failure(1, 1, 50.2, gloo, 0),
                Failure(2, 3, 50.7, own, 1), Failure(3, -signal.SIGKILL, 50.5, None, 1),
                Failure(4, -signal.SIGTERM, 50.0, None, 2)]
    assert first_failure(failures).rank == 3
    assert first_failure(failures[:3]).label == "rank 2 (node 1)"
    assert first_failure(failures[:2]) is None


def test_launch_names_the_killed_rank_of_its_node_not_a_peer_that_failed_earlier():
    # Node 1 of 2 (ranks 2, 3): rank 3 was killed; rank 2's collective failed because of it
    # and left a usbyte-opt error, timed before torchrun noticed the kill.
    failures = {2: _torchrun_failure(4, 100, _error_file("rank 2: a collective failed", 100.2, peer=True)),
                3: _torchrun_failure(-signal.SIGKILL, 101)}
    e = _failure(failures, "train.py", nnodes=2, nproc=2)
    assert isinstance(e, ExitError) and str(e) == ("launch: train.py: rank 3 (node 1) was killed "
                                                   "by SIGKILL, the first rank to fail")
    # Node 0, whose ranks only saw their collectives fail: not blamed.
    here = {0: _torchrun_failure(4, 100, _error_file("rank 0: a collective failed", 100.3, peer=True)),
            1: _torchrun_failure(1, 100, _error_file(
                "RuntimeError: [/x/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer. This is ...",
                100.1, usbyte=False, code=1))}
    e = _failure(here, "train.py", nnodes=2, nproc=2)
    assert str(e).startswith("launch: train.py: no rank on node 0 failed on its own (rank 1: "
                             "RuntimeError: Read error: Connection reset by peer)")
    assert str(e).endswith("the first failure is on another node: see its output")
    # A usbyte-opt error that came first: its own line, the node added, the prefix once.
    own = {2: _torchrun_failure(3, 99, _error_file("rank 2: tensor 'w' differs", 99.5, code=3)),
           3: _torchrun_failure(-signal.SIGTERM, 100)}
    e = _failure(own, "train.py", nnodes=2, nproc=2)
    assert (str(e), e.exit_code) == ("rank 2 (node 1): tensor 'w' differs", 3)
    assert str(_failure(own, "train.py")) == "rank 2: tensor 'w' differs"


def test_launch_on_a_loopback_hostname_spanning_nodes_stops_before_torchrun(capsys, monkeypatch, tmp_path):
    import socket

    import torch
    from helpers import run_cli

    from usbyte_opt.formats import save_schedule
    from usbyte_opt.runtime import default_schedule

    if torch.cuda.is_available():
        pytest.skip("on a CUDA host launch warns instead (NCCL)")
    sched = tmp_path / "s.json"
    save_schedule(default_schedule(torch.nn.Linear(4, 2), 4), sched)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    code, out, err = run_cli(capsys, "launch", "--schedule", str(sched), "--nnodes", "2",
                             "--nproc-per-node", "2", "--node-rank", "1", "--master-addr",
                             "192.0.2.1", "--master-port", "29500", str(tmp_path / "train.py"))
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: launch: "), err
    assert "GLOO_SOCKET_IFNAME" in lines[0] and "ip route get 192.0.2.1" in lines[0]
    assert "usbyte-opt:" not in out   # nothing started


def test_a_node_told_of_another_nodes_failure_names_it():
    here = {0: _torchrun_failure(4, 100, _error_file("rank 0: a collective failed", 100.3, peer=True)),
            1: _torchrun_failure(-signal.SIGTERM, 101)}
    told: list = []

    def share(mine):   # what the nodes' exchange (FailureBoard.share) returns
        told.extend(mine)
        return [*mine, Failure(3, -signal.SIGKILL, 100.0, None, 1)]

    e = _failure(here, "train.py", nnodes=2, nproc=2, share=share)
    assert str(e) == "launch: train.py: rank 3 (node 1) was killed by SIGKILL, the first rank to fail"
    assert sorted(f.rank for f in told) == [0, 1] and {f.node for f in told} == {0}
