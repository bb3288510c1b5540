"""The planning core (``usbyte_opt.planning``) and ``optimize`` run with torch absent, for
every strategy: a fresh interpreter in which ``import torch`` fails."""

import json
import subprocess
import sys
from pathlib import Path

from usbyte_opt.planning.strategies import STRATEGIES, load_builtin

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_every_planning_module_imports_without_torch():
    code = ("import importlib, pkgutil, usbyte_opt.planning as p\n"
            "names = [m.name for m in pkgutil.walk_packages(p.__path__, 'usbyte_opt.planning.')]\n"
            "for n in names: importlib.import_module(n)\n"
            "print(len(names))")
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) >= 15


def test_optimize_plans_every_strategy_with_torch_absent(tmp_path):
    load_builtin()
    names = sorted(STRATEGIES)
    assert {"wfbp", "ddp", "ddp-tuned", "mgwfbp", "bytescheduler", "usbyte", "best"} <= set(names)
    profile = ROOT / "profiles" / "resnet50.json"
    code = ("from usbyte_opt.cli.main import main\n"
            "import json\n"
            f"for s in {names!r}:\n"
            f"    try:\n"
            f"        main(['optimize', {str(profile)!r}, '-s', s, '--json',\n"
            f"              '-o', {str(tmp_path)!r} + '/' + s + '.json'])\n"
            f"    except SystemExit as e:\n"
            f"        assert not e.code, (s, e.code)\n")
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    for s in names:
        assert json.loads((tmp_path / f"{s}.json").read_text())["blocks"], s
