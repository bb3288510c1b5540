"""The runtime's measured timeline can be turned off and on between iterations: the bench
times iterations unrecorded (as DDP's) and records a separate untimed pass."""

import torch

from usbyte_opt.runtime import DistributedOptimizer
from usbyte_opt.runtime.default_plan import default_schedule
from usbyte_opt.runtime.trace import flush_all


def _iterate(model, opt, n=2):
    for _ in range(n):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()


def test_record_trace_off_records_nothing_and_on_records_iterations(pg, tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               default_schedule(model, 1), verify=False,
                               trace=tmp_path / "t.json")
    rec = opt._state.trace
    opt.record_trace(False)
    _iterate(model, opt)
    assert rec.records == []
    opt.record_trace(True)
    _iterate(model, opt)
    kinds = {r[0] for r in rec.records}
    assert {"F0", "F1", "S"} <= kinds
    opt.close()
    flush_all()
    assert (tmp_path / "t.json").exists()


def test_record_trace_without_a_trace_file_does_nothing(pg):
    model = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               default_schedule(model, 1), verify=False)
    opt.record_trace(True)
    _iterate(model, opt, 1)
    assert opt._state.trace is None
    opt.close()
