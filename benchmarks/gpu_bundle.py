"""The wheels the GPU machine's image lacks, for its Python, downloaded into one folder.

    python benchmarks/gpu_bundle.py --python-version 3.12 --dest .whl

The image (docs/gpu.md): Python 3.12, torch 2.11, numpy, scipy, typer, rich, pytest,
hypothesis, attrs, typing-extensions and more, no network. It lacks what the project imports
besides those: pydantic (``usbyte_opt.formats`` reading a profile or schedule file) with
pydantic-core, annotated-types and typing-inspection; pulp (the exact MILP that ``best`` runs
on models of at most 6 tensors; imported only there); jsonschema (the schema tests) with
jsonschema-specifications, referencing and rpds-py. Two more travel although the image has
them: typing-extensions and attrs, because the pins need ``typing-extensions>=4.14.1`` and
``attrs>=22.2.0`` and nothing known of the image guarantees more than torch's own
``typing-extensions>=4.10`` (a newer copy of either on ``PYTHONPATH`` shadows the image's;
both only add to their API). ``--skip typing-extensions,attrs`` leaves them out.

One pinned version of each (:data:`PINS`, versions the suite runs with, inside the ranges of
``pyproject.toml``); wheels of other versions or other Pythons already in ``--dest`` are
removed, so that ``pip install --no-index --no-deps --target DIR DEST/*.whl`` sees one wheel
per package. About 19 MiB, 16 of them pulp's (it ships CBC binaries); the tree is about 2.5 MiB,
so the two travel together well under the 64 MiB a device call carries.

``--python-version 3.11`` (or this machine's version) bundles for this machine instead: the
rehearsal (``tests/test_gpu_rehearsal.py`` with ``USBYTE_GPU_WHEELS=DEST``) installs them the
way the GPU machine does.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (distribution, version, why it travels).
PINS: list[tuple[str, str, str]] = [
    ("pydantic", "2.13.4", "usbyte_opt.formats (reading every profile and schedule file)"),
    ("pydantic-core", "2.46.4", "pydantic's compiled core (exact pin of pydantic 2.13.4)"),
    ("annotated-types", "0.7.0", "needed by pydantic"),
    ("typing-inspection", "0.4.2", "needed by pydantic"),
    ("typing-extensions", "4.16.0", "pydantic needs >= 4.14.1; the image guarantees only torch's >= 4.10"),
    ("pulp", "3.3.2", "the exact MILP of `best` on models of <= 6 tensors (imported lazily)"),
    ("jsonschema", "4.26.0", "the schema tests (tests/test_formats.py, tests/test_fuzz.py)"),
    ("jsonschema-specifications", "2025.9.1", "needed by jsonschema"),
    ("referencing", "0.37.0", "needed by jsonschema"),
    ("rpds-py", "0.30.0", "needed by jsonschema and referencing (compiled)"),
    ("attrs", "26.1.0", "jsonschema and referencing need >= 22.2.0; the image's version is unknown"),
]

#: What pyproject.toml names, for the check that every pin is inside its range.
PYPROJECT_NAMES = {"pydantic", "pulp", "jsonschema"}

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def norm(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427: runs of ``-_.`` become ``_``,
    lower case).

    Example::

        >>> norm("pydantic-core"), norm("jsonschema.specifications"), norm("PuLP")
        ('pydantic_core', 'jsonschema_specifications', 'pulp')
    """
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_name_version(filename: str) -> tuple[str, str]:
    """(normalised name, version) of a wheel file name.

    Example::

        >>> wheel_name_version("pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.whl")
        ('pydantic_core', '2.46.4')
    """
    parts = filename[:-len(".whl")].split("-")
    return norm(parts[0]), parts[1]


def wheel_fits(filename: str, python_version: str) -> bool:
    """Whether a wheel's Python tag runs on ``python_version`` (``"3.12"``): pure wheels
    (``py3``) and ``cpXY`` / ``abi3`` ones of that version.

    Example::

        >>> wheel_fits("rpds_py-0.30.0-cp312-cp312-manylinux_2_17_x86_64.whl", "3.12")
        True
        >>> wheel_fits("rpds_py-0.30.0-cp311-cp311-manylinux_2_17_x86_64.whl", "3.12")
        False
        >>> wheel_fits("attrs-26.1.0-py3-none-any.whl", "3.11")
        True
    """
    tags = filename[:-len(".whl")].split("-")
    if len(tags) < 5:
        return False
    py, abi = tags[-3], tags[-2]
    cp = "cp" + python_version.replace(".", "")
    pys = py.split(".")
    return any(p in ("py3", "py2.py3") for p in pys) or cp in pys or (abi == "abi3" and any(
        p.startswith("cp3") and int(p[3:] or 0) <= int(cp[3:]) for p in pys))


def pins(skip: set[str]) -> list[tuple[str, str, str]]:
    unknown = skip - {n for n, _, _ in PINS}
    if unknown:
        raise SystemExit(f"gpu_bundle: --skip: unknown package(s) {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(n for n, _, _ in PINS)})")
    return [p for p in PINS if p[0] not in skip]


def prune(dest: Path, wanted: list[tuple[str, str, str]], python_version: str) -> list[str]:
    """Remove from ``dest`` every wheel that is not one of ``wanted`` for ``python_version``;
    returns the names removed."""
    keep = {norm(n): v for n, v, _ in wanted}
    removed = []
    for w in sorted(dest.glob("*.whl")):
        name, ver = wheel_name_version(w.name)
        if keep.get(name) != ver or not wheel_fits(w.name, python_version):
            w.unlink()
            removed.append(w.name)
    return removed


def have(dest: Path, name: str, version: str, python_version: str) -> Path | None:
    for w in dest.glob("*.whl"):
        if wheel_name_version(w.name) == (norm(name), version) and wheel_fits(w.name, python_version):
            return w
    return None


def download_command(dest: Path, python_version: str, reqs: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
           "--only-binary=:all:", "--no-deps", "--implementation", "cp",
           "--python-version", python_version]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + ["-d", str(dest), *reqs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-version", default="3.12",
                    help="the Python the wheels are for (default 3.12, the GPU image's)")
    ap.add_argument("--dest", default=".whl", help="the folder (default .whl, git-ignored)")
    ap.add_argument("--skip", default="", help="comma-separated packages to leave out")
    ap.add_argument("--list", action="store_true", help="print the pins and exit")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d{1,2}", args.python_version):
        raise SystemExit(f"gpu_bundle: --python-version: expected 3.N, got {args.python_version!r}")
    wanted = pins(set(filter(None, args.skip.split(","))))
    if args.list:
        for n, v, why in wanted:
            print(f"{n}=={v}  # {why}")
        return 0
    dest = Path(args.dest)
    if not dest.is_absolute():
        dest = Path.cwd() / dest
    dest.mkdir(parents=True, exist_ok=True)
    for name in prune(dest, wanted, args.python_version):
        print(f"gpu_bundle: removed {name} (another version or Python)")
    missing = [f"{n}=={v}" for n, v, _ in wanted if have(dest, n, v, args.python_version) is None]
    if missing:
        proc = subprocess.run(download_command(dest, args.python_version, missing))
        if proc.returncode != 0:
            print(f"gpu_bundle: pip download failed (exit {proc.returncode}) for "
                  f"{' '.join(missing)}", file=sys.stderr)
            return 1
    prune(dest, wanted, args.python_version)
    absent = [f"{n}=={v}" for n, v, _ in wanted if have(dest, n, v, args.python_version) is None]
    if absent:
        print(f"gpu_bundle: no wheel for Python {args.python_version}: {' '.join(absent)}",
              file=sys.stderr)
        return 1
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"gpu_bundle: {len(wheels)} wheels for Python {args.python_version} in {dest}, "
          f"{total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
