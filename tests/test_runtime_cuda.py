"""The NCCL path on one GPU (world size 1): streams, update stream, AMP, fence mode.

Skipped without CUDA (``benchmarks/gpu_check.py`` runs them on a lent GPU). With one rank the
all-reduce is an identity, so the reference is the plain optimizer. What these tests catch:
stream handling that corrupts values (stream waits instead of host waits, gradients finished
on side streams, updates enqueued on the update stream and waited for by the forward's
events), AMP paths (GradScaler with a host verdict, or a fused optimizer given ``found_inf``),
fence mode, ``channels_last`` gradient views. What they cannot catch: anything that needs a
second rank (issue order across ranks, a race with a transfer that takes time); the gloo
two-rank part of ``gpu_check.py`` covers the latter over gloo's CUDA transport.

The comparisons are bitwise, so the run is deterministic: ``CUBLAS_WORKSPACE_CONFIG`` is set
before CUDA starts, and each test runs under ``torch.use_deterministic_algorithms`` with
cuDNN's benchmark off (both runs then pick the same kernels).
"""

from __future__ import annotations

import copy
import dataclasses
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before cuBLAS starts

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from usbyte_opt.planning.problem import Problem
from usbyte_opt.runtime import DistributedOptimizer, profile_from_model, split_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 10


@pytest.fixture
def nccl(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    det, bench = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    request_restore = (det, bench)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()
    torch.use_deterministic_algorithms(request_restore[0])
    torch.backends.cudnn.benchmark = request_restore[1]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()


def schedule(m: nn.Module):
    pb = Problem.from_profile(profile_from_model(m))
    lay = pb.layout()
    return pb.schedule("split", lay, split_blocks(pb, lay, 3, pb.need_order()))


def batch(step: int):
    g = torch.Generator(device="cuda").manual_seed(step)
    return (torch.randn(8, 3, 8, 8, device="cuda", generator=g),
            torch.randint(0, 10, (8,), device="cuda", generator=g))


def assert_same(a: nn.Module, b: nn.Module, tol: float = 0.0) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p - q).abs().max().item() <= tol, n


def test_matches_plain_optimizer(nccl):
    ref = model()
    m = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt = DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1), m,
                               schedule=schedule(m))
    for step in range(STEPS):
        x, y = batch(step)
        nn.functional.cross_entropy(ref(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward(); opt.step(); opt.zero_grad()
    opt.synchronize()
    assert_same(ref, m)


def test_side_stream_training(nccl):
    ref = model()
    m = copy.deepcopy(ref)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), m,
                               schedule=schedule(m))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for step in range(STEPS):
        x, y = batch(step)
        nn.functional.cross_entropy(ref(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        side.wait_stream(torch.cuda.current_stream())   # the batch was made on the default one
        x.record_stream(side); y.record_stream(side)     # and is freed there, next iteration
        with torch.cuda.stream(side):
            nn.functional.cross_entropy(m(x), y).backward(); opt.step(); opt.zero_grad()
    with torch.cuda.stream(side):
        opt.synchronize()
    torch.cuda.current_stream().wait_stream(side)
    assert_same(ref, m)


def test_bf16_autocast(nccl):
    ref = model()
    m = copy.deepcopy(ref)
    o_ref = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt = DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-3), m, schedule=schedule(m))
    for step in range(STEPS):
        x, y = batch(step)
        for net, o in ((ref, o_ref), (m, opt)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(net(x), y)
            loss.backward(); o.step(); o.zero_grad()
    opt.synchronize()
    assert_same(ref, m)


@pytest.mark.parametrize("mode", ["overlap", "fence"])
@pytest.mark.parametrize("fused", [False, True])
def test_grad_scaler_fp16(nccl, fused, mode):
    """A non-finite step is skipped as by the plain optimizer; a fused optimizer skips it on the
    device, in either mode (the runtime hands it the scaler's found_inf instead of reading it
    on the host)."""
    ref = model()
    m = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=fused)
    opt = DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused), m,
                               schedule=dataclasses.replace(schedule(m), mode=mode))
    s_ref = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12, growth_interval=3)
    s_usb = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12, growth_interval=3)
    for step in range(STEPS):
        x, y = batch(step)
        if step == 4:
            x = x * float("inf")
        for net, o, sc in ((ref, o_ref, s_ref), (m, opt, s_usb)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(net(x), y)
            sc.scale(loss).backward()
            sc.step(o)
            sc.update()
            o.zero_grad()
    opt.synchronize()
    assert s_ref.get_scale() == s_usb.get_scale()
    assert_same(ref, m)


def test_grad_scaler_unscale_then_clip(nccl):
    ref = model()
    m = copy.deepcopy(ref)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), m, schedule=schedule(m))
    s_ref = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    s_usb = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    for step in range(STEPS):
        x, y = batch(step)
        for net, o, sc in ((ref, o_ref, s_ref), (m, opt, s_usb)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(net(x), y)
            sc.scale(loss).backward()
            sc.unscale_(o)          # reads param_groups: completes the all-reduce first
            nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            sc.step(o)
            sc.update()
            o.zero_grad()
    opt.synchronize()
    assert_same(ref, m)


def test_fence_mode_and_channels_last(nccl):
    ref = model().to(memory_format=torch.channels_last)
    m = copy.deepcopy(ref)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), m,
                               schedule=dataclasses.replace(schedule(m), mode="fence"))
    for step in range(STEPS):
        x, y = batch(step)
        x = x.to(memory_format=torch.channels_last)
        nn.functional.cross_entropy(ref(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        assert m[0].weight.grad.stride() == m[0].weight.stride()
        opt.step(); opt.zero_grad()
    opt.synchronize()
    assert_same(ref, m)


def test_updates_grouped_on_the_update_stream(nccl):
    """Overlap mode on CUDA: step() enqueues the updates in at most update_groups optimizer
    calls, whatever the number of modules."""
    ref = model()
    m = copy.deepcopy(ref)
    o_ref = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt = DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-3), m,
                               schedule=schedule(m), update_groups=3)
    for step in range(STEPS):
        x, y = batch(step)
        nn.functional.cross_entropy(ref(x), y).backward(); o_ref.step(); o_ref.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward(); opt.step(); opt.zero_grad()
    opt.synchronize()
    assert opt.optimizer_calls <= 3 * STEPS
    assert_same(ref, m)
