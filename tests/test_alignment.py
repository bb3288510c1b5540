"""16-byte alignment for NCCL: the planner cuts tensors on 16-byte multiples of their start
for a profile measured on NCCL, and the runtime's CUDA buffers start every tensor there."""

from __future__ import annotations

import dataclasses
import random

from usbyte_opt.planning.planner import compare
from usbyte_opt.planning.problem import NCCL_ALIGN_BYTES, Problem
from usbyte_opt.planning.synthetic import random_profile


def _nccl(profile):
    return dataclasses.replace(profile, comm=dataclasses.replace(profile.comm, backend="nccl"))


def _interior_cuts(problem: Problem, schedule) -> list[tuple[int, int]]:
    """(offset from the tensor's start, itemsize) of every block boundary inside a tensor."""
    lay = problem.layout(schedule.buffers)
    cuts = []
    for k in schedule.blocks:
        for o in (k.start, k.end):
            for t in lay.members[k.buffer]:
                _, lo, hi = lay.pos[t]
                if lo < o < hi:
                    cuts.append((o - lo, lay.itemsize[k.buffer]))
    return cuts


def test_cuts_inside_tensors_are_16_byte_multiples_for_an_nccl_profile():
    rng = random.Random(3)
    seen = 0
    for case in range(6):
        prof = _nccl(random_profile(rng, 12, comm_ratio=2.0, dtypes=("float32", "bfloat16")))
        report = compare(prof, ["bytescheduler", "usbyte", "best"])
        problem = Problem.from_profile(prof)
        for name in report.results:
            sched = report.schedule(name)
            for off, size in _interior_cuts(problem, sched):
                seen += 1
                assert (off * size) % NCCL_ALIGN_BYTES == 0, (case, name, off, size)
    assert seen > 0, "no strategy cut a tensor: the check checked nothing"


def test_a_gloo_profile_keeps_its_cuts_where_the_strategy_put_them():
    prof = random_profile(random.Random(3), 12, comm_ratio=2.0)
    problem = Problem.from_profile(prof)
    lay = problem.layout()
    b, lo, hi = lay.pos[max(range(problem.n), key=lambda i: problem.numel[i])]
    from usbyte_opt.formats import Block

    blocks = [Block(b, 0, lo + 3), Block(b, lo + 3, lay.numel[b])]
    assert problem.schedule("x", lay, blocks).blocks == tuple(blocks)
    moved = Problem.from_profile(_nccl(prof)).schedule("x", lay, blocks).blocks
    assert moved == (Block(b, 0, lo + 4), Block(b, lo + 4, lay.numel[b]))
