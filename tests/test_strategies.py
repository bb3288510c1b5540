"""The baseline strategies: hand-computed timelines, bucket and merge rules, and properties.

Units throughout: alpha in ms, ``algbw_gbs=1.0`` means 1e6 bytes per ms, so a float32 tensor of
250_000 elements (1 MB) costs ``alpha + 1`` ms.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from usbyte_opt.formats import Block, CommSpec, Profile, TensorSpec
from usbyte_opt.planning.fastsim import evaluate
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.simulate import simulate_blocks
from usbyte_opt.planning.strategies import STRATEGIES, bytescheduler, ddp, mgwfbp, usbyte, wfbp
from usbyte_opt.planning.synthetic import chain_profile, random_profile

MB = 250_000          # float32 elements in 1e6 bytes
MiB = 1 << 20


def problem(tensors, F, B, alpha=1.0, algbw=1.0) -> Problem:
    """``tensors``: (name, numel or shape, ready_ms, need_ms[, dtype])."""
    specs = []
    for t in tensors:
        name, size, ready, need = t[:4]
        dtype = t[4] if len(t) > 4 else "float32"
        shape = size if isinstance(size, tuple) else (size,)
        specs.append(TensorSpec(name, shape, dtype, float(ready), float(need)))
    return Problem.from_profile(Profile("hand", float(F), float(B), tuple(specs),
                                        CommSpec("analytic", 2, alpha, algbw)))


def spans(blocks):
    return [(k.buffer, k.start, k.end) for k in blocks]


# A three-layer chain: "out" is ready first and needed last.
#   out: 1 MB, ready 2, need 3 | mid: 2 MB, ready 4, need 1 | in: 1 MB, ready 6, need 0
#   B = 6, F = 4, alpha = 1 ms.
#   Layout (ready order): out [0, 250k), mid [250k, 750k), in [750k, 1M).
THREE = [("in", MB, 6, 0), ("mid", 2 * MB, 4, 1), ("out", MB, 2, 3)]


# --------------------------------------------------------------------------------------------
# WFBP
# --------------------------------------------------------------------------------------------


def test_wfbp_one_block_per_tensor_in_ready_order_exact_time():
    pb = problem(THREE, F=4, B=6)
    p = wfbp.plan(pb)
    assert p.mode == "fence"
    assert spans(p.blocks) == [(0, 0, MB), (0, MB, 3 * MB), (0, 3 * MB, 4 * MB)]
    # out: 2 -> 4 (1 + 1 ms); mid: max(4, 4) -> 4 + 3 = 7; in: max(6, 7) -> 7 + 2 = 9.
    # Fence: T = max(B, 9) + sum(update) + F = 9 + 0 + 4 = 13.
    assert evaluate(pb, p.layout, p.blocks, "fence") == pytest.approx(13.0)
    tl = simulate_blocks(pb, p.layout, p.blocks, "fence")
    assert [(b.start_ms, b.finish_ms) for b in tl.blocks] == [(2, 4), (4, 7), (7, 9)]


# --------------------------------------------------------------------------------------------
# DDP
# --------------------------------------------------------------------------------------------


def test_ddp_buckets_first_1mib_then_25mib_per_dtype():
    # float32 t0..t6 and float16 f0, f1, interleaved in ready order:
    #   t0(1) t1(2) f0(2.5) t2(3) f1(3.5) t3(4) t4(5) t5(6) t6(7)
    half, ten = MiB // 8, 10 * MiB // 4           # 0.5 MiB and 10 MiB of float32
    ts = [("t0", half, 1, 8), ("t1", half, 2, 7), ("f0", MiB // 2, 2.5, 6.5, "float16"),
          ("t2", half, 3, 6), ("f1", 1000, 3.5, 5.5, "float16"), ("t3", ten, 4, 5),
          ("t4", ten, 5, 4), ("t5", ten, 6, 3), ("t6", 1000, 7, 2)]
    pb = problem(ts, F=9, B=7)
    p = ddp.plan(pb)
    assert p.mode == "fence"
    o = [0, half, 2 * half, 3 * half, 3 * half + ten, 3 * half + 2 * ten, 3 * half + 3 * ten]
    assert spans(p.blocks) == [
        (0, 0, o[2]),              # t0 + t1 = 1 MiB: reaches the 1 MiB cap (>=) and closes
        (1, 0, MiB // 2),          # f0 = 1 MiB: float16 has its own first 1 MiB bucket
        (0, o[2], o[6]),           # t2..t5 = 30.5 MiB: closes once it reaches 25 MiB
        (1, MiB // 2, MiB // 2 + 1000),   # leftovers, in the order they complete: f1 (3.5)
        (0, o[6], o[6] + 1000),            # then t6 (7)
    ]
    # A larger first bucket takes t0..t3 (11.5 MiB >= 2 MiB), then t4 + t5 (20 < 25) + t6.
    p2 = ddp.plan(pb, first_bucket_mb=2.0)
    assert spans(p2.blocks)[0] == (0, 0, o[4])
    assert spans(p2.blocks)[-1] == (0, o[4], o[6] + 1000)


def test_ddp_exact_time_and_cap_option():
    pb = problem(THREE, F=4, B=6)
    # out (0.95 MiB) < 1 MiB; + mid = 2.86 MiB >= 1 MiB closes [out, mid]; "in" is left over.
    p = ddp.plan(pb)
    assert spans(p.blocks) == [(0, 0, 3 * MB), (0, 3 * MB, 4 * MB)]
    # [out, mid] ready 4: 4 -> 4 + 1 + 3 = 8; in: max(6, 8) -> 8 + 2 = 10. T = 10 + 4 = 14.
    assert evaluate(pb, p.layout, p.blocks, "fence") == pytest.approx(14.0)
    # with a 10 MiB cap for every bucket, the whole 3.8 MiB model is one bucket
    assert len(ddp.plan(pb, first_bucket_mb=10, bucket_cap_mb=10).blocks) == 1
    with pytest.raises(ValueError):
        ddp.plan(pb, bucket_cap_mb=0)


# --------------------------------------------------------------------------------------------
# MG-WFBP
# --------------------------------------------------------------------------------------------


def test_mgwfbp_merges_when_wait_below_alpha_and_it_pays():
    # c ready 1; a ready 8; b ready 8.5 (= B). alpha 1, every tensor 1 MB (2 ms).
    pb = problem([("b", MB, 8.5, 0), ("a", MB, 8, 1), ("c", MB, 1, 2)], F=3, B=8.5)
    p = mgwfbp.plan(pb)
    # c alone: its group starts at 1; a is ready 7 ms later (>= alpha): close c, channel
    # free at 3. a's group starts at max(3, 8) = 8; b is ready 0.5 ms later (< alpha): merge.
    assert spans(p.blocks) == [(0, 0, MB), (0, MB, 3 * MB)]
    # c: 1 -> 3; [a, b] ready 8.5: 8.5 -> 8.5 + 1 + 2 = 11.5; T = 11.5 + F = 14.5
    assert evaluate(pb, p.layout, p.blocks, "fence") == pytest.approx(14.5)
    # WFBP: a 8 -> 10, b 10 -> 12: T = 15. Merging saved half an alpha.
    w = wfbp.plan(pb)
    assert evaluate(pb, w.layout, w.blocks, "fence") == pytest.approx(15.0)


def test_mgwfbp_keeps_apart_when_wait_exceeds_alpha():
    # as above, but b is ready 2 ms after a (>= alpha): no merge, same plan as WFBP
    pb = problem([("b", MB, 10, 0), ("a", MB, 8, 1), ("c", MB, 1, 2)], F=3, B=10)
    p = mgwfbp.plan(pb)
    assert spans(p.blocks) == spans(wfbp.plan(pb).blocks)
    # a: 8 -> 10, b: 10 -> 12, T = 15; merged, [a, b] would run 10 -> 13, T = 16.
    assert evaluate(pb, p.layout, p.blocks, "fence") == pytest.approx(15.0)
    merged = [Block(0, 0, MB), Block(0, MB, 3 * MB)]
    assert evaluate(pb, p.layout, merged, "fence") == pytest.approx(16.0)


def test_mgwfbp_merges_when_the_channel_is_still_busy():
    # c (10 MB, 11 ms) ready 1 holds the channel until 12; a ready 5 and b ready 8 are far
    # apart (3 ms > alpha), but a's all-reduce could not start before b is ready: merge.
    pb = problem([("b", MB, 8, 0), ("a", MB, 5, 1), ("c", 10 * MB, 1, 2)], F=3, B=8)
    p = mgwfbp.plan(pb)
    assert spans(p.blocks) == [(0, 0, 10 * MB), (0, 10 * MB, 12 * MB)]
    # c: 1 -> 12; [a, b]: 12 -> 15. T = 15 + 3 = 18 (WFBP: 12 -> 14 -> 16, T = 19)
    assert evaluate(pb, p.layout, p.blocks, "fence") == pytest.approx(18.0)


def test_mgwfbp_never_merges_across_dtypes():
    pb = problem([("b", MB, 8.5, 0, "float16"), ("a", MB, 8, 1), ("c", MB, 1, 2)], F=3, B=8.5)
    p = mgwfbp.plan(pb)
    assert len(p.blocks) == 3


# --------------------------------------------------------------------------------------------
# ByteScheduler
# --------------------------------------------------------------------------------------------


def test_bytescheduler_partitions_whole_rows_evenly():
    assert bytescheduler.partition_tensor(1000, 1000, 1000) == [1000]     # not above P: whole
    assert bytescheduler.partition_tensor(1001, 1001, 1000) == [500, 501]
    # 10 rows of 100: ceil(1000 / 300) = 4 pieces of 2, 2, 3, 3 rows
    assert bytescheduler.partition_tensor(1000, 10, 300) == [200, 200, 300, 300]
    # never more pieces than rows
    assert bytescheduler.partition_tensor(1000, 2, 100) == [500, 500]
    pb = problem([("w", (10, 100), 1, 0), ("v", 7, 0.5, 1)], F=1, B=1)
    p = bytescheduler.plan(pb, partition=300, credit=1e9)
    # v (ready 0.5) first, then w's four pieces in partition order
    assert spans(p.blocks) == [(0, 0, 7), (0, 7, 207), (0, 207, 407), (0, 407, 707),
                               (0, 707, 1007)]


def _replay_every_event(parts, credit):
    """ByteScheduler's credit loop stepped through every release and every finish, with a
    heap of priorities: the reference that :func:`bytescheduler.replay`'s shortcuts must
    equal (issue order, and whether the credit ever held a ready partition back)."""
    import heapq
    import math
    from collections import deque

    rank = {p: r for r, p in enumerate(parts.by_key)}
    ready = parts.ready
    by_ready = sorted(range(len(parts)), key=lambda p: (ready[p], rank[p]))
    heap, outstanding, out = [], deque(), []
    left, last_fin, t, j, held = credit, 0.0, 0.0, 0, False
    n = len(by_ready)
    while len(out) < n:
        while j < n and ready[by_ready[j]] <= t:
            heapq.heappush(heap, rank[by_ready[j]])
            j += 1
        while outstanding and outstanding[0][0] <= t:
            left = min(credit, left + outstanding.popleft()[1])
        while heap and left > 0:
            p = parts.by_key[heapq.heappop(heap)]
            left -= parts.size[p]
            last_fin = max(last_fin, t) + parts.cost[p]
            outstanding.append((last_fin, parts.size[p]))
            out.append(p)
        held = held or bool(heap)
        nf = outstanding[0][0] if outstanding else math.inf
        r_next = ready[by_ready[j]] if j < n else math.inf
        t = min(r_next, nf)
    return out, held


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 40))
def test_bytescheduler_replay_shortcuts_give_every_event_order(seed, n):
    # the replay jumps over releases while the credit is spent and appends the rest in
    # priority order once everything is released: the same order and held flag as stepping
    # through every event (partitions up to 10 per tensor, credits of 0 to 5 partitions)
    pb = Problem.from_profile(random_profile(random.Random(seed), n))
    lay = pb.layout()
    tail = [u + pb.F - nd for u, nd in zip(pb.update, pb.need)]
    for cuts in (1, 3, 10):
        P = max(1, max(pb.numel) // cuts)
        parts = bytescheduler._Parts(pb, lay, P, tail)
        for C in (1, 0.5 * P, P, 2 * P, 5 * P, 1e18):
            info: dict = {}
            got = bytescheduler.replay(parts, C, info)
            assert (got, info["held"]) == _replay_every_event(parts, C), (P, C)


def test_bytescheduler_credit_lets_later_high_priority_overtake():
    # out (2 MB, ready 0, needed last), mid (1 MB, ready 1), in (1 MB, ready 2, needed first).
    # P = 1 MB: out is cut in two 2 ms pieces. Layout: out [0, 2MB), mid, in.
    pb = problem([("in", MB, 2, 0), ("mid", MB, 1, 1), ("out", 2 * MB, 0, 3)], F=4, B=2)
    # Credit of one piece: at 0, out.0 is dispatched (credit 0) and runs 0 -> 2; out.1 waits.
    # At 2, out.0 returns its credit and "in" (ready 2, top priority) goes: 2 -> 4; then mid
    # 4 -> 6, out.1 6 -> 8. Tails F - need: out 1, mid 3, in 4.
    # T = max(B + F = 6, 2 + 1, 4 + 4, 6 + 3, 8 + 1, 8) = 9.
    small = bytescheduler.plan(pb, partition=MB, credit=MB)
    assert spans(small.blocks) == [(0, 0, MB), (0, 3 * MB, 4 * MB), (0, 2 * MB, 3 * MB),
                                   (0, MB, 2 * MB)]
    assert small.info["iteration_ms"] == pytest.approx(9.0)
    # A large credit dispatches pieces as they become ready: out.0, out.1, mid, in
    # (0 -> 2 -> 4 -> 6 -> 8); "in" finishes at 8, T = 8 + 4 = 12.
    big = bytescheduler.plan(pb, partition=MB, credit=64e6)
    assert spans(big.blocks) == [(0, 0, MB), (0, MB, 2 * MB), (0, 2 * MB, 3 * MB),
                                 (0, 3 * MB, 4 * MB)]
    assert big.info["iteration_ms"] == pytest.approx(12.0)
    for p in (small, big):
        assert evaluate(pb, p.layout, p.blocks) == pytest.approx(p.info["iteration_ms"])


def test_bytescheduler_tuning_is_the_best_of_its_grid():
    pb = Problem.from_profile(random_profile(random.Random(3), 40, comm_ratio=1.5))
    p = bytescheduler.plan(pb, grid_points=3)
    grid = [(P, C) for P in bytescheduler.log_grid(2e6, 32e6, 3)
            for C in bytescheduler.log_grid(4e6, 64e6, 3)]
    best = min(bytescheduler.plan(pb, partition=P, credit=C).info["iteration_ms"] for P, C in grid)
    assert p.info["iteration_ms"] == pytest.approx(best)
    assert bytescheduler.PARTITION_RANGE == (2_000_000, 32_000_000)
    assert bytescheduler.CREDIT_RANGE == (4_000_000, 64_000_000)


# --------------------------------------------------------------------------------------------
# Properties of every strategy
# --------------------------------------------------------------------------------------------

MODULES = {"wfbp": wfbp, "ddp": ddp, "mgwfbp": mgwfbp, "bytescheduler": bytescheduler,
           "usbyte": usbyte}
#: The mode each strategy's schedules run in.
NATIVE_MODES = {"wfbp": "fence", "ddp": "fence", "mgwfbp": "fence", "bytescheduler": "overlap",
                "usbyte": "overlap"}


def test_registered_with_native_modes():
    pb = Problem.from_profile(chain_profile([1000, 2000, 3000]))
    assert {n: STRATEGIES[n].plan(pb).mode for n in MODULES} == {
        "wfbp": "fence", "ddp": "fence", "mgwfbp": "fence", "bytescheduler": "overlap",
        "usbyte": "overlap"}
    for n, mod in MODULES.items():
        assert STRATEGIES[n].plan is mod.plan


profiles = st.builds(
    lambda seed, n, ratio, alpha, dts: random_profile(random.Random(seed), n, comm_ratio=ratio,
                                                      alpha_ms=alpha, dtypes=dts),
    st.integers(0, 10 ** 6), st.integers(1, 30), st.sampled_from([0.2, 1.0, 3.0]),
    st.sampled_from([0.0, 0.05, 1.3]),
    st.sampled_from([("float32",), ("float32", "float16"), ("float32", "bfloat16", "float16")]))


@settings(max_examples=40, deadline=None)
@given(profiles)
def test_every_strategy_covers_each_buffer_once_and_scores_consistently(prof):
    pb = Problem.from_profile(prof)
    for name, mod in MODULES.items():
        p = mod.plan(pb)
        assert p.mode == NATIVE_MODES[name]
        assert all(k.end > k.start for k in p.blocks), name
        pb.schedule(name, p.layout, p.blocks, check=True)      # raises unless exact cover
        for mode in ("overlap", "fence"):
            fast = evaluate(pb, p.layout, p.blocks, mode)
            full = simulate_blocks(pb, p.layout, p.blocks, mode).iteration_ms
            assert fast == pytest.approx(full, rel=1e-12, abs=1e-9), (name, mode)
        if "iteration_ms" in p.info:
            assert p.info["iteration_ms"] == pytest.approx(
                evaluate(pb, p.layout, p.blocks, p.mode), rel=1e-12, abs=1e-9), name
        lay = p.layout
        for k in p.blocks:
            touched = lay.tensors_of(k.buffer, k.start, k.end)
            if name in ("wfbp", "ddp", "mgwfbp"):      # whole tensors only
                assert k.start == lay.pos[touched[0]][1] and k.end == lay.pos[touched[-1]][2]
            else:                                      # never fused: inside one tensor
                assert len(touched) == 1, name
        assert len(wfbp.plan(pb).blocks) == pb.n


def test_chain_ranking_where_communication_matters():
    # comm ~ compute on a chain of layers: the overlap schedulers beat WFBP's fence
    rng = random.Random(5)
    sizes = [int(10 ** rng.uniform(4, 6.5)) for _ in range(50)]
    algbw = sum(sizes) * 4 / 30.0 / 1e6                 # all-reduce time ~ B + F = 30 ms
    pb = Problem.from_profile(chain_profile(sizes, forward_ms=10, backward_ms=20, alpha_ms=0.05,
                                            algbw_gbs=algbw))
    T = {}
    for name, mod in MODULES.items():
        p = mod.plan(pb)
        T[name] = evaluate(pb, p.layout, p.blocks, p.mode)
    assert T["usbyte"] < T["bytescheduler"] < T["wfbp"]
