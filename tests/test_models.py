"""The model registry: built-ins, real architectures by name, the factory protocol's errors."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from usbyte_opt.errors import UsbyteError
from usbyte_opt.models import (
    ARCHITECTURES,
    BUILTIN,
    HF_MODELS,
    LAB_MODELS,
    RandomTargetLoss,
    build,
    builtin_names,
    check_loss,
    model_name,
    parameter_count,
    resolve,
)


def has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None and bool(importlib.import_module(module))
    except Exception:
        return False


@pytest.mark.parametrize("name, params, tensors", [
    ("mlp", 10_512_394, 8), ("cnn", 9_542_954, 15), ("transformer", 4_224_512, 52)])
def test_builtins_build_train_and_have_known_sizes(name, params, tensors):
    model, inputs, loss_fn = build(name, batch_size=2)
    assert model.training
    assert parameter_count(model) == params
    assert len([p for p in model.parameters() if p.requires_grad]) == tensors
    loss = loss_fn(model(*inputs))
    assert loss.dim() == 0 and loss.requires_grad
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_builtins_are_deterministic():
    a, _, _ = build("cnn", 1)
    b, _, _ = build("cnn", 1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_transformer_ties_its_output_projection():
    model, _, _ = build("transformer", 1)
    assert model.head.weight is model.tok.weight
    assert "head.weight" not in dict(model.named_parameters())


def test_random_target_loss_moves_targets_to_the_output_device():
    loss = RandomTargetLoss(5, (3,), pick=lambda o: o["logits"])
    assert loss({"logits": torch.zeros(3, 5)}).item() == pytest.approx(torch.log(torch.tensor(5.0)).item())


def test_default_batch_and_explicit_batch():
    _, inputs, _ = build("mlp")
    assert inputs[0].shape[0] == BUILTIN["mlp"].default_batch
    _, inputs, _ = build("mlp", 3)
    assert inputs[0].shape[0] == 3


def test_a_factory_callable_and_a_lone_tensor_input_are_accepted():
    def factory(batch_size):
        return torch.nn.Linear(4, 2), torch.randn(batch_size, 4), lambda out: out.sum()

    model, inputs, _ = build(factory, 5)
    assert isinstance(inputs, tuple) and inputs[0].shape == (5, 4)
    assert model_name(factory) == "factory"


@pytest.mark.parametrize("spec, message", [
    ("", "expected a name or package.module:factory"),
    ("resnet-50", "unknown model 'resnet-50'"),
    (":factory", "expected package.module:factory"),
    ("math:nope", "module 'math' has no attribute 'nope'"),
    ("math:pi", "'pi' is a float, not callable"),
    ("transformers:bert-huge", "unknown transformers model 'bert-huge'"),
])
def test_bad_specs_raise_one_line_errors(spec, message):
    with pytest.raises(UsbyteError) as e:
        resolve(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("result, message", [
    (lambda: torch.nn.Linear(2, 2), "got a Linear"),
    (lambda: (torch.nn.Linear(2, 2), (torch.zeros(1, 2),)), "got a tuple of length 2"),
    (lambda: ("model", (), lambda o: o), "but model is a str"),
    (lambda: (torch.nn.Linear(2, 2), 3, lambda o: o), "but inputs is a int"),
    (lambda: (torch.nn.Linear(2, 2), (), "loss"), "but loss_fn is a str"),
    (lambda: (torch.nn.Linear(2, 2).requires_grad_(False), (), lambda o: o), "no trainable parameters"),
])
def test_factories_returning_the_wrong_thing_name_the_protocol(result, message):
    def factory(batch_size):
        return result()

    with pytest.raises(UsbyteError) as e:
        build(factory, 1)
    assert message in str(e.value)


def test_a_factory_that_raises_is_reported_with_its_error():
    def factory(batch_size):
        raise FileNotFoundError("weights.pt")

    with pytest.raises(UsbyteError, match=r"factory\(2\) raised FileNotFoundError: weights.pt"):
        build(factory, 2)


def test_batch_size_must_be_positive():
    with pytest.raises(UsbyteError, match="--batch-size"):
        build("mlp", 0)


def test_builtin_names_lists_small_and_transformers_models():
    names = builtin_names()
    assert {"mlp", "cnn", "transformer", "resnet50", "resnet152", "vgg16", "densenet201", "bert-base",
            "gpt2"} <= set(names)


@pytest.mark.skipif(not has("transformers"), reason="transformers not installed")
@pytest.mark.parametrize("name, tensors, params, first", [
    ("bert-base", 206, 110_106_428, ("bert.embeddings.word_embeddings.weight", (30522, 768))),
    ("gpt2", 148, 124_439_808, ("transformer.wte.weight", (50257, 768))),
])
def test_transformers_models_have_the_real_shapes(name, tensors, params, first):
    from usbyte_opt.models import transformers_factory

    model, inputs, loss_fn = transformers_factory(name, seq_len=8)(1)
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert len(named) == tensors and named[0] == first
    assert parameter_count(model) == params
    assert loss_fn(model(*inputs)).dim() == 0


@pytest.mark.skipif(not has("torchvision"), reason="torchvision not importable beside this torch")
@pytest.mark.parametrize("name, tensors, params", [
    ("resnet50", 161, 25_557_032), ("vgg16", 32, 138_357_544), ("densenet201", 604, 20_013_928)])
def test_torchvision_models_have_the_real_shapes(name, tensors, params):
    model, inputs, loss_fn = build(f"torchvision:{name}", 1)
    assert len(list(model.parameters())) == tensors and parameter_count(model) == params
    assert loss_fn(model(*inputs)).dim() == 0


def test_torchvision_missing_is_a_clear_error():
    if has("torchvision"):
        pytest.skip("torchvision is importable here")
    with pytest.raises(UsbyteError, match="needs torchvision") as e:
        resolve("torchvision:resnet18")
    assert "pip install 'torchvision==0." in str(e.value)  # exactly what to install
    assert resolve("resnet50")[0].__name__ == "resnet50"   # the built-in needs no torchvision


# --------------------------------------------------------------------------------------------
# Built-in architectures: the shipped profiles' models, without torchvision
# --------------------------------------------------------------------------------------------

SHIPPED_CNNS = ["resnet50", "resnet152", "vgg16", "densenet201"]


@pytest.mark.parametrize("name", SHIPPED_CNNS)
def test_builtin_architectures_match_their_shipped_profiles(name):
    """Same tensors (names, shapes, dtypes, in order) and fingerprint as the torchvision model
    the shipped profile was made from, so the profile's schedules fit the built-in model."""
    from pathlib import Path

    from usbyte_opt.formats import fingerprint, load_profile
    from usbyte_opt.models import ARCHITECTURES

    prof = load_profile(Path(__file__).resolve().parent.parent / "profiles" / f"{name}.json")
    with torch.device("meta"):
        model = ARCHITECTURES[name]()
    tensors = [(n, tuple(p.shape), str(p.dtype).removeprefix("torch."))
               for n, p in model.named_parameters() if p.requires_grad]
    assert tensors == [(t.name, tuple(t.shape), t.dtype) for t in prof.tensors]
    assert fingerprint(tensors) == prof.fingerprint()
    assert resolve(name)[1] == prof.meta["batch_size"]  # the profile's batch is the default


#: Exact parameter counts of the built-in architectures (those of torchvision's models).
ARCHITECTURE_PARAMS = {"resnet50": 25_557_032, "resnet152": 60_192_808, "vgg16": 138_357_544,
                       "densenet201": 20_013_928}


@pytest.mark.skipif(not has("torchvision"), reason="torchvision not importable beside this torch")
@pytest.mark.parametrize("name", SHIPPED_CNNS)
def test_builtin_architectures_compute_what_torchvision_computes(name):
    from usbyte_opt.models import ARCHITECTURES

    tv = importlib.import_module("torchvision").models.get_model(name, weights=None).eval()
    mine = ARCHITECTURES[name]().eval()
    mine.load_state_dict(tv.state_dict())
    x = torch.randn(1, 3, 64, 64)
    assert torch.allclose(mine(x), tv(x), atol=1e-5)


def test_install_hints_keep_the_installed_torch():
    from usbyte_opt.models import install_hint

    assert install_hint("torchvision", "2.13.0+cpu").endswith("--index-url https://download.pytorch.org/whl/cpu")
    assert "torchvision==0.28.*" in install_hint("torchvision", "2.13.0+cpu")
    assert install_hint("torchvision", "2.13.0") == "pip install 'torchvision==0.28.*'"


def _one_step_cases():
    for name, entry in BUILTIN.items():
        if entry.needs:  # transformers at full size: ~10 s each on a CPU; run them with -m slow
            yield pytest.param(name, marks=[pytest.mark.slow, pytest.mark.skipif(
                not has(entry.needs), reason=f"{entry.needs} not installed")])
        else:
            yield name


@pytest.fixture
def one_thread():
    """One torch thread: on a loaded machine two threads can make a step ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(_one_step_cases()))
def test_every_builtin_name_builds_and_trains_one_step(name, one_thread):
    """Every row of the one table: its name resolves to its factory and batch, builds at batch 2
    with the parameter count its description states (an architecture's exactly that of
    torchvision's model), and one SGD step moves every tensor. (The architectures at another
    image size: ``architecture_factory``'s doctest.)"""
    entry = BUILTIN[name]
    factory, batch = resolve(name)
    assert factory is entry.factory and batch == entry.default_batch
    model, inputs, loss_fn = build(name, 2)
    assert model.training and inputs[0].shape[0] == 2
    stated = re.search(r"([\d.]+) M parameters", entry.description)
    assert stated and f"{parameter_count(model) / 1e6:.1f}" == stated.group(1)
    if entry.kind == "architecture":  # same model, same loss; a 32-pixel crop makes the step cheap
        assert parameter_count(model) == ARCHITECTURE_PARAMS[name]
        assert inputs[0].shape[1:] == (3, 224, 224)
        inputs = (inputs[0][..., :32, :32],)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = check_loss(name, loss_fn(model(*inputs)))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_the_table_holds_every_builtin_and_the_benchs_lab_specs_come_from_it():
    from usbyte_opt.bench import BenchConfig

    assert set(ARCHITECTURES) | set(HF_MODELS) <= set(BUILTIN)
    assert builtin_names()[:len(BUILTIN)] == list(BUILTIN)
    assert set(LAB_MODELS) == {n for n, e in BUILTIN.items() if e.kind == "lab"} == {
        "lab-cnn", "lab-vgg", "lab-transformer"}
    for name, (spec, batch) in LAB_MODELS.items():
        assert spec.startswith("usbyte_opt.models.lab:") and batch == BUILTIN[name].default_batch
        assert resolve(spec) == (BUILTIN[name].factory, 32)  # the very function, not a copy
        assert BenchConfig(model=name).spec() == (spec, batch)
    if has("transformers"):  # a prefixed name takes the batch of the table's row of that name
        assert resolve("transformers:gpt2")[1] == BUILTIN["gpt2"].default_batch == 4


SHIPPED = ["resnet50", "resnet152", "vgg16", "densenet201", "bert-base", "gpt2"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_schedules_are_the_shipped_profiles_plans(name):
    """``schedules/X.json`` is ``usbyte-opt optimize profiles/X.json``'s output for every
    shipped profile, and the runtime accepts it on the built-in model X."""
    from pathlib import Path

    from usbyte_opt.formats import load_profile, load_schedule

    root = Path(__file__).resolve().parent.parent
    prof = load_profile(root / "profiles" / f"{name}.json")
    sched = load_schedule(root / "schedules" / f"{name}.json")
    assert sched.profile_name == prof.name and sched.profile_digest == prof.digest()
    assert sched.fingerprint == prof.fingerprint()
    if name in SHIPPED_CNNS:
        from usbyte_opt.models import ARCHITECTURES
        from usbyte_opt.runtime.checks import check_model
        from usbyte_opt.runtime.default_plan import model_tensors

        with torch.device("meta"):
            model = ARCHITECTURES[name]()
        check_model(sched, model_tensors(model), f"schedules/{name}.json")
