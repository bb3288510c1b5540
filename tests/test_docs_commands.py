"""Every shell command of README.md and docs/*.md runs as written, on a fresh clone.

The commands are read from the documents themselves: the lines of each fenced ```bash block
(``&&`` chains split into their commands) and each inline `usbyte-opt ...` span. They run, in
document order, in a copy of the repository's files (tracked and new, a git index so that the
copy knows what it ships) with ``usbyte-opt`` as ``python -m usbyte_opt`` of that copy; at the
end no tracked file of the copy has changed. Options that only make a run short (fewer timing
repeats, a short all-reduce sweep, a small batch, fewer steps: :data:`FAST`) are appended;
nothing else changes.

What is not run is listed here, each with its reason, shown as the test's skip reason:
:data:`SKIP` (root and the network lab, GPUs, installs, long runs, the suite itself), by exact
command, so that a new command in a document runs (or fails) rather than being skipped
silently; spans that only name a command (`usbyte-opt profile`) or show a template
(`usbyte-opt optimize PROFILE`) are commands of no document to run, and say so. The trainer
examples' three steps (Lightning, the Hugging Face Trainer, Accelerate: minutes on two cores)
run with ``-m slow``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

#: Appended to each command of these subcommands (or scripts): speed only.
FAST: dict[str, list[str]] = {
    "profile": ["--batch-size", "2", "--warmup", "1", "--repeats", "2", "--comm-points", "3",
                "--comm-repeats", "1", "--comm-max-mb", "1", "--no-cpu-probe", "--no-shard-sweep",
                "--stable-s", "0"],
    "examples/train.py": ["--batch-size", "2", "--warmup", "1"],
    "examples/lightning_train.py": ["--steps", "3"],
    "examples/hf_train.py": ["--steps", "3", "--batch-size", "2"],
    "examples/accelerate_train.py": ["--steps", "3", "--batch-size", "2"],
}

_LAB = "needs root and the emulated network (the lab: sudo, --bandwidth)"
_GPU = "needs GPUs (8 ranks or --device cuda)"
_INSTALL = "installs packages (pip install); the test environment has them"
_SUITE = "the test suite itself, or the lint CI runs beside it (.ci/run)"

#: Commands not run, by exact text (whitespace normalised, comments removed), and why.
SKIP: dict[str, str] = {
    "pip install 'torch==2.13.0' -e .": _INSTALL,
    "pip install 'torch==2.13.0' -e '.[test]'": _INSTALL,
    "pip install 'torch==2.13.0' -e '.[lightning]'": _INSTALL,
    "pip install 'torch==2.13.0' -e '.[transformers]'": _INSTALL,
    "python -m pytest -q": _SUITE,
    "python -m pytest -q -n 2 --dist loadfile": _SUITE,
    "python -m pytest -q -m slow": _SUITE,
    "python -m pytest -q --durations=20": _SUITE,
    "python -m pytest -q tests/test_x.py -k y": _SUITE,
    "bash .ci/run": _SUITE,
    "ruff check .": _SUITE,
    "mypy": _SUITE,
    "python -m pytest -q -m slow tests/test_fuzz.py": "long run: 10000 fuzz cases (the suite runs a few)",
    "usbyte-opt profile cnn --nproc-per-node 2 --device cpu -o profiles/mine.json":
        "the README's three steps: tests/test_flow.py runs them, read from the README",
    "usbyte-opt optimize profiles/mine.json -o schedules/mine.json":
        "the README's three steps: tests/test_flow.py runs them, read from the README",
    "usbyte-opt launch --schedule schedules/mine.json --nproc-per-node 2 examples/train.py --model cnn":
        "the README's three steps: tests/test_flow.py runs them, read from the README",
    "usbyte-opt demo": "long run (about a minute): tests/test_demo.py runs it",
    "usbyte-opt profile resnet50 --nproc-per-node 8 --batch-size 64": _GPU,
    "torchrun --nnodes 2 --nproc-per-node 8 ... -m usbyte_opt profile my_pkg.models:build": _GPU,
    "usbyte-opt profile resnet50 --nproc-per-node 8 --device cuda -o profiles/mine.json": _GPU,
    "usbyte-opt launch --schedule schedules/mine.json --nproc-per-node 8 examples/train.py --model resnet50": _GPU,
    "usbyte-opt launch --schedule schedules/mine.json --nproc-per-node 8 train.py --epochs 90": _GPU,
    "usbyte-opt bench resnet50 --nproc-per-node 8": _GPU,
    "torchrun --nproc-per-node 8 -m usbyte_opt bench resnet50": _GPU,
    "torchrun --nproc-per-node 8 -m usbyte_opt profile my_models:build_resnet --batch-size 64": _GPU,
    "sudo usbyte-opt bench lab-vgg --bandwidth 200mbit": _LAB,
    "sudo usbyte-opt bench lab-cnn --bandwidth 200mbit": _LAB,
    "sudo usbyte-opt bench lab-cnn --nodes 2 --nproc-per-node 2 --bandwidth 200mbit": _LAB,
    "sudo usbyte-opt bench lab-transformer --bandwidth 200mbit -s ddp -k 8 --rounds 3": _LAB,
    "usbyte-opt bench lab-transformer -s ddp -k 8 --rounds 3":
        "long run: trains 2 strategies x 3 rounds (tests/test_bench.py runs bench)",
    "python benchmarks/planner.py": "benchmark: long run",
    "python benchmarks/planner_scale.py": "benchmark: long run",
    "python benchmarks/runtime_overhead.py": "benchmark: long run",
    "python benchmarks/host_overhead.py": "benchmark: long run",
    "python benchmarks/gpu_lab.py": "benchmark: long run",
    "python benchmarks/demo_prediction.py": "benchmark: long run",
    "usbyte-opt bench lab-cnn --nproc-per-node 1 --device cpu --emulate 8x1gbit --strategies "
    "ddp,best": "long run: trains 2 strategies on an emulated link (tests/test_bench_emulate.py "
                "runs bench --emulate)",
    "usbyte-opt bench lab-cnn --nproc-per-node 1 --device cpu --emulate 8x1gbit --strategies "
    "ddp,best --iterations 12": "long run: trains 2 strategies on an emulated link "
                                "(tests/test_bench_emulate.py runs bench --emulate)",
    "python benchmarks/profiler_overhead.py": "benchmark: long run",
    "python benchmarks/real_training.py": _LAB,
    "python benchmarks/sharded_lab.py": _LAB,
    "python -m venv /tmp/tvenv": "regenerates the shipped profiles in another environment "
                                 "(torchvision; long run)",
    "/tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers": _INSTALL,
    "/tmp/tvenv/bin/pip install --no-deps -e .": _INSTALL,
    "/tmp/tvenv/bin/pip install scipy numpy typer rich pulp": _INSTALL,
    "/tmp/tvenv/bin/python benchmarks/make_profiles.py": "regenerates the shipped profiles in "
                                                         "another environment (torchvision; long run)",
}

#: Inline spans that quote a command's option without its arguments (not a command to run).
FRAGMENTS: dict[str, str] = {
    "usbyte-opt optimize --mode fence": "an option of optimize, quoted without its PROFILE",
    "usbyte-opt optimize --strategy ddp-tuned": "an option of optimize, quoted without its PROFILE",
    "usbyte-opt launch --schedule auto": "an option of launch, quoted without its script",
}

#: The trainer examples' three steps (README and docs/integrations.md), the README's
#: ``launch --schedule auto`` and the two-rank CPU profile of ``cnn``: run with ``-m slow``.
SLOW_MARK = re.compile(r"(lightning|hf|accelerate)_train\b|profiles/(pl|hf|acc)\.json"
                       # planning in the run (about 45 s): tests/test_launch.py runs launch
                       # --schedule auto in the default suite
                       r"|launch --schedule auto"
                       # a full profile on two ranks (about 25 s): tests/test_profiler.py
                       # profiles on two ranks through the CLI in the default suite
                       r"|profile cnn --nproc-per-node 2")

_SUBCOMMANDS = {"profile", "optimize", "simulate", "launch", "bench", "demo", "schema"}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str
    inline: bool

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}:{self.text[:60]}"


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _fenced(doc: str, text: str) -> list[Command]:
    out = []
    for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
        first = text.count("\n", 0, m.start(1)) + 1
        lines = m.group(1).split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i]
            i += 1
            for part in _strip_comment(line).split("&&"):
                if part.strip():
                    out.append(Command(doc, first + start, _normalise(part), False))
    return out


def _strip_comment(line: str) -> str:
    """``line`` without its shell comment (a ``#`` outside quotes that starts a word)."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k]
    return line


def _inline(doc: str, text: str) -> list[Command]:
    out = []
    masked = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", masked):
        span = _normalise(m.group(1).replace("\\|", "|"))
        if re.match(r"(sudo )?usbyte-opt ", span):
            out.append(Command(doc, text.count("\n", 0, m.start()) + 1, span, True))
    return out


def commands() -> list[Command]:
    """Every command of the documents, in document order, each once (the first place it is)."""
    seen: set[str] = set()
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        found = sorted(_fenced(doc, text) + _inline(doc, text), key=lambda c: c.line)
        for c in found:
            if c.text not in seen:
                seen.add(c.text)
                out.append(c)
    return out


def why_not_run(c: Command) -> str | None:
    """Why ``c`` is not run (a skip reason), or ``None``: it runs."""
    if c.text in SKIP:
        return SKIP[c.text]
    if c.text in FRAGMENTS:
        return FRAGMENTS[c.text]
    words = c.text.split()
    if c.inline and len(words) == 2 and words[1] in _SUBCOMMANDS:
        return "names the command (not an invocation)"
    for w in words:
        if "=" in w and not w.startswith("-"):
            continue
        if w in ("...", "|") or "|" in w or w.startswith("[") or re.search(r"(^|[/:])[A-Z][A-Z_]*(\.json)?$", w):
            return f"a template ({w} stands for a value), not a command"
    return None


def _params() -> list:
    out = []
    for c in commands():
        marks = [pytest.mark.slow] if SLOW_MARK.search(c.text) and why_not_run(c) is None else []
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


# --------------------------------------------------------------------------------------------
# The fresh clone
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files (tracked, and new ones not ignored) in a folder whose git index
    tracks what the repository tracks."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed (the copy needs an index of the shipped files)")
    dest = tmp_path_factory.mktemp("clone")

    def listed(*args: str) -> list[str]:
        res = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", *args],
                             capture_output=True, check=True)
        return [f for f in res.stdout.decode().split("\0") if f]

    tracked = listed()
    for f in tracked + listed("--others", "--exclude-standard"):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    present = [f for f in tracked if (dest / f).is_file()]
    for k in range(0, len(present), 200):
        subprocess.run(["git", "-C", str(dest), "add", "--", *present[k:k + 200]], check=True)
    return dest


def _argv(c: Command, clone: Path) -> tuple[list[str], dict[str, str]]:
    words = shlex.split(c.text)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(clone))
    env.pop("COLUMNS", None)
    while words and re.match(r"^[A-Z_]+=", words[0]):
        name, _, value = words.pop(0).partition("=")
        if name == "PYTHONPATH":
            value = os.pathsep.join([*(str(clone / v) for v in value.split(os.pathsep)), str(clone)])
        env[name] = value
    if words[0] == "usbyte-opt":
        words = [sys.executable, "-m", "usbyte_opt", *words[1:]]
        sub = words[3] if len(words) > 3 else ""
        words += FAST.get(sub, [])
        if sub == "launch":
            script = next((w for w in words if w.endswith(".py")), "")
            words += FAST.get(script, [])
    elif words[0] == "python":
        words = [sys.executable, *words[1:]]
    return words, env


@pytest.mark.parametrize("command", _params())
def test_documented_command_runs_as_written(command: Command, clone: Path):
    why = why_not_run(command)
    if why is not None:
        pytest.skip(f"{command.text}: {why}")
    argv, env = _argv(command, clone)
    res = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (f"{command.doc}:{command.line}: {command.text}\n"
                                 f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-3000:]}")
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    changed = subprocess.run(["git", "-C", str(clone), "diff", "--name-status"],  # against the index
                             capture_output=True, text=True, check=True).stdout
    assert not changed.strip(), f"{command.text} changed tracked files:\n{changed}"


def test_every_listed_skip_is_a_documented_command():
    """No stale entry: each command :data:`SKIP` and :data:`FRAGMENTS` name is in a document."""
    texts = {c.text for c in commands()}
    assert not (set(SKIP) | set(FRAGMENTS)) - texts, (set(SKIP) | set(FRAGMENTS)) - texts


def test_the_commands_found_include_each_kind():
    """The extraction sees the fenced lines, the ``&&`` chains and the inline spans."""
    texts = {c.text for c in commands()}
    assert "usbyte-opt optimize profiles/resnet50.json -o schedules/my-resnet50.json" in texts
    assert "usbyte-opt profile transformer --alpha-ms 0.5 --algbw-gbs 10" in texts
    assert any(c.inline and "--schedule auto --auto-dir" in c.text for c in commands())
    assert all(why_not_run(c) is not None or not c.text.startswith("sudo") for c in commands())


def test_the_quick_start_keeps_the_shipped_schedule(clone: Path):
    """``optimize`` on a shipped profile, with its default output (the shipped schedule): one
    line, exit code 2, the file untouched; ``--force`` would replace it."""
    before = (clone / "schedules" / "resnet50.json").read_bytes()
    env = dict(os.environ, PYTHONPATH=str(clone))
    res = subprocess.run([sys.executable, "-m", "usbyte_opt", "optimize", "profiles/resnet50.json"],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().count("\n") == 0 and "--force" in res.stderr, res.stderr
    assert "schedules/resnet50.json" in res.stderr
    assert (clone / "schedules" / "resnet50.json").read_bytes() == before
