"""``benchmarks/gpu_bundle.py`` without the network: its pins, its pruning, its command."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

REPO = Path(__file__).resolve().parent.parent


bundle = load_benchmark("gpu_bundle")


def _pyproject_requirements() -> dict[str, str]:
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text()) if sys.version_info >= (3, 11) else {}
    reqs = data["project"]["dependencies"] + data["project"]["optional-dependencies"]["test"]
    out = {}
    for r in reqs:
        m = re.match(r"([A-Za-z0-9_.-]+)(.*)", r)
        assert m
        out[bundle.norm(m.group(1))] = m.group(2).strip()
    return out


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_every_pin_is_inside_pyproject_ranges():
    from packaging.specifiers import SpecifierSet

    reqs = _pyproject_requirements()
    names = {bundle.norm(n) for n, _, _ in bundle.PINS}
    assert len(names) == len(bundle.PINS)                     # one version each
    for name in bundle.PYPROJECT_NAMES:
        assert bundle.norm(name) in names
    for n, v, _ in bundle.PINS:
        spec = reqs.get(bundle.norm(n))
        if spec is not None:
            assert v in SpecifierSet(spec), f"{n}=={v} outside pyproject's {spec}"


def test_prune_keeps_one_wheel_per_pin_for_the_python(tmp_path):
    names = ["pydantic-2.13.4-py3-none-any.whl", "pydantic-2.12.0-py3-none-any.whl",
             "rpds_py-0.30.0-cp312-cp312-manylinux_2_17_x86_64.whl",
             "rpds_py-0.30.0-cp311-cp311-manylinux_2_17_x86_64.whl", "numpy-2.0.0-cp312-cp312-any.whl"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    pins = [("pydantic", "2.13.4", ""), ("rpds-py", "0.30.0", "")]
    removed = bundle.prune(tmp_path, pins, "3.12")
    assert sorted(p.name for p in tmp_path.iterdir()) == [names[0], names[2]]
    assert len(removed) == 3
    assert bundle.have(tmp_path, "rpds-py", "0.30.0", "3.12") is not None
    assert bundle.have(tmp_path, "rpds-py", "0.30.0", "3.11") is None


def test_download_command_names_the_target_python_and_platforms(tmp_path):
    cmd = bundle.download_command(tmp_path, "3.12", ["pulp==3.3.2"])
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--only-binary=:all:" in cmd and "--no-deps" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "manylinux2014_x86_64" in cmd and cmd[-1] == "pulp==3.3.2"


def test_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit, match="--python-version: expected 3.N"):
        bundle.main(["--python-version", "twelve", "--list"])
    with pytest.raises(SystemExit, match="--skip: unknown package"):
        bundle.main(["--skip", "numpy", "--list"])
    assert bundle.main(["--list", "--skip", "pulp"]) == 0
    out = capsys.readouterr().out
    assert "pydantic==2.13.4" in out and "pulp" not in out
