"""``usbyte-opt demo``: the whole pipeline on two local ranks, as a user runs it.

(``--json`` purity and the files of a run are checked on ``bench``, which demo is built on.)
"""

from __future__ import annotations

import subprocess
import sys


def test_demo_prints_predicted_and_measured_side_by_side(tmp_path):
    p = subprocess.run([sys.executable, "-m", "usbyte_opt", "demo", "--model", "lab-cnn",
                        "--batch-size", "2", "--iterations", "2"],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    for word in ("ddp", "best", "measured ms", "predicted ms", "training matches ddp"):
        assert word in p.stdout, word
    assert "DDP's speed measured" in p.stderr and "predicted" in p.stderr
    assert list(tmp_path.iterdir()) == []  # without --output-dir nothing is written
