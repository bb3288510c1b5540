"""Fuzzing the file formats through ``optimize`` and ``simulate``.

The shipped profiles and schedules are mutated (fields deleted, duplicated, retyped, nested
wrongly; extreme and non-finite numbers; huge shapes; cut-off text), written to real files and
run through the CLI in-process. Every case must end in either a clean usbyte-opt error (one
line on stderr, an exit code of :class:`~usbyte_opt.errors.UsbyteError`, no output file) or a
valid output (pure JSON with finite numbers, a schedule that loads and fits the profile). A few
cases run as real subprocesses under an address-space limit, so that memory stays bounded.

The default run checks 400 cases (derandomized, so CI sees the same ones); ``-m slow`` runs
more, with fresh random cases.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from usbyte_opt.cli.main import main
from usbyte_opt.errors import FormatError
from usbyte_opt.formats import (
    MAX_GRADIENT_BYTES,
    MAX_MS,
    MIN_ALGBW_GBS,
    check_against,
    dump_profile,
    dump_schedule,
    load_profile,
    load_schedule,
    parse_profile,
    parse_schedule,
    profile_schema,
    schedule_schema,
)

ROOT = Path(__file__).resolve().parent.parent
PROFILES = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "profiles").glob("*.json"))}
SCHEDULES = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "schedules").glob("*.json"))}
NAMES = sorted(set(PROFILES) & set(SCHEDULES))

#: Exit codes of usbyte-opt's errors (errors.py).
CLEAN_CODES = {1, 2, 3, 4}

NUMBERS = [0, -0.0, -1, 1, 0.5, 5e-324, 1e-320, 1e-300, 1e-7, MIN_ALGBW_GBS, 1e5, 1e5 + 1,
           MAX_MS, MAX_MS * (1 + 1e-12), 1e13, 1e300, sys.float_info.max, 2**53 + 1, 2**63,
           2**64 + 1, 10**30, float("nan"), float("inf"), float("-inf")]
OTHERS: list[Any] = ["", "x", "float32", "overlap", [], {}, [1, 2], {"a": 1}, True, False, None]
#: Shapes from absurd to large but allowed (1e11 float32 elements plan in well under a second).
SHAPES = [[2**62], [2**31, 2**31, 2**31], [10**13], [10**100], [10**6] * 3, [2**40, 2**20],
          [10**6, 10**5], [10**9], [0], [], [1] * 200, [-3], [2.5], ["4"]]
SLOW_SHAPES = [[10**12] * 2, [2 * 10**12], [10**6, 10**6, 4]]  # at the bound: seconds each


# --------------------------------------------------------------------------------------------
# Mutations of a JSON document
# --------------------------------------------------------------------------------------------


def children(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return sorted(v)
    if isinstance(v, list):
        return list(range(len(v)))
    return []


def draw_path(draw: Any, doc: Any, stop: float = 0.3) -> list[Any]:
    """A random path from the root: at each container, stop there or go into one child."""
    path: list[Any] = []
    v = doc
    while children(v) and not (path and draw(st.floats(0, 1)) < stop):
        k = draw(st.sampled_from(children(v)))
        path.append(k)
        v = v[k]
    return path


def get(doc: Any, path: list[Any]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def put(doc: Any, path: list[Any], value: Any) -> Any:
    if not path:
        return value
    get(doc, path[:-1])[path[-1]] = value
    return doc


def numeric_paths(doc: Any, path: tuple = ()) -> list[list[Any]]:
    if isinstance(doc, bool):
        return []
    if isinstance(doc, (int, float)):
        return [list(path)]
    return [p for k in children(doc) for p in numeric_paths(doc[k], path + (k,))]


#: Numbers every profile or schedule has, drawn as often as all the others together.
KEY_NUMBERS = [["forward_ms"], ["backward_ms"], ["comm", "world_size"], ["comm", "alpha_ms"],
               ["comm", "algbw_gbs"], ["comm", "cpu_ms_per_block"], ["comm", "cpu_ms_per_mb"],
               ["world_size"], ["buffers", 0, "numel"], ["blocks", 0, "end"], ["blocks", 0, "start"],
               ["predicted", "iteration_ms"], ["tensors", 0, "ready_ms"], ["tensors", 0, "need_ms"],
               ["tensors", 0, "update_ms"]]


def mutate(draw: Any, doc: Any, kind: str, shapes: list[list[Any]]) -> Any:
    """One mutation of ``doc`` (a profile or schedule, ``kind``)."""
    op = draw(st.sampled_from(["delete", "duplicate", "retype", "number", "number", "shape",
                                    "nest", "unnest", "drop", "swap"]))
    if op == "number":
        if draw(st.booleans()):
            path = draw(st.sampled_from(KEY_NUMBERS))
            try:
                parent = get(doc, path[:-1])
            except (KeyError, IndexError, TypeError):
                return doc
            if not isinstance(parent, dict):  # a mutation before made it something else
                return doc
        else:
            paths = numeric_paths(doc)
            if not paths:
                return doc
            path = draw(st.sampled_from(paths))
        return put(doc, path, draw(st.sampled_from(NUMBERS)))
    if op == "shape":
        shape = copy.deepcopy(draw(st.sampled_from(shapes)))
        if kind == "profile" and isinstance(doc, dict) and isinstance(doc.get("tensors"), list) \
                and doc["tensors"] and isinstance(doc["tensors"][0], dict):
            i = draw(st.integers(0, len(doc["tensors"]) - 1))
            if isinstance(doc["tensors"][i], dict):
                doc["tensors"][i]["shape"] = shape
        elif kind == "schedule" and isinstance(doc, dict) and isinstance(doc.get("shapes"), dict) \
                and doc["shapes"]:
            doc["shapes"][draw(st.sampled_from(sorted(doc["shapes"])))] = shape
        return doc
    path = draw_path(draw, doc)
    target = get(doc, path)
    if op == "delete":
        if path:
            parent = get(doc, path[:-1])
            del parent[path[-1]]
        return doc
    if op == "duplicate":  # a list entry twice; for an object, see dump(duplicate_key=...)
        if isinstance(target, list) and target:
            i = draw(st.integers(0, len(target) - 1))
            target.insert(draw(st.integers(0, len(target))), copy.deepcopy(target[i]))
        return doc
    if op == "retype":
        return put(doc, path, copy.deepcopy(draw(st.sampled_from(OTHERS + NUMBERS))))
    if op == "nest":
        return put(doc, path, draw(st.sampled_from([[target], {"value": target}])))
    if op == "unnest":
        if children(target):
            return put(doc, path, target[draw(st.sampled_from(children(target)))])
        return doc
    if op == "drop":  # a whole entry of a list: a tensor, a buffer, a block, a sample
        if isinstance(target, list) and target:
            del target[draw(st.integers(0, len(target) - 1))]
        return doc
    if isinstance(target, list) and len(target) > 1:  # swap two entries: often still valid
        i, j = draw(st.integers(0, len(target) - 1)), draw(st.integers(0, len(target) - 1))
        target[i], target[j] = target[j], target[i]
    return doc


def dump(doc: Any, duplicate: tuple[int, str, Any] | None = None) -> str:
    """JSON text of ``doc``, one value a line as usbyte-opt writes it; ``duplicate = (id(obj),
    key, value)`` writes ``key`` of that object twice (first ``value``, then its own), as a
    hand-edited file might."""
    if duplicate is None:
        return json.dumps(doc, indent=1)
    oid, key, value = duplicate

    def enc(v: Any) -> str:
        if isinstance(v, dict):
            items = [f"{json.dumps(k)}: {enc(x)}" for k, x in v.items()]
            if id(v) == oid:
                items.insert(0, f"{json.dumps(key)}: {enc(value)}")
            return "{" + ", ".join(items) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(enc(x) for x in v) + "]"
        return json.dumps(v)

    return enc(doc)


@st.composite
def mutated(draw: Any, kind: str, shapes: list[list[Any]],
            names: list[str] = NAMES) -> tuple[str, str]:
    """(model name, JSON text of a mutated shipped profile or schedule)."""
    name = draw(st.sampled_from(names))
    doc = copy.deepcopy((PROFILES if kind == "profile" else SCHEDULES)[name])
    for _ in range(draw(st.integers(1, 3))):
        doc = mutate(draw, doc, kind, shapes)
    duplicate = None
    if draw(st.integers(0, 9)) == 0:
        path = draw_path(draw, doc, stop=0.5)
        obj = get(doc, path)
        if isinstance(obj, dict) and obj:
            duplicate = (id(obj), draw(st.sampled_from(sorted(obj))),
                         draw(st.sampled_from(OTHERS + NUMBERS)))
    text = dump(doc, duplicate)
    if draw(st.integers(0, 9)) == 0:
        text = text[:int(len(text) * draw(st.floats(0, 1, exclude_max=True)))]
    return name, text


# --------------------------------------------------------------------------------------------
# Running a case and judging the outcome
# --------------------------------------------------------------------------------------------


#: How Python formats a number that is not finite.
NON_FINITE = re.compile(r"\b(nan|inf)\b")


def _no_constants(name: str) -> Any:
    raise AssertionError(f"non-finite number {name} in the output")


def finite_json(text: str) -> Any:
    """Parse pure JSON: NaN and Infinity are not JSON, and the output must have none."""
    return json.loads(text, parse_constant=_no_constants)


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def assert_clean_error(code: int, err: str) -> None:
    assert code in CLEAN_CODES, (code, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


def check_optimize(folder: Path, text: str, output: str = "--json") -> None:
    """``optimize`` on a profile's ``text``; ``output``: ``--json``, or the table (``--wide``
    or not), whose numbers are formatted for people."""
    prof, out = folder / "profile.json", folder / "schedule.json"
    prof.write_text(text)
    out.unlink(missing_ok=True)
    code, stdout, err = cli("optimize", str(prof), "-o", str(out), "--time-budget", "0",
                            *([output] if output else []))
    if code:
        assert_clean_error(code, err)
        assert not out.exists(), "a schedule was written although optimize failed"
        return
    sched = load_schedule(out)  # validates it, predictions included
    check_against(sched, load_profile(prof), str(out))
    if output == "--json":
        doc = finite_json(stdout)
        assert doc["output"] == str(out)
        assert all(math.isfinite(r["iteration_ms"]) for r in doc["strategies"].values())
    else:
        assert "lower bound" in stdout and not NON_FINITE.search(stdout), stdout


def check_simulate(folder: Path, profile_text: str, schedule_text: str,
                   output: str = "--json") -> None:
    prof, sched = folder / "sim-profile.json", folder / "sim-schedule.json"
    prof.write_text(profile_text)
    sched.write_text(schedule_text)
    code, stdout, err = cli("simulate", str(prof), str(sched), *([output] if output else []))
    if code:
        assert_clean_error(code, err)
        return
    if output == "--json":
        doc = finite_json(stdout)
        assert doc["iteration_ms"] > 0 and doc["lower_bound_ms"] > 0
    else:
        assert "iteration" in stdout and not NON_FINITE.search(stdout), stdout


def run_case(folder: Path, draw: Any, shapes: list[list[Any]]) -> None:
    which = draw(st.sampled_from(["optimize", "simulate-profile", "simulate-schedule"]))
    output = draw(st.sampled_from(["--json", "--json", "--wide", ""]))
    if which == "simulate-schedule":
        name, text = draw(mutated("schedule", shapes))
        check_simulate(folder, json.dumps(PROFILES[name]), text, output)
        return
    name, text = draw(mutated("profile", shapes))
    if which == "optimize":
        check_optimize(folder, text, output)
    else:
        check_simulate(folder, text, json.dumps(SCHEDULES[name]), output)


FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(FUZZ, max_examples=100, derandomize=True)
@given(data=st.data())
def test_mutated_files_give_a_clean_error_or_a_valid_output(folder: Path, data: st.DataObject):
    run_case(folder, data.draw, SHAPES)


@pytest.mark.slow
@settings(FUZZ, max_examples=int(os.environ.get("USBYTE_FUZZ_EXAMPLES", "10000")))
@given(data=st.data())
def test_mutated_files_many(folder: Path, data: st.DataObject):
    run_case(folder, data.draw, SHAPES + SLOW_SHAPES)


# --------------------------------------------------------------------------------------------
# Real subprocesses with bounded memory
# --------------------------------------------------------------------------------------------

#: Address space each subprocess may use; planning at the bounds needs a fraction of it.
MEMORY_LIMIT = 4 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_limited(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "usbyte_opt", *argv], capture_output=True,
                          text=True, timeout=300, preexec_fn=_limit_memory, check=False)


def at_the_bound(doc: dict) -> dict:
    """A profile whose tensors hold exactly the most gradient bytes allowed."""
    t = doc["tensors"]
    per = MAX_GRADIENT_BYTES // 2 // len(t)
    for x in t:
        x.update(shape=[per], dtype="float16")
    t[0]["shape"] = [MAX_GRADIENT_BYTES // 2 - per * (len(t) - 1)]
    return doc


def over_the_bound(doc: dict) -> dict:
    doc["tensors"][0]["shape"] = [2**31, 2**31, 2**31]
    return doc


def extremes(doc: dict) -> dict:
    """Every time at an hour, the slowest bandwidth, the most ranks: all allowed."""
    doc.update(forward_ms=MAX_MS, backward_ms=MAX_MS)
    for t in doc["tensors"]:
        t.update(ready_ms=MAX_MS, need_ms=0.0, update_ms=MAX_MS)
    doc["comm"].update(alpha_ms=MAX_MS, algbw_gbs=MIN_ALGBW_GBS, world_size=10**7,
                       cpu_ms_per_block=MAX_MS, cpu_ms_per_mb=MAX_MS)
    return doc


@pytest.mark.parametrize("edit, ok", [(at_the_bound, True), (over_the_bound, False),
                                      (extremes, True)], ids=["at-bound", "over-bound", "extremes"])
def test_subprocess_bounds(tmp_path: Path, edit: Any, ok: bool):
    prof, out = tmp_path / "p.json", tmp_path / "s.json"
    prof.write_text(json.dumps(edit(copy.deepcopy(PROFILES["vgg16"]))))
    res = run_limited("optimize", str(prof), "-o", str(out), "--json", "--time-budget", "0")
    if ok:
        assert res.returncode == 0, res.stderr
        finite_json(res.stdout)
        load_schedule(out)
        sim = run_limited("simulate", str(prof), str(out), "--json")
        assert sim.returncode == 0, sim.stderr
        finite_json(sim.stdout)
    else:
        assert_clean_error(res.returncode, res.stderr)
        assert "tensors[0].shape" in res.stderr and not out.exists()


@settings(FUZZ, max_examples=8, derandomize=True)
@given(case=mutated("profile", SHAPES))
def test_subprocess_mutated_profiles(folder: Path, case: tuple[str, str]):
    prof, out = folder / "sub-profile.json", folder / "sub-schedule.json"
    prof.write_text(case[1])
    out.unlink(missing_ok=True)
    res = run_limited("optimize", str(prof), "-o", str(out), "--json", "--time-budget", "0")
    if res.returncode:
        assert_clean_error(res.returncode, res.stderr)
        assert not out.exists()
    else:
        finite_json(res.stdout)
        load_schedule(out)


# --------------------------------------------------------------------------------------------
# The JSON Schema and the validation agree
# --------------------------------------------------------------------------------------------

#: Expectations of the checks across fields, which a JSON Schema cannot state (its
#: descriptions do): a file may pass the schema and fail one of these.
ACROSS_FIELDS = re.compile(r"expected (a unique name|a number in \[0, |a shape of at most|"
                           r"at most \S+ bytes of gradients|a name listed once|a numel on every|"
                           r"a buffer index <|an offset|blocks covering)")


@settings(FUZZ, max_examples=300, derandomize=True)
@given(kind=st.sampled_from(["profile", "schedule"]), data=st.data())
def test_schema_and_validation_agree(kind: str, data: st.DataObject):
    """Whatever loads passes the printed JSON Schema; whatever the schema rejects does not
    load. A file the schema accepts may still fail a check across fields, or hold what JSON
    Schema counts as an integer and usbyte-opt does not (``2.0``), or a non-finite number,
    which is not JSON."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = profile_schema() if kind == "profile" else schedule_schema()
    validator = jsonschema.Draft202012Validator(schema)
    _, text = data.draw(mutated(kind, SHAPES, names=["vgg16", "resnet50", "gpt2"]))
    try:
        doc = json.loads(text)
    except ValueError:
        return
    parse = parse_profile if kind == "profile" else parse_schedule
    error: FormatError | None = None
    try:
        parse(doc, "f.json")
    except FormatError as e:
        error = e
    if error is None:
        assert validator.is_valid(doc), next(validator.iter_errors(doc)).message
    elif validator.is_valid(doc):
        got = error.got
        assert ACROSS_FIELDS.search(str(error)) or (
            isinstance(got, float) and (not math.isfinite(got) or got.is_integer())
            or isinstance(got, list) and any(isinstance(x, float) for x in got)), str(error)


@settings(FUZZ, max_examples=200, derandomize=True)
@given(kind=st.sampled_from(["profile", "schedule"]), data=st.data())
def test_what_loads_is_written_back_as_it_was_read(kind: str, data: st.DataObject):
    """The check of what is written (plain Python, no pydantic) accepts whatever the reader
    (pydantic) accepted, and what it writes reads back as the same object."""
    _, text = data.draw(mutated(kind, SHAPES, names=["vgg16", "resnet50", "gpt2"]))
    try:
        doc = json.loads(text)
    except ValueError:
        return
    parse = parse_profile if kind == "profile" else parse_schedule
    dump = dump_profile if kind == "profile" else dump_schedule
    try:
        obj = parse(doc, "f.json")
    except FormatError:
        return
    written = dump(obj, "g.json")  # type: ignore[arg-type]
    assert json.dumps(dump(parse(written, "g.json"))) == json.dumps(written)  # type: ignore[arg-type]
