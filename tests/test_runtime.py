"""The runtime in one process (world size 1, gloo): plans, checks, buffers, misuse errors.

The multi-rank behaviour (equivalence with DDP, failures across ranks) is in
``test_runtime_equivalence.py`` and ``test_runtime_checks.py``.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from usbyte_opt.errors import FormatError, MismatchError, UsbyteError
from usbyte_opt.formats import save_schedule
from usbyte_opt.planning.problem import Problem
from usbyte_opt.planning.strategies.ddp import buckets as bucket_blocks
from usbyte_opt.runtime import (
    SCHEDULE_ENV,
    DistributedOptimizer,
    UsbyteWarning,
    default_schedule,
    model_tensors,
    profile_from_model,
    split_blocks,
)
from usbyte_opt.runtime.checks import check_model, resolve_schedule
from usbyte_opt.runtime.start import requested


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))


def split_schedule(model: nn.Module, pieces: int = 3):
    pb = Problem.from_profile(profile_from_model(model))
    lay = pb.layout()
    return pb.schedule("split", lay, split_blocks(pb, lay, pieces, pb.need_order()))


# ------------------------------------------------------------------------------------------
# Default plan
# ------------------------------------------------------------------------------------------


def test_profile_from_model_orders_and_skips_frozen():
    m = mlp()
    m[0].bias.requires_grad_(False)
    p = profile_from_model(m, world_size=8)
    names = [t.name for t in p.tensors]
    assert "0.bias" not in names and names[0] == "0.weight"
    assert [t.need_ms for t in p.tensors] == sorted(t.need_ms for t in p.tensors)
    assert [t.ready_ms for t in p.tensors] == sorted((t.ready_ms for t in p.tensors), reverse=True)
    assert p.comm.world_size == 8


def test_default_buckets_follow_ddp_caps():
    # 7 tensors of 0.75 MiB: first bucket closes at >= 1 MiB (2 tensors), then 25 MiB.
    m = nn.Sequential(*[nn.Linear(512, 384, bias=False) for _ in range(7)])
    s = default_schedule(m)
    sizes = [(k.end - k.start) * 4 / 2**20 for k in s.blocks]
    assert sizes == [1.5, 3.75]


def test_default_plan_one_buffer_per_dtype():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    s = default_schedule(m)
    assert [b.dtype for b in s.buffers] == ["bfloat16", "float32"]
    assert len(s.blocks) == 2


def test_bucket_blocks_small_caps_fuse_neighbours():
    pb = Problem.from_profile(profile_from_model(mlp()))
    lay = pb.layout()
    blocks = bucket_blocks(pb, lay, first_bucket_bytes=64, bucket_cap_bytes=300)
    assert 1 < len(blocks) < pb.n
    assert sum(k.end - k.start for k in blocks) == sum(pb.numel)


# ------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------


def test_check_model_names_missing_tensor():
    s = default_schedule(mlp())
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2),
                          nn.Linear(2, 2))
    with pytest.raises(MismatchError, match=r"s\.json was planned for the profile 'model'; this model "
                                            r"differs from it \(tensor '5\.weight': the model trains it"):
        check_model(s, model_tensors(other), "s.json")


def test_check_model_names_frozen_tensor():
    m = mlp()
    s = default_schedule(m)
    m[2].weight.requires_grad_(False)
    with pytest.raises(MismatchError, match=r"tensor '2\.weight' is not a trainable parameter"):
        check_model(s, model_tensors(m), "s.json")


def test_check_model_names_dtype():
    m = mlp()
    s = default_schedule(m)
    m[4].to(torch.float64)
    with pytest.raises(MismatchError, match=r"tensor '4\.weight': expected dtype float32 .* got "
                                            r"float64"):
        check_model(s, model_tensors(m), "s.json")


def test_check_model_without_shapes_names_buffer():
    m = mlp()
    s = default_schedule(m)
    bare = type(s)(s.strategy, s.profile_name, s.profile_digest, s.fingerprint, s.world_size,
                   s.buffers, s.blocks, s.predicted, s.buffer_numel, {})
    wide = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(MismatchError, match=r"buffers\[0\]: expected 234 elements \(schedule\), "
                                            r"got 243"):
        check_model(bare, model_tensors(wide), "s.json")


def test_resolve_schedule_sources(tmp_path, monkeypatch):
    m = mlp()
    path = tmp_path / "s.json"
    save_schedule(split_schedule(m), path)
    monkeypatch.delenv(SCHEDULE_ENV, raising=False)
    assert resolve_schedule(str(path), m, 1)[1] == str(path)
    monkeypatch.setenv(SCHEDULE_ENV, str(path))
    req = requested(None)          # the one reader of $USBYTE_SCHEDULE
    assert req.given and not req.auto
    s, src = resolve_schedule(req.schedule, m, 1)
    assert src == str(path) and s.strategy == "split"
    monkeypatch.delenv(SCHEDULE_ENV)
    assert not requested(None).given
    with pytest.warns(UsbyteWarning, match="no schedule given"):
        assert resolve_schedule(None, m, 1)[1] == "<default schedule>"
    with pytest.raises(FormatError, match=r"nope\.json: expected an existing file"):
        resolve_schedule(str(tmp_path / "nope.json"), m, 1)


# ------------------------------------------------------------------------------------------
# DistributedOptimizer, world size 1
# ------------------------------------------------------------------------------------------


def test_requires_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    m = mlp()
    with pytest.raises(UsbyteError, match="torch.distributed is not initialized"):
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)


@pytest.mark.parametrize("pieces", [1, 3])
def test_matches_plain_optimizer(pg, pieces):
    ref, m = mlp(), mlp()
    o_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=1e-2), m,
                               schedule=split_schedule(m, pieces))
    for step in range(5):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        ref(x).square().mean().backward(); o_ref.step(); o_ref.zero_grad()
        m(x).square().mean().backward(); opt.step(); opt.zero_grad()
    opt.synchronize()
    for a, b in zip(ref.parameters(), m.parameters()):
        assert torch.equal(a, b)


def test_grads_are_views_until_zero_grad(pg):
    """The gradient access contract: after backward p.grad is the tensor's view of the flat
    buffer (channels_last strides kept); after step() it still is, holding the averaged
    gradient, as under DDP, until zero_grad(); the next backward accumulates into it."""
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    m[0].to(memory_format=torch.channels_last)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=default_schedule(m))
    flat = opt._state.grads.flats[0]
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for _ in range(2):
        m(torch.randn(2, 3, 6, 6)).sum().backward()
        assert all(p.grad is not None and lo <= p.grad.data_ptr() < hi for p in m.parameters())
        assert all(p.grad.stride() == p.stride() for p in m.parameters())
        assert not m[0].weight.grad.is_contiguous()
        opt.step()
        assert all(p.grad is not None and lo <= p.grad.data_ptr() < hi for p in m.parameters())
        opt.zero_grad()
        assert all(p.grad is None for p in m.parameters())
    opt.synchronize()


class _Branchy(nn.Module):
    """Two layers, the second one used only on odd steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, odd: bool) -> torch.Tensor:
        x = self.a(x)
        return self.b(x) if odd else x


def test_zero_grad_drops_each_pending_grad_after_its_update(pg):
    """Overlap mode on the host: ``zero_grad()`` leaves a pending tensor's ``p.grad`` (its
    view) for its update to read and drops it right after the update, so that no ``p.grad``
    is written three times; nothing user code sees differs: every read of ``p.grad`` after
    ``zero_grad()`` is ``None``, a tensor left out of a forward keeps no stale gradient, and
    the parameters stay bitwise the plain optimizer's."""
    ref, m = _Branchy(), _Branchy()
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), m,
                               schedule=split_schedule(m, 2))
    for step in range(6):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        odd = step % 2 == 1
        ref(x, odd).square().mean().backward(); o_ref.step(); o_ref.zero_grad()
        m(x, odd).square().mean().backward(); opt.step(); opt.zero_grad()
        ups = opt._state.updates
        # Deferred, nothing ran yet: the tensors that had a gradient (b only on odd steps).
        assert ups.n_pending == 4 and ups.n_drop == (4 if odd else 2)
        if odd:   # a read of p.grad runs the update first (and those ready with it): None
            assert m.b.weight.grad is None and ups.n_drop < 4
        for a, b in zip(ref.parameters(), m.parameters()):
            assert torch.equal(a, b)                              # (reads run the updates)
        assert all(p.grad is None for p in m.parameters()) and ups.n_drop == 0
    opt.synchronize()


def test_updates_are_lazy_until_the_parameter_is_touched(pg):
    m = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=split_schedule(m))
    m(torch.randn(3, 4)).sum().backward()
    before = m[0].weight.detach().clone()
    opt.step()
    assert opt._state.updates.n_pending                      # pending: nothing ran yet
    assert type(m[0].weight).__name__ == "GuardedParameter"  # armed for DDP's contract
    assert not torch.equal(m[0].weight, before)              # a read sees the update first
    assert type(m[0].weight) is nn.Parameter
    sd = m.state_dict()                                      # so does model.state_dict()
    assert not torch.equal(sd["0.weight"], before) and not opt._state.updates.n_pending


def test_no_grad_forward_sees_updates(pg):
    ref, m = mlp(), mlp()
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=split_schedule(m))
    x = torch.randn(3, 4)
    ref(x).sum().backward(); o_ref.step()
    m(x).sum().backward(); opt.step()
    m.eval()
    with torch.no_grad():
        assert torch.equal(ref(x), m(x))


class Bypass(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, bypass=False):
        return F.linear(x, self.fc.weight, self.fc.bias) if bypass else self.fc(x)


def test_parameter_used_outside_its_module_after_first_iteration_gets_its_update_first(pg):
    ref, m = Bypass(), Bypass()
    m.load_state_dict(ref.state_dict())
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=split_schedule(m))
    for step in range(3):   # the module's forward first, then the bypass
        x = torch.randn(2, 4)
        ref(x, bypass=step > 0).sum().backward(); o_ref.step(); o_ref.zero_grad()
        m(x, bypass=step > 0).sum().backward(); opt.step(); opt.zero_grad()
    opt.synchronize()
    assert torch.equal(ref.fc.weight, m.fc.weight)


def test_parameter_used_outside_its_module_from_the_start_is_learned(pg):
    ref, m = Bypass(), Bypass()
    m.load_state_dict(ref.state_dict())
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=default_schedule(m))
    for _ in range(3):
        x = torch.randn(2, 4)
        ref(x, bypass=True).sum().backward(); o_ref.step(); o_ref.zero_grad()
        m(x, bypass=True).sum().backward(); opt.step(); opt.zero_grad()
    opt.synchronize()
    assert torch.equal(ref.fc.weight, m.fc.weight)


def test_too_many_backward_passes_raise(pg):
    m = mlp()
    _opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=default_schedule(m))
    m(torch.randn(2, 4)).sum().backward()
    with pytest.raises(UsbyteError, match="backward_passes_per_step=1"):
        m(torch.randn(2, 4)).sum().backward()


def test_gradient_after_the_all_reduce_was_issued_raises(pg):
    m = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=split_schedule(m), backward_passes_per_step=2)
    m(torch.randn(2, 4)).sum().backward()
    opt.clip_grad_norm_(1.0)   # asks for the averaged gradients: issues the step's all-reduce
    with pytest.raises(UsbyteError, match=r"after this step's all-reduce was issued \(by "
                                          r"clip_grad_norm_\(\)\)"):
        m(torch.randn(2, 4)).sum().backward()


def test_synchronize_between_accumulation_passes_leaves_the_accumulation_alone(pg):
    m = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=split_schedule(m), backward_passes_per_step=2)
    m(torch.randn(2, 4)).sum().backward()
    opt.synchronize()          # an evaluation between the passes: nothing is issued
    assert opt.param_groups[0]["lr"] == 0.1
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.synchronize()          # applies the step's updates
    assert opt.optimizer_calls == 1


def test_optimizer_param_outside_model_is_an_error(pg):
    m = mlp()
    extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(UsbyteError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \[3\]\) "
                                          r"is not a parameter of the model"):
        DistributedOptimizer(torch.optim.SGD([{"params": m.parameters()}, {"params": [extra]}],
                                             lr=0.1), m, schedule=default_schedule(m))


def test_model_mismatch_names_tensor(pg):
    m = mlp()
    s = default_schedule(m)
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 9), nn.ReLU(), nn.Linear(9, 2))
    with pytest.raises(MismatchError, match=r"tensor '2\.weight': expected shape \[8, 16\] "
                                            r"\(schedule\), got \[9, 16\] \(model\)"):
        DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), other, schedule=s)


def test_bad_backward_passes_value(pg):
    m = mlp()
    with pytest.raises(UsbyteError, match="backward_passes_per_step: expected an integer >= 1"):
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, backward_passes_per_step=0)


def test_state_dict_matches_wrapped_optimizer_format(pg):
    m = mlp()
    inner = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt = DistributedOptimizer(inner, m, schedule=split_schedule(m))
    for _ in range(2):
        m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["params"] == list(range(6))
    assert all(int(sd["state"][i]["step"]) == 2 for i in range(6))
    plain = torch.optim.AdamW(copy.deepcopy(m).parameters(), lr=1e-3)
    plain.load_state_dict(sd)   # loads into a plain optimizer as is


def test_close_gives_gradients_back(pg):
    m = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=default_schedule(m))
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.close()
    flat = opt._state.grads.flats[0]
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    assert all(p.grad is None or not lo <= p.grad.data_ptr() < hi for p in m.parameters())
    w = m[0].weight.detach().clone()
    m(torch.randn(2, 4))            # no hooks any more
    assert torch.equal(w, m[0].weight)
    with pytest.raises(UsbyteError, match="step\\(\\) on a closed DistributedOptimizer"):
        opt.step()
    opt.close()                     # twice is harmless


def test_default_plan_warns_once_per_construction(pg, monkeypatch):
    monkeypatch.delenv(SCHEDULE_ENV, raising=False)
    m = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)
    assert sum(issubclass(w.category, UsbyteWarning) for w in caught) == 1


def test_repr_names_schedule(pg, tmp_path):
    m = mlp()
    path = tmp_path / "s.json"
    save_schedule(split_schedule(m), path)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, schedule=str(path))
    assert f"schedule={path} [split," in repr(opt)
    assert os.fspath(path) == opt.schedule_source


def test_copies_and_pickles_of_the_model_leave_the_runtime_behind(pg, tmp_path):
    m = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m,
                               schedule=default_schedule(m))
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    twin = copy.deepcopy(m)                 # e.g. an EMA copy
    torch.save(m, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    for other in (twin, loaded):
        other(torch.randn(2, 4)).sum().backward()   # no runtime hooks fire
        assert other[0].weight.grad.data_ptr() != opt._state.grads.flats[0].data_ptr()
    # Copies made after step() hold the updated values, as under DDP (the copy applied them).
    assert opt._state.updates.n_pending == 0
    assert torch.equal(twin[0].bias, m[0].bias)
