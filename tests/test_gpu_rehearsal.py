"""The rehearsal of the GPU check (``benchmarks/gpu_check.py``): run it here as it will run on
the GPU machine, so that a GPU session is not spent on the check's own bugs.

As on that machine: a copy of the tree (the files git tracks, and those it would, from a
clean checkout), no install of the project, an interpreter whose site-packages holds only
what the image holds, and the packages the image lacks on ``PYTHONPATH`` beside the tree.

* **The image.** A virtual environment without pip, whose site-packages links every
  distribution installed here except those the image lacks (:data:`LACKING`) and this
  project's own editable install. Its interpreter starts the check's parts with the same
  view (a part's ``sys.executable`` is the environment's), which ``python -I`` or ``-S``
  alone would not give every child process.
* **The bundle.** By default the lacking distributions' installed files, linked into one
  folder: the same packages ``benchmarks/gpu_bundle.py`` downloads, at the versions installed
  here, with no download (CI's install already resolved them; a download of 19 MiB per run
  would only add the network to what can fail). With ``USBYTE_GPU_WHEELS=DIR`` (the folder of
  ``python benchmarks/gpu_bundle.py --python-version 3.11 --dest DIR``), the wheels
  themselves, installed with the GPU machine's exact command
  (``pip install --no-index --no-deps --target``): the full rehearsal of the bundle.

First the check runs without the bundle and must stop at its import check, naming pydantic
(so the environment really lacks it); then with it, ``--smoke``, and every part must pass: every
comparison within its control, the planted difference seen, ``host_ratio`` measured, and
nothing under ``--out`` but the report, its JSON and the one archive of everything else.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import site
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: Distributions the GPU image lacks (docs/gpu.md), travelling in the bundle.
LACKING = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "pulp",
           "jsonschema", "jsonschema-specifications", "referencing", "rpds-py")


def _top_levels(dist: md.Distribution) -> set[str]:
    """The entries of site-packages a distribution installed (its packages, its dist-info)."""
    out = set()
    for f in dist.files or ():
        parts = Path(str(f)).parts
        if parts and parts[0] != ".." and not parts[0].endswith(".pth"):
            out.add(parts[0])
    return out


def _installed(name: str) -> md.Distribution | None:
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def _clean_copy(dest: Path) -> None:
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _image(venv: Path) -> Path:
    """A venv whose site-packages links what is installed here, less LACKING and this
    project; returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    target = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    excluded: set[str] = set()
    for name in (*LACKING, "usbyte-opt"):
        d = _installed(name)
        if d is not None:
            excluded |= _top_levels(d)
    for sp in site.getsitepackages():
        for entry in Path(sp).iterdir():
            if (entry.name in excluded or entry.suffix == ".pth" or entry.name.startswith("__editable__")
                    or entry.name == "__pycache__" or (target / entry.name).exists()):
                continue
            (target / entry.name).symlink_to(entry)
    return py


def _bundle(dest: Path) -> None:
    dest.mkdir()
    wheels = os.environ.get("USBYTE_GPU_WHEELS")
    if wheels:
        whl = sorted(Path(wheels).glob("*.whl"))
        assert whl, f"USBYTE_GPU_WHEELS={wheels}: no wheels there"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--disable-pip-version-check", "--target", str(dest),
                        *map(str, whl)], check=True)
        return
    for name in LACKING:
        d = _installed(name)
        if d is None:
            pytest.skip(f"{name} is not installed here: nothing to bundle it from")
        root = Path(str(d.locate_file("")))
        for top in _top_levels(d):
            if (root / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(root / top)


@pytest.mark.slow   # about 80 s: run before a GPU is lent (docs/gpu.md), with -m slow
def test_gpu_check_smoke_runs_from_a_clean_copy_with_only_the_image_and_the_bundle(tmp_path):
    repo, bundle, out = tmp_path / "repo", tmp_path / "site", tmp_path / "out"
    repo.mkdir()
    _clean_copy(repo)
    py = _image(tmp_path / "image")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    # Without the bundle: the import check stops the run at once, naming what is missing.
    p = subprocess.run([str(py), "benchmarks/gpu_check.py", "--smoke", "--out", str(out / "bare")],
                       cwd=repo, env=dict(env, PYTHONPATH=str(repo)), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "cannot import pydantic" in p.stderr, p.stderr[-2000:]
    assert "## tests" not in (out / "bare" / "gpu_check.md").read_text()

    # With it, as on the GPU machine: every part that runs on the CPU passes.
    _bundle(bundle)
    p = subprocess.run([str(py), "benchmarks/gpu_check.py", "--smoke", "--out", str(out / "ok")],
                       cwd=repo, env=dict(env, PYTHONPATH=f"{repo}{os.pathsep}{bundle}"),
                       capture_output=True, text=True, timeout=400)
    report = (out / "ok" / "gpu_check.md").read_text() if (out / "ok" / "gpu_check.md").exists() else ""
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    for part in ("imports: ok", "tests: ok", "sync_debug: skipped", "probes: ok",
                 "two_ranks: ok", "sharded: ok", "flow: ok", "compiled: ok", "host_ratio: ok"):
        assert f"## {part}" in report, report
    assert "max |runtime - DDP| = 0, control max |DDP - DDP| = 0: ok" in report
    assert "matches DDP: True" in report and "(race visible)" in report
    # The planted difference is seen, on both ranks.
    assert report.count("max |planted - DDP| = ") == 2 and "NOT SEEN" not in report, report
    assert "lab-cnn (batch 2): DDP " in report and "(a measurement)" in report, report
    # The compiled part split best's graph and trained as compiled DDP did.
    assert "- lab-cnn (batch 2): compiled DDP " in report and "matches DDP: True" in report, report
    assert "`--compile aot_eager` on the emulated link 16x25gbit" in report, report
    # Nothing under --out but the report, its JSON and the archive of everything else.
    files = sorted(p.name for p in (out / "ok").rglob("*"))
    assert files == ["gpu_check.json", "gpu_check.md", "gpu_check_evidence.tar.gz"], files
    with tarfile.open(out / "ok" / "gpu_check_evidence.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu_check/logs/flow.log", "gpu_check/parts/two_ranks.json", "gpu_check/bench/result.json",
            "gpu_check/host_ratio/lab-cnn/result.json", "gpu_check/compiled/lab-cnn/result.json",
            "gpu_check/gpu_check.md"} <= names, names
    # The project came from the copy, pydantic from the bundle.
    assert f"usbyte_opt.runtime: this tree from {repo}" in report, report
    assert f"pydantic: {md.version('pydantic') if not os.environ.get('USBYTE_GPU_WHEELS') else ''}" in report
    assert f"from {bundle}" in report.split("- pydantic:")[1].splitlines()[0]
