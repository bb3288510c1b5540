"""The forward gate sits at each tensor's real first use (a parent reading a child's weight
before calling the child), learned in the first iteration; one process, gloo, CPU.

On CUDA the same case would be a silent race with the update stream (the child's gate comes
after the parent's read); ``benchmarks/gpu_check.py``'s probe part shows that on a GPU. Here
the CPU path shows the gate's place: before the fix, the child's gate updated the weight in
place after the parent had saved it for backward, and autograd refused the backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from usbyte_opt.planning.problem import Problem
from usbyte_opt.runtime import DistributedOptimizer, profile_from_model, split_blocks


class ReadsChildFirst(nn.Module):
    """``F.linear(x, self.b.weight)`` first, then ``self.a``, then ``self.b`` itself."""

    def __init__(self, peek: str = "values"):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.peek = peek

    def forward(self, x):
        if self.peek == "values":
            x = torch.tanh(F.linear(x, self.b.weight))
        else:  # metadata only: not a use of the values
            assert self.b.weight.shape[0] == x.shape[1] and self.b.weight.dtype == x.dtype
        return self.b(torch.relu(self.a(x)))


def schedule(m: nn.Module, pieces: int = 2):
    pb = Problem.from_profile(profile_from_model(m))
    lay = pb.layout()
    return pb.schedule("split", lay, split_blocks(pb, lay, pieces, pb.need_order()))


def train(m: nn.Module, opt, steps: int = 5) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        F.mse_loss(m(x), y).backward(); opt.step(); opt.zero_grad()


@pytest.mark.parametrize("pieces", [1, 3])
def test_parent_reading_a_child_weight_first_matches_plain_training(pg, pieces):
    ref = ReadsChildFirst()
    m = copy.deepcopy(ref)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    opt = DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), m,
                               schedule=schedule(m, pieces), verify=False)
    train(m, opt)
    opt.synchronize()
    for (n, p), q in zip(ref.named_parameters(), m.parameters()):
        assert torch.equal(p, q), n
    # No hook per module: the first read of b.weight (the parent's) ran its update.
    assert not any(mod._forward_pre_hooks for mod in m.children())
    opt.close()


def test_metadata_reads_do_not_run_the_update(pg):
    m = ReadsChildFirst(peek="shape")
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, schedule=schedule(m),
                               verify=False)
    train(m, opt, steps=3)
    w = m.b.weight
    assert type(w).__name__ == "GuardedParameter"       # its update is pending
    assert w.shape == (8, 8) and w.dtype == torch.float32 and w.requires_grad
    assert type(w).__name__ == "GuardedParameter"       # metadata: still pending
    w.detach().sum()
    assert type(w).__name__ == "Parameter"              # a read of the values ran it
    opt.close()


def test_forward_that_raises_leaves_nothing_behind(pg):
    class Fails(ReadsChildFirst):
        def forward(self, x):
            super().forward(x)
            raise ValueError("boom")

    m = Fails()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, schedule=schedule(m),
                               verify=False)
    with pytest.raises(ValueError, match="boom"):
        m(torch.randn(2, 8))
    assert opt._state.gates.depth == 0
    assert not torch._C._is_torch_function_mode_enabled()
    opt.close()


# ------------------------------------------------------------------------------------------
# The drift check once settled (finding: a device sync and a host-blocking all-reduce every
# check_every steps, and one CUDA event per step kept forever with check_every=0)
# ------------------------------------------------------------------------------------------


def _no_settle() -> None:
    raise AssertionError("the drift check waited for the device")


@pytest.mark.parametrize("check_every", [0, 3])
def test_drift_check_keeps_few_stamps_and_never_waits(pg, check_every):
    m = ReadsChildFirst()
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, schedule=schedule(m),
                               check_every=check_every)
    tuner = opt._tuner
    assert tuner.phase == "settled"          # world size 1: nothing to verify
    tuner.clock.settle = _no_settle
    train(m, opt, steps=20)
    assert len(tuner.timer.stamps) <= max(check_every, 1) + 1
    if check_every:
        assert tuner.drift_work is not None   # this window's median, read at the next check
    opt.close()


# ------------------------------------------------------------------------------------------
# Where the runtime's gloo groups listen (finding: an NCCL run's control group on whatever the
# hostname resolves to)
# ------------------------------------------------------------------------------------------


def test_gloo_address_refuses_loopback_on_a_job_that_spans_nodes():
    from usbyte_opt.collectives.issuers import gloo_address
    from usbyte_opt.errors import UsbyteError

    def no_route(host):
        return None

    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    with pytest.raises(UsbyteError, match="GLOO_SOCKET_IFNAME"):
        gloo_address(env, "127.0.1.1", "node0", no_route)
    # The store's host routes from a real address: that one.
    assert gloo_address(env, "127.0.1.1", "10.1.2.3", lambda h: "10.1.2.9") == ("hostname", ["10.1.2.9"])
    # One node, loopback everywhere: torch's default, as before.
    assert gloo_address({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, "127.0.1.1", "127.0.0.1",
                        no_route) == ("default", [])
    assert gloo_address(dict(env, GLOO_SOCKET_IFNAME="ib0"), "127.0.1.1", None, no_route) == \
        ("interface", ["ib0"])


def test_route_to_the_loopback_store_is_loopback():
    from usbyte_opt.collectives.issuers import _route_to

    assert _route_to("127.0.0.1") == "127.0.0.1"
