"""Hierarchical blocks run by the runtime: 4 gloo ranks grouped as 2 nodes of 2 ranks.

One spawned run of 4 ranks on loopback (torchrun's per-node variables set as two nodes of two
would set them) plays every case; the tests below read its results:

* training side by side with DDP on the same 4 ranks, a schedule mixing flat and hierarchical
  blocks (DDP-like buckets of the default plan, every other one hierarchical, some of an odd
  number of elements) in overlap and fence mode, and a schedule of hierarchical blocks only:
  the parameters equal DDP's within float rounding (whether bitwise is recorded);
* the sum order: a hierarchical all-reduce on 2 x 2 ranks is (g0 + g1) + (g2 + g3) bitwise
  (every stage adds exactly two terms, rounded once), gloo's flat 4-rank all-reduce (what DDP
  runs) a chain of three additions ((a + b) + c) + d per element, so the two differ in the
  last bit on some elements; with one node of 4 ranks the node sum is ((g0 + g1) + g2) + g3;
* a schedule without hierarchical blocks creates no group, and keeps its digest;
* refusals on every rank, in one line: ``nodes`` against torchrun's ``LOCAL_WORLD_SIZE``,
  a rank whose ``GROUP_RANK`` disagrees (its peers name it); in process, without ranks,
  ``nodes`` not dividing the world size and a hierarchical block in sharded mode;
* a rank that never issues a hierarchical block: its peers fail at the timeout, naming the
  stage and its ranks, instead of hanging.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.test_runtime_equivalence import SmallCNN, image_batch, max_diff, twins
from usbyte_opt.errors import DistributedError, MismatchError, UsbyteError
from usbyte_opt.formats import Mode, Schedule, save_schedule
from usbyte_opt.launcher import run_local, values
from usbyte_opt.runtime import DistributedOptimizer
from usbyte_opt.runtime.checks import check_hierarchy
from usbyte_opt.runtime.default_plan import default_schedule

WS, NODES, G = 4, 2, 2
STEPS = 4
#: Largest difference from DDP allowed, relative to the largest parameter (float rounding).
REL_TOL = 1e-6


def two_node_env(rank: int) -> dict[str, str]:
    """torchrun's variables for ``rank`` as 2 nodes of 2 ranks (on loopback)."""
    env = {"LOCAL_WORLD_SIZE": str(G), "GROUP_RANK": str(rank // G), "LOCAL_RANK": str(rank % G)}
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"   # "several nodes" would refuse a loopback hostname
    return env


def one_node_env(rank: int) -> dict[str, str]:
    """What run_local sets: one node of 4 ranks."""
    return {"LOCAL_WORLD_SIZE": str(WS), "GROUP_RANK": "0", "LOCAL_RANK": str(rank)}


def flat_schedule(model: torch.nn.Module) -> Schedule:
    """The default plan with small buckets (several blocks, some of an odd length)."""
    return default_schedule(model, WS, first_bucket_bytes=512, bucket_cap_bytes=2048)


def with_hier(s: Schedule, which: Any) -> Schedule:
    blocks = tuple(dataclasses.replace(b, hier=bool(which(i))) for i, b in enumerate(s.blocks))
    return dataclasses.replace(s, blocks=blocks, nodes=NODES)


def train(sched: Schedule, rank: int, mode: Mode) -> dict[str, Any]:
    ref, mod = twins(SmallCNN)
    ddp = DDP(ref)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    o_usb = DistributedOptimizer(torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9), mod,
                                 schedule=dataclasses.replace(sched, mode=mode), verify=False)
    for step in range(STEPS):
        x, y = image_batch(rank, step)
        F.mse_loss(ddp(x), y).backward()
        o_ref.step()
        o_ref.zero_grad()
        F.mse_loss(mod(x), y).backward()
        o_usb.step()
        o_usb.zero_grad()
    o_usb.synchronize()
    groups = o_usb._chan.hier is not None
    o_usb.close()
    scale = max(p.detach().abs().max().item() for p in ref.parameters())
    bitwise = all(torch.equal(a, b) for a, b in zip(ref.parameters(), mod.parameters()))
    return {"diff": max_diff(ref, mod), "scale": scale, "bitwise": bitwise, "groups": groups}


def sum_orders(rank: int) -> dict[str, Any]:
    """The hierarchical and the flat all-reduce of the same tensors against explicit sums."""
    from usbyte_opt.runtime.hier import HierChannel

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1001, generator=g)   # odd: the padded path
    xs = [torch.empty_like(x) for _ in range(WS)]
    dist.all_gather(xs, x)
    pairs = (xs[0] + xs[1]) + (xs[2] + xs[3])
    chain = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    hier = HierChannel(None, NODES, torch.device("cpu"), None)
    h = x.clone()
    hier.all_reduce(h).wait()
    flat = x.clone()
    dist.all_reduce(flat)
    # Every left-to-right chain of the 4 terms, in any rank order (a ring's accumulation).
    chains = []
    for a in range(WS):
        for b in range(WS):
            for c in range(WS):
                d = 6 - a - b - c
                if len({a, b, c, d}) == 4:
                    chains.append(((xs[a] + xs[b]) + xs[c]) + xs[d])
    flat_is_chain = bool(torch.stack([flat == c for c in chains]).any(0).all())
    one_node = HierChannel(None, 1, torch.device("cpu"), None)   # G = 4: 4-row node sum
    h1 = x.clone()
    one_node.all_reduce(h1).wait()
    hier.close()
    one_node.close()
    return {"hier_pairs": torch.equal(h, pairs), "flat_pairs": torch.equal(flat, pairs),
            "flat_is_chain": flat_is_chain, "flat_hier_diff": (flat - h).abs().max().item(),
            "one_node_chain": torch.equal(h1, chain)}


def refused(build: Any) -> tuple[str, str] | None:
    try:
        build()
    except UsbyteError as e:
        return type(e).__name__, str(e)
    return None


def play(rank: int, ws: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = SmallCNN()
    flat = flat_schedule(model)
    mixed = with_hier(flat, lambda i: i % 2 == 0)
    all_hier = with_hier(flat, lambda i: True)
    out["blocks"] = [(b.end - b.start, b.hier) for b in mixed.blocks]

    os.environ.update(one_node_env(rank))
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    path = os.path.join(folder, "hier.json")
    if rank == 0:
        save_schedule(mixed, path)
    dist.barrier()
    m = SmallCNN()
    out["refuse_lws"] = refused(lambda: DistributedOptimizer(sgd(m), m, schedule=path))
    os.environ.update(two_node_env(rank))
    if rank == 3:
        os.environ["GROUP_RANK"] = "0"
    out["refuse_group_rank"] = refused(lambda: DistributedOptimizer(sgd(m), m, schedule=path))
    os.environ.update(two_node_env(rank))

    nodes_only = dataclasses.replace(flat, nodes=NODES)
    opt = DistributedOptimizer(sgd(m), m, schedule=nodes_only, verify=False)
    out["flat_groups"] = opt._chan.hier is not None
    out["flat_digest"] = nodes_only.digest() == flat.digest()
    out["hier_digest"] = mixed.digest() != flat.digest()
    opt.close()

    out["overlap"] = train(mixed, rank, Mode.OVERLAP)
    out["fence"] = train(mixed, rank, Mode.FENCE)
    out["all_hier"] = train(all_hier, rank, Mode.OVERLAP)
    out["orders"] = sum_orders(rank)

    # Last (it leaves the groups broken): rank 3 never issues; the others time out.
    opt = DistributedOptimizer(sgd(m), m, schedule=all_hier, verify=False, timeout=2.0)
    x, y = image_batch(rank, 0)
    if rank != 3:
        F.mse_loss(m(x), y).backward()
        try:
            opt.step()
            opt.synchronize()
            out["lost_peer"] = None
        except DistributedError as e:
            out["lost_peer"] = str(e)
    return out


@pytest.fixture(scope="module")
def played() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        return values(run_local(play, WS, args=(folder,), timeout_s=120, pg_timeout_s=30))


def test_schedule_mixes_flat_hier_and_odd_blocks(played):
    blocks = played[0]["blocks"]
    assert any(h for _, h in blocks) and any(not h for _, h in blocks)
    assert any(h and n % G for n, h in blocks)   # a hierarchical block padded to G


@pytest.mark.parametrize("case", ["overlap", "fence", "all_hier"])
def test_equals_ddp_within_rounding(played, case):
    for r in played:
        res = r[case]
        assert res["groups"]
        assert res["diff"] <= REL_TOL * res["scale"], res
    # Bitwise or not, the same on every rank (the all-gather gives every rank the same sums).
    assert len({r[case]["diff"] for r in played}) == 1
    print(f"{case}: max |diff| {played[0][case]['diff']:.3g}, bitwise {played[0][case]['bitwise']}")


def test_sum_orders(played):
    for r in played:
        o = r["orders"]
        assert o["hier_pairs"]          # (g0 + g1) + (g2 + g3), bitwise
        assert o["flat_is_chain"]       # gloo's ring: ((a + b) + c) + d per element
        assert not o["flat_pairs"]      # ... so not the hierarchical association everywhere
        assert 0 < o["flat_hier_diff"] < 1e-5
        assert o["one_node_chain"]      # one node of 4: rows added in local-rank order


def test_flat_schedule_makes_no_group_and_keeps_its_digest(played):
    for r in played:
        assert not r["flat_groups"]
        assert r["flat_digest"] and r["hier_digest"]


def one_line(res: tuple[str, str] | None) -> str:
    assert res is not None
    assert "\n" not in res[1] and "Traceback" not in res[1]
    return res[1]


def test_refused_on_every_rank(played):
    for r in played:
        msg = one_line(r["refuse_lws"])
        assert r["refuse_lws"][0] == MismatchError.__name__
        assert "hier.json: nodes: expected 1 to match this launch" in msg
        assert "LOCAL_WORLD_SIZE 4" in msg
        msg = one_line(r["refuse_group_rank"])
        assert "hier.json: nodes: expected rank 3 on node 1" in msg and "GROUP_RANK is 0" in msg
    assert played[3]["refuse_group_rank"][0] == MismatchError.__name__
    for r in played[:3]:   # the others name the rank that failed
        assert r["refuse_group_rank"][0] == DistributedError.__name__
        assert "rank 3 failed its start-up check" in r["refuse_group_rank"][1]


def test_lost_peer_fails_in_one_line(played):
    for rank in range(3):
        msg = one_line((DistributedError.__name__, played[rank]["lost_peer"]))
        assert msg.startswith(f"rank {rank}: all-reduce of block ")
        assert "inside node" in msg or "across nodes" in msg


def test_refused_before_any_collective():
    """What the start-up checks refuse (:func:`check_hierarchy`, run on every rank before the
    schedules are agreed, and again at install): nodes not dividing the world size, one rank
    per node, a hierarchical block in sharded mode (a schedule file cannot have one; one built
    in code can)."""
    torch.manual_seed(0)
    mixed = with_hier(flat_schedule(SmallCNN()), lambda i: i % 2 == 0)
    env = two_node_env(0)
    with pytest.raises(MismatchError, match=r"^s.json: nodes: expected a divisor of the world "
                                            r"size \(4\) that leaves several ranks on each "
                                            r"node, for its hierarchical blocks, got 3$"):
        check_hierarchy(dataclasses.replace(mixed, world_size=6, nodes=3), 4, "s.json", env, 0)
    with pytest.raises(MismatchError, match="got 4$"):
        check_hierarchy(dataclasses.replace(mixed, nodes=4), 4, "s.json", env, 0)
    with pytest.raises(MismatchError, match=r"^<default schedule>: blocks\[0\].hier: expected "
                                            "false in sharded mode"):
        check_hierarchy(dataclasses.replace(mixed, mode=Mode.SHARDED), 4, "<default schedule>",
                        env, 0)
    check_hierarchy(mixed, 4, "s.json", env, 0)
    check_hierarchy(mixed, 4, "s.json", {}, 3)                       # no torchrun variables
    check_hierarchy(mixed, 4, "s.json", one_node_env(0), 0, whole_world=False)  # a subgroup
    flat = flat_schedule(SmallCNN())
    check_hierarchy(dataclasses.replace(flat, nodes=2), 4, "s.json", one_node_env(0), 0)
