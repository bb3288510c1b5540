"""Public DDP trainers with only their DDP line changed: bitwise their own DDP run, or refused.

Each case runs one configuration of benchmarks/real_clients.py (2 gloo ranks, torch's DDP,
then the trainer with its one line changed to ``usbyte_opt.DistributedDataParallel`` and
``USBYTE_SCHEDULE=auto``) and fails when anything differs: every rank's weights and buffers,
optimizer state, EMA model, the checkpoints written and the metrics logged. The trainer's
source is obtained at run time (benchmarks/real_clients.py's cache, ``$USBYTE_RC_SRC_<NAME>``
or a clone of its public repository); the case is skipped, saying why, when it cannot be had.
The DDP-vs-DDP control runs in the benchmark, not here (every configuration below was bitwise
deterministic there: benchmarks/real_clients.md). One case is fast (two torchruns of nanoGPT,
about a minute on 2 idle cores); the others are marked slow (one to six minutes each; Accelerate's
cv example, a resnet50d at 224 pixels, about eight to ten). Of Accelerate's, only the configuration
as published runs here: each other one (checkpointing, resume, stateful loader, tracking, bf16)
would add as much again, and none has run in the benchmark yet.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("real_clients", ROOT / "benchmarks" / "real_clients.py")
rc = importlib.util.module_from_spec(_spec)
sys.modules["real_clients"] = rc
_spec.loader.exec_module(rc)

FAST = {("nanogpt", "plain")}
ITERATIONS = 6
#: Accelerate's example: 3 epochs of one step of 64 images per rank.
TRAINER_ITERATIONS = {"accelerate": 3}
#: The trainers' configurations here (default: all of them).
TRAINER_CONFIGS = {"accelerate": ["plain"]}

CASES = [pytest.param(t.name, c, id=f"{t.name}-{c}",
                      marks=() if (t.name, c) in FAST else (pytest.mark.slow,))
         for t in rc.TRAINERS.values() for c in TRAINER_CONFIGS.get(t.name, t.configs)]

_trees: dict[str, object] = {}


def _prepared(name: str):
    if name not in _trees:
        t = rc.TRAINERS[name]
        try:
            src = rc.source_tree(t, rc.DEFAULT_CACHE, clone_timeout=60)
            pypath = rc.python_deps(t, rc.DEFAULT_CACHE)
        except rc.Unobtainable as e:
            _trees[name] = str(e)
        else:
            _trees[name] = (t, rc.patched_trees(t, src, rc.DEFAULT_CACHE, tag="test"), pypath)
    got = _trees[name]
    if isinstance(got, str):
        pytest.skip(got)
    return got


@pytest.mark.parametrize("trainer,config", CASES)
def test_trainer_equals_its_ddp_run_or_refuses(trainer, config, tmp_path):
    t, trees, pypath = _prepared(trainer)
    row = rc.run_config(t, trees, pypath, config, TRAINER_ITERATIONS.get(trainer, ITERATIONS), tmp_path, "auto",
                        control=False)
    if row["status"] == "ddp-failed":
        pytest.skip(f"{trainer} {config}: {row['result']}")
    assert row["status"] in ("equal", "refused"), f"{trainer} {config}: {row['result']}"
