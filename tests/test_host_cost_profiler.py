"""The profiler's host-cost probe (:mod:`usbyte_opt.profiler.host`): the section it writes,
the fit, the verdict across ranks, the CUDA launch-bound check (on fake CUDA events here) and a
probe that fails."""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch

from usbyte_opt.formats import HostCost, load_profile, save_profile
from usbyte_opt.profiler import ProfileOptions, ProfileWarning, profile_model
from usbyte_opt.profiler import host as host_mod
from usbyte_opt.profiler.host import HostProbe, fit, launch_bound, to_host_cost

QUICK = ProfileOptions(warmup=1, repeats=2)


def test_one_rank_profile_has_a_measured_host_section(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile_model("mlp", 4, QUICK)
    h = prof.host
    assert h is not None and not h.defaulted and h.launch_bound      # CPU: on the critical path
    for v in (h.runtime_tensor_us, h.runtime_block_us, h.ddp_tensor_us, h.ddp_bucket_us):
        assert 0 <= v < 10_000
    rec = prof.meta["host_probe"]
    assert rec["tensors"] == 2 * host_mod.LAYERS and rec["rounds"] == host_mod.ROUNDS
    assert sorted(rec["per_rank"][0]["rounds_us"]) == sorted(host_mod.ARMS)
    assert all(len(v) == host_mod.ROUNDS for v in rec["per_rank"][0]["rounds_us"].values())
    save_profile(prof, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").host == h


def test_without_the_probe_the_profile_has_no_section_and_reads_with_the_defaults(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile_model("mlp", 4, ProfileOptions(warmup=1, repeats=2, host_probe=False))
    assert prof.host is None and "host_probe" not in prof.meta
    save_profile(prof, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").host == HostCost.default("cpu")


def test_a_probe_that_fails_leaves_the_defaults_and_says_why(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no runtime here")

    monkeypatch.setattr(host_mod, "host_cost", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = profile_model("mlp", 4, QUICK)
    said = [str(w.message) for w in caught if issubclass(w.category, ProfileWarning)]
    assert "host cost not measured (RuntimeError: no runtime here); the planner's defaults apply " \
           "(docs/profiles.md)" in said
    assert prof.host is None and prof.meta["warnings"][-1] == said[-1]


def test_fit_takes_each_rounds_differences_then_their_median():
    n = 11
    rounds = {"plain": [100.0, 100.0, 400.0], "runtime-1": [240.0, 240.0, 540.0],
              "runtime-n": [540.0, 540.0, 840.0], "ddp-1": [150.0, 160.0, 450.0],
              "ddp-n": [250.0, 260.0, 900.0]}
    got = fit(rounds, n)
    assert got["runtime_block_us"] == pytest.approx(30.0)     # 300 / 10 each round
    assert got["runtime_tensor_us"] == pytest.approx(10.0)    # (140 - 30) / 11
    assert got["ddp_bucket_us"] == pytest.approx(10.0)        # 10, 10, 45: the median
    # noise below the plain loop is no negative cost; a torch without per-tensor buckets: 0
    assert fit({"plain": [100.0], "runtime-1": [90.0], "runtime-n": [80.0], "ddp-1": [100.0]}, n) == {
        "runtime_block_us": 0.0, "runtime_tensor_us": 0.0, "ddp_bucket_us": 0.0, "ddp_tensor_us": 0.0}


def test_the_section_is_the_slowest_rank_and_launch_bound_where_any_rank_is():
    a, b = HostProbe(96, {}, 8.0, 45.0, 1.0, 6.0), HostProbe(96, {}, 9.0, 40.0, 1.2, 5.0)
    cuda = torch.device("cuda", 0)
    host, rec = to_host_cost([a, b], [False, True], cuda, "nccl")
    assert (host.runtime_tensor_us, host.runtime_block_us, host.ddp_tensor_us, host.ddp_bucket_us) == \
        (9.0, 45.0, 1.2, 6.0)
    assert host.launch_bound and "CUDA events" in host.method and len(rec["per_rank"]) == 2
    assert not to_host_cost([a, b], [False, None], cuda, "nccl")[0].launch_bound
    unknown = to_host_cost([a], [None], cuda, "nccl")[0]
    assert unknown.launch_bound and "assumed" in unknown.method
    assert to_host_cost([a], [None], torch.device("cpu"), "gloo")[0].launch_bound


class FakeEvent:
    """A CUDA event on the host clock (the GPU's time is then what the host spent)."""

    def __init__(self, enable_timing: bool = False):
        self.t = 0.0

    def record(self, stream: object = None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: time.sleep(0.002), raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


def test_launch_bound_on_cuda_compares_host_and_gpu_time(fake_cuda):
    def step() -> None:
        time.sleep(0.003)

    bound, rec = launch_bound(step, torch.device("cuda", 0), repeats=3)
    assert isinstance(bound, bool) and rec["samples"] == 3
    assert rec["host_ms"] >= 3.0 and rec["gpu_ms"] >= 3.0 and rec["sleep_ms"] >= 5.0
    assert launch_bound(step, torch.device("cpu")) == (None, {"method": rec["method"]})


def test_launch_bound_cannot_tell_an_iteration_that_waits_for_the_gpu(fake_cuda):
    calls = []

    def step() -> None:      # fast while timed alone, then as long as the GPU's sleep and more
        calls.append(1)
        time.sleep(0.001 if len(calls) <= 2 else 0.03)

    bound, rec = launch_bound(step, torch.device("cuda", 0), repeats=2)
    assert bound is None and rec["samples"] == 0 and "waits for the GPU" in rec["note"]
