"""Profile and schedule files: round trips, validation errors that name file and field,
physical bounds, atomic writes, JSON Schemas (tests/test_fuzz.py mutates files at random)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from helpers import MB_F32, three_layer

from usbyte_opt.errors import FormatError, MismatchError
from usbyte_opt.formats import (
    COMM_BACKENDS,
    DTYPE_SIZES,
    MAX_GRADIENT_BYTES,
    SCHEDULE_MODES,
    Block,
    CollectiveCost,
    CommSpec,
    HostCost,
    check_against,
    dump_profile,
    dump_schedule,
    fingerprint,
    load_profile,
    load_schedule,
    profile_schema,
    read_json,
    save_profile,
    save_schedule,
    schedule_schema,
    write_json,
)
from usbyte_opt.planning.problem import Problem


@pytest.fixture
def files(tmp_path):
    prof = three_layer()
    pb = Problem.from_profile(prof)
    lay = pb.layout()
    sched = pb.schedule("hand", lay, [Block(0, 0, MB_F32), Block(0, MB_F32, 3 * MB_F32)],
                        {"iteration_ms": 1.0})
    pp, sp = tmp_path / "p.json", tmp_path / "s.json"
    save_profile(prof, pp)
    save_schedule(sched, sp)
    return prof, sched, pp, sp


def test_round_trip(files):
    prof, sched, pp, sp = files
    # a profile without a host section reads with the documented defaults (not written back)
    assert load_profile(pp) == dataclasses.replace(prof, host=HostCost.default(prof.meta.get("device")))
    back = load_schedule(sp)
    assert back.blocks == sched.blocks and back.buffers == sched.buffers
    assert back.fingerprint == prof.fingerprint() and back.profile_digest == prof.digest()
    assert back.digest() == sched.digest()


def test_unknown_fields_survive_a_round_trip(files, tmp_path):
    _, _, _, sp = files
    d = json.loads(sp.read_text())
    d["note"] = {"kept": True}
    sp.write_text(json.dumps(d))
    save_schedule(load_schedule(sp), tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["note"] == {"kept": True}


def mutate(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("fn, field, expected", [
    (lambda d: d["tensors"][1].update(ready_ms=-1), "tensors[1].ready_ms", "a number in [0, 6]"),
    (lambda d: d["tensors"][0].update(need_ms=9), "tensors[0].need_ms", "a number in [0, 4]"),
    (lambda d: d["tensors"][0].update(ready_ms="1"), "tensors[0].ready_ms", "a number"),
    (lambda d: d["tensors"][2].update(name="out"), "tensors[2].name", "a unique name"),
    (lambda d: d["tensors"][0].update(shape=[0]), "tensors[0].shape", "integers >= 1"),
    (lambda d: d["tensors"][0].update(dtype="int8"), "tensors[0].dtype", "one of"),
    (lambda d: d.pop("backward_ms"), "backward_ms", "field is missing"),
    (lambda d: d.update(forward_ms=0), "forward_ms", "a number > 0"),
    (lambda d: d["comm"].update(algbw_gbs=0), "comm.algbw_gbs", "a number > 0"),
    (lambda d: d["comm"].update(world_size=1.5), "comm.world_size", "an integer >= 1"),
    (lambda d: d.update(tensors={}), "tensors", "an array"),
    (lambda d: d.update(version=2), "version", "1"),
    (lambda d: d.update(format="usbyte-schedule"), "format", "usbyte-profile"),
    (lambda d: d["comm"].update(reduce_scatter={"alpha_ms": 1.0, "algbw_gbs": 0}),
     "comm.reduce_scatter.algbw_gbs", "a number > 0"),
    (lambda d: d["comm"].update(all_gather={"algbw_gbs": 1.0}), "comm.all_gather.alpha_ms",
     "field is missing"),
    (lambda d: d["comm"].update(all_gather=[1.0, 2.0]), "comm.all_gather", "an object"),
    (lambda d: d["comm"].update(reduce_scatter={"alpha_ms": -1, "algbw_gbs": 1.0}),
     "comm.reduce_scatter.alpha_ms", "a number in [0, 3600000]"),
    (lambda d: d["comm"].update(all_gather={"alpha_ms": 1, "algbw_gbs": 1.0,
                                            "samples": [{"bytes": 0, "ms": 1.0}]}),
     "comm.all_gather.samples[0].bytes", "an integer >= 1"),
])
def test_profile_errors_name_file_field_and_expectation(files, fn, field, expected):
    _, _, pp, _ = files
    mutate(pp, fn)
    with pytest.raises(FormatError) as e:
        load_profile(pp)
    msg = str(e.value)
    assert msg.startswith(f"{pp}: {field}: expected") and expected in msg
    assert "\n" not in msg


@pytest.mark.parametrize("fn, field, expected", [
    (lambda d: d["tensors"][0].update(shape=[2**31, 2**31, 2**31]), "tensors[0].shape",
     "a shape of at most 2.5e+12 elements (1e+13 bytes of float32)"),
    (lambda d: d["tensors"][0].update(shape=[10**13]), "tensors[0].shape",
     "a list of integers >= 1 and <= 5e+12"),
    (lambda d: [t.update(shape=[2 * 10**12], dtype="float16") for t in d["tensors"]], "tensors",
     "at most 1e+13 bytes of gradients in all"),
    (lambda d: d["comm"].update(algbw_gbs=1e300), "comm.algbw_gbs",
     "a number > 0, from 1e-06 to 100000"),
    (lambda d: d["comm"].update(algbw_gbs=1e-9), "comm.algbw_gbs", "from 1e-06 to 100000"),
    (lambda d: d["comm"].update(alpha_ms=1e7), "comm.alpha_ms", "a number in [0, 3600000]"),
    (lambda d: d.update(forward_ms=3.6e6 + 1), "forward_ms", "a number > 0 and <= 3600000"),
    (lambda d: d["tensors"][0].update(update_ms=1e9), "tensors[0].update_ms", "in [0, 3600000]"),
    (lambda d: d["comm"].update(world_size=10**8), "comm.world_size", "an integer >= 1 and <= 10000000"),
    (lambda d: d["comm"].update(samples=[{"bytes": 10**14, "ms": 1.0}]), "comm.samples[0].bytes",
     "<= 1e+13"),
    (lambda d: d.update(backward_ms=float("nan")), "backward_ms", "a number > 0"),
    (lambda d: d["tensors"][0].update(need_ms=float("inf")), "tensors[0].need_ms", "a number in [0, 4]"),
    (lambda d: d["tensors"][0].update(ready_ms=True), "tensors[0].ready_ms", "a number in [0, 6]"),
])
def test_physical_bounds(files, fn, field, expected):
    _, _, pp, _ = files
    mutate(pp, fn)
    with pytest.raises(FormatError) as e:
        load_profile(pp)
    assert str(e.value).startswith(f"{pp}: {field}: expected") and expected in str(e.value)
    assert "\n" not in str(e.value)


def test_the_most_bytes_allowed_load(files):
    _, _, pp, _ = files
    per = MAX_GRADIENT_BYTES // 2 // 3
    mutate(pp, lambda d: [t.update(shape=[per], dtype="float16") for t in d["tensors"]])
    assert sum(t.nbytes for t in load_profile(pp).tensors) <= MAX_GRADIENT_BYTES


@pytest.mark.parametrize("fn, field, expected", [
    (lambda d: d["blocks"].pop(), "buffers[0]", "covering all 750000"),
    (lambda d: d["blocks"][1].update(start=10), "blocks[1]", "overlaps"),
    (lambda d: d["blocks"][1].update(start=MB_F32 + 5), "blocks[1]", "uncovered"),
    (lambda d: d["blocks"][0].update(end=0), "blocks[0].end", "an offset > start"),
    (lambda d: d["blocks"][0].update(buffer=3), "blocks[0].buffer", "a buffer index < 1"),
    (lambda d: d["blocks"][1].update(end=10 ** 9), "blocks[1].end", "<= the buffer's numel"),
    (lambda d: d["buffers"][0]["tensors"].append("out"), "buffers[0].tensors[3]", "listed once"),
    (lambda d: d.pop("fingerprint"), "fingerprint", "missing"),
    (lambda d: d["buffers"][0].update(numel=10**15), "buffers[0].numel", "<= 5e+12"),
    (lambda d: d["predicted"].update(iteration_ms="fast"), "predicted.iteration_ms", "a number >= 0"),
    (lambda d: d.update(mode="sideways"), "mode", "one of overlap|fence"),
    (lambda d: d["shapes"].update(out=[0]), "shapes.out", "a list of integers >= 1"),
])
def test_schedule_errors(files, fn, field, expected):
    _, _, _, sp = files
    mutate(sp, fn)
    with pytest.raises(FormatError) as e:
        load_schedule(sp)
    assert str(e.value).startswith(f"{sp}: {field}: expected") and expected in str(e.value)


def test_truncated_and_missing_files(tmp_path, files):
    _, _, pp, _ = files
    cut = tmp_path / "cut.json"
    cut.write_text(pp.read_text()[:120])
    with pytest.raises(FormatError, match=r"cut.json: line \d+ column \d+: expected valid JSON"):
        load_profile(cut)
    with pytest.raises(FormatError, match="expected an existing file"):
        load_profile(tmp_path / "nope.json")


def test_schedule_against_other_profile(files):
    prof, sched, _, _ = files
    from usbyte_opt.formats import Profile, TensorSpec

    renamed = Profile(prof.name, prof.forward_ms, prof.backward_ms,
                      (prof.tensors[0], prof.tensors[1],
                       TensorSpec("inp", (250_000,), "float32", 6.0, 0.0)), prof.comm)
    with pytest.raises(MismatchError, match="fingerprint"):
        check_against(sched, renamed)
    fewer = Profile(prof.name, prof.forward_ms, prof.backward_ms, prof.tensors[:2], prof.comm)
    with pytest.raises(MismatchError, match="'inp' is not in profile"):
        check_against(sched, fewer)


def test_fingerprint_ignores_order_but_not_shapes():
    a = fingerprint([("x", (2, 3), "float32"), ("y", (4,), "float16")])
    assert a == fingerprint([("y", [4], "float16"), ("x", [2, 3], "float32")])
    assert a != fingerprint([("x", (3, 2), "float32"), ("y", (4,), "float16")])


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    p = tmp_path / "x.json"
    write_json(p, {"a": 1})
    with pytest.raises(TypeError):
        write_json(p, {"a": object()})
    assert json.loads(p.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["x.json"]


def test_schemas_accept_written_files(files):
    jsonschema = pytest.importorskip("jsonschema")
    _, _, pp, sp = files
    for schema in (profile_schema(), schedule_schema()):
        jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(json.loads(pp.read_text()), profile_schema())
    jsonschema.validate(json.loads(sp.read_text()), schedule_schema())


def test_schemas_are_json():
    for s in (profile_schema(), schedule_schema()):
        assert json.loads(json.dumps(s))["type"] == "object"
        assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_schemas_state_the_bounds_and_names_the_code_uses():
    p, s = profile_schema(), schedule_schema()
    tensor, comm = p["$defs"]["TensorEntry"]["properties"], p["$defs"]["CommEntry"]["properties"]
    assert tensor["dtype"]["enum"] == list(DTYPE_SIZES)
    assert comm["backend"]["enum"] == list(COMM_BACKENDS)
    assert s["properties"]["mode"]["enum"] == list(SCHEDULE_MODES)
    assert comm["algbw_gbs"]["maximum"] == 1e5 and comm["world_size"]["maximum"] == 10**7
    assert p["properties"]["forward_ms"] == {"exclusiveMinimum": 0, "maximum": 3.6e6,
                                             "type": "number"}


def test_shipped_files_load_with_their_digests():
    root = os.path.join(os.path.dirname(__file__), "..")
    for name in ("resnet50", "vgg16", "densenet201", "bert-base", "gpt2", "resnet152"):
        prof = load_profile(os.path.join(root, "profiles", f"{name}.json"))
        sched = load_schedule(os.path.join(root, "schedules", f"{name}.json"))
        assert sched.profile_digest == prof.digest() and sched.fingerprint == prof.fingerprint()
        check_against(sched, prof)


def test_shipped_profiles_have_no_sharded_lines_and_write_back_byte_identical(tmp_path):
    root = os.path.join(os.path.dirname(__file__), "..")
    for name in ("resnet50", "vgg16", "densenet201", "bert-base", "gpt2", "resnet152"):
        path = os.path.join(root, "profiles", f"{name}.json")
        prof = load_profile(path)
        assert prof.comm.reduce_scatter is None and prof.comm.all_gather is None
        out = tmp_path / f"{name}.json"
        save_profile(prof, out)
        assert out.read_bytes() == open(path, "rb").read(), name


def _sharded(prof):
    return prof.with_comm(dataclasses.replace(
        prof.comm, reduce_scatter=CollectiveCost(0.4, 2.0, ((4096, 0.41), (1 << 20, 0.9))),
        all_gather=CollectiveCost(0.5, 2.5)))


def test_profiles_with_and_without_sharded_lines_round_trip_byte_identically(tmp_path):
    plain, sharded = three_layer(), _sharded(three_layer())
    for prof in (plain, sharded):
        a, b = tmp_path / "a.json", tmp_path / "b.json"
        save_profile(prof, a)
        back = load_profile(a)
        assert back == dataclasses.replace(prof, host=HostCost.default()) and back.digest() == prof.digest()
        save_profile(back, b)
        assert a.read_bytes() == b.read_bytes()
    raw = dump_profile(plain)["comm"]
    assert "reduce_scatter" not in raw and "all_gather" not in raw   # absent: left out
    comm = dump_profile(sharded)["comm"]
    assert comm["reduce_scatter"] == {"alpha_ms": 0.4, "algbw_gbs": 2.0, "samples": [
        {"bytes": 4096, "ms": 0.41}, {"bytes": 1 << 20, "ms": 0.9}]}
    assert comm["all_gather"] == {"alpha_ms": 0.5, "algbw_gbs": 2.5}   # no samples: left out
    assert sharded.digest() != plain.digest()
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(dump_profile(sharded), profile_schema())
    props = profile_schema()["$defs"]["CommEntry"]["properties"]
    assert {"reduce_scatter", "all_gather"} <= set(props)
    assert "reduce_scatter" not in profile_schema()["$defs"]["CommEntry"].get("required", [])


def test_unreadable_json_is_a_format_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{}")
    with pytest.raises(FormatError, match="expected a UTF-8 text file"):
        read_json(bad)
    bad.write_text("[" * 100_000)
    with pytest.raises(FormatError, match="bad.json: expected valid JSON"):
        read_json(bad)
    bad.write_text("1" * 5000)
    with pytest.raises(FormatError, match="bad.json: expected valid JSON"):
        read_json(bad)


def test_shapes_are_a_schedule_field_written_as_before(files, tmp_path):
    prof, sched, _, sp = files
    assert sched.shapes == {t.name: t.shape for t in prof.tensors}
    d = json.loads(sp.read_text())
    assert d["shapes"] == {"out": [250_000], "mid": [250_000], "inp": [500, 500]}
    assert list(d).index("shapes") == list(d).index("predicted") + 1
    back = load_schedule(sp)
    assert back.shapes == {"out": (250_000,), "mid": (250_000,), "inp": (500, 500)}
    assert "shapes" not in back.extra
    # A schedule without them (older files) loads, has none, and is written without them.
    del d["shapes"]
    sp.write_text(json.dumps(d))
    old = load_schedule(sp)
    assert old.shapes is None and old.digest() == sched.digest()
    save_schedule(old, tmp_path / "again.json")
    assert "shapes" not in json.loads((tmp_path / "again.json").read_text())


def _bad_profiles():
    prof = three_layer()
    t0 = prof.tensors[0]
    return [
        prof.with_comm(CommSpec("analytic", 2, alpha_ms=1e7, algbw_gbs=1.0)),
        prof.with_comm(CommSpec("analytic", 2, alpha_ms=1.0, algbw_gbs=1e300)),
        prof.with_comm(CommSpec("analytic", 0, alpha_ms=1.0, algbw_gbs=1.0)),
        prof.with_comm(CommSpec("ib", 2, alpha_ms=1.0, algbw_gbs=1.0)),
        prof.with_comm(CommSpec("analytic", 2, 1.0, 1.0, samples=((0, 1.0),))),
        prof.with_comm(CommSpec("analytic", 2, 1.0, 1.0, reduce_scatter=CollectiveCost(1.0, 0.0))),
        prof.with_comm(CommSpec("analytic", 2, 1.0, 1.0, all_gather=CollectiveCost(-1.0, 1.0))),
        dataclasses.replace(prof, backward_ms=float("nan")),
        dataclasses.replace(prof, name=""),
        dataclasses.replace(prof, tensors=()),
        dataclasses.replace(prof, tensors=(dataclasses.replace(t0, shape=(4, 0)),)),
        dataclasses.replace(prof, tensors=(dataclasses.replace(t0, dtype="int8"),)),
        dataclasses.replace(prof, tensors=(dataclasses.replace(t0, ready_ms=7.0),)),
        dataclasses.replace(prof, tensors=(t0, t0)),
        dataclasses.replace(prof, tensors=(dataclasses.replace(t0, update_ms=-1.0),)),
    ]


@pytest.mark.parametrize("bad", _bad_profiles())
def test_saving_refuses_what_loading_refuses_with_the_same_line(tmp_path, bad):
    path = tmp_path / "p.json"
    with pytest.raises(FormatError) as saved:
        save_profile(bad, path)
    assert not path.exists()
    path.write_text(json.dumps(dump_profile(bad)))
    with pytest.raises(FormatError) as loaded:
        load_profile(path)
    assert str(saved.value) == str(loaded.value)


def test_saving_a_schedule_refuses_what_loading_refuses(files, tmp_path):
    _, sched, _, _ = files
    path = tmp_path / "bad.json"
    for bad in (dataclasses.replace(sched, blocks=sched.blocks[:1]),
                dataclasses.replace(sched, world_size=0),
                dataclasses.replace(sched, shapes={"out": (0,)}),
                dataclasses.replace(sched, predicted={"iteration_ms": -1.0})):
        with pytest.raises(FormatError) as saved:
            save_schedule(bad, path)
        assert not path.exists()
        path.write_text(json.dumps(dump_schedule(bad)))
        with pytest.raises(FormatError) as loaded:
            load_schedule(path)
        path.unlink()
        assert str(saved.value) == str(loaded.value)


def test_building_and_saving_import_no_pydantic(tmp_path):
    """The GPU image runs the runtime without pydantic: only reading a file needs it."""
    code = f"""if True:
        import sys
        from usbyte_opt.formats import Block, CommSpec, Profile, TensorSpec, save_profile, save_schedule
        from usbyte_opt.planning.problem import Problem
        prof = Profile("toy", 2.0, 4.0, (TensorSpec("w", (4, 4), "float32", 1.0, 0.0),),
                       CommSpec("analytic", 2, 0.1, 1.0))
        pb = Problem.from_profile(prof)
        sched = pb.schedule("hand", pb.layout(), [Block(0, 0, 16)])
        save_profile(prof, {str(tmp_path / "p.json")!r})
        save_schedule(sched, {str(tmp_path / "s.json")!r})
        print(prof.digest(), sched.digest(), "pydantic" in sys.modules)
        from usbyte_opt.formats import load_schedule
        load_schedule({str(tmp_path / "s.json")!r})
        print("pydantic" in sys.modules)
    """
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[2:] == ["False", "True"], res.stdout
