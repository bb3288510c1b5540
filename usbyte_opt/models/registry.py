"""The one table of built-in model names, and the resolution of any model spec.

:data:`BUILTIN` maps every built-in name (the small models, the lab models, the
architectures of the shipped profiles and the transformers models) to its factory, its
default batch size and a description; :func:`resolve` turns a spec (a built-in name,
``torchvision:NAME``, ``transformers:NAME``, ``package.module:factory`` or a callable) into a
factory and a batch size, and :func:`build` calls the factory and checks its result.

Example::

    >>> BUILTIN["lab-cnn"].default_batch, LAB_MODELS["lab-cnn"]
    (16, ('usbyte_opt.models.lab:lab_cnn', 16))
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..errors import UsageError, UsbyteError
from . import builtin, lab
from .architectures import ARCHITECTURES, architecture_factory
from .external import (
    HF_MODELS,
    import_optional,
    torchvision_factory,
    torchvision_names,
    transformers_factory,
    transformers_model,
)
from .protocol import PROTOCOL, Built, Factory

Kind = Literal["small", "lab", "architecture", "transformers"]


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A built-in model name: its factory, its default (per-rank) batch size and what it is.

    ``needs`` names the package the factory imports (checked by :func:`resolve`, so that a
    missing one is reported before anything is built).
    """

    factory: Factory
    default_batch: int
    description: str
    kind: Kind
    needs: str | None = None


def _entries() -> dict[str, BuiltinModel]:
    small: Kind = "small"
    labs: Kind = "lab"
    arch: Kind = "architecture"
    table: dict[str, BuiltinModel] = {
        # Small models that run anywhere (the demo, the tests).
        "mlp": BuiltinModel(builtin.mlp, 64, "4-layer MLP, 10.5 M parameters", small),
        "cnn": BuiltinModel(builtin.cnn, 16, "small communication-heavy CNN on 32x32 images, 9.5 M parameters",
                            small),
        "transformer": BuiltinModel(builtin.transformer, 8,
                                    "4-layer causal transformer with tied embedding, 4.2 M parameters", small),
        # Sized for `usbyte-opt bench`'s emulated 200 Mbit/s network (models/lab.py).
        "lab-cnn": BuiltinModel(lab.lab_cnn, 16, "CNN sized for the 200 Mbit/s lab, 1.1 M parameters", labs),
        "lab-vgg": BuiltinModel(lab.lab_vgg, 12, "VGG-style CNN sized for the lab, 1.2 M parameters", labs),
        "lab-transformer": BuiltinModel(lab.lab_transformer, 12,
                                        "untied 4-layer transformer sized for the lab, 2.6 M parameters", labs),
        # The shipped profiles' architectures (models/architectures.py), at the profiles' batches.
        "resnet50": BuiltinModel(architecture_factory("resnet50"), 64,
                                 "ResNet-50 on 224x224 images, 25.6 M parameters", arch),
        "resnet152": BuiltinModel(architecture_factory("resnet152"), 32,
                                  "ResNet-152 on 224x224 images, 60.2 M parameters", arch),
        "vgg16": BuiltinModel(architecture_factory("vgg16"), 32, "VGG-16 on 224x224 images, 138.4 M parameters",
                              arch),
        "densenet201": BuiltinModel(architecture_factory("densenet201"), 32,
                                    "DenseNet-201 on 224x224 images, 20.0 M parameters", arch),
    }
    # transformers models built from their config (models/external.py), when it is installed.
    for name, batch, description in [
            ("bert-base", 32, "BERT-Base with pre-training heads, 128 tokens, 110.1 M parameters"),
            ("bert-large", 8, "BERT-Large with pre-training heads, 128 tokens, 336.2 M parameters"),
            ("gpt2", 4, "GPT-2 with tied language-model head, 1024 tokens, 124.4 M parameters"),
            ("gpt2-medium", 2, "GPT-2 Medium with tied language-model head, 1024 tokens, 354.8 M parameters")]:
        table[name] = BuiltinModel(transformers_model(name), batch, description, "transformers", "transformers")
    assert set(ARCHITECTURES) <= set(table) and set(HF_MODELS) <= set(table)
    return table


#: Every built-in name: the names :func:`resolve` accepts without a ``:`` (besides
#: torchvision's, when it is installed).
BUILTIN: dict[str, BuiltinModel] = _entries()


def spec_of(factory: Factory) -> str:
    """The ``package.module:factory`` spec of a module-level factory function."""
    return f"{factory.__module__}:{factory.__name__}"


#: The lab models (rows of :data:`BUILTIN`), as ``usbyte-opt bench`` gives them to its ranks:
#: name -> (factory spec, default batch size).
LAB_MODELS: dict[str, tuple[str, int]] = {name: (spec_of(m.factory), m.default_batch)
                                          for name, m in BUILTIN.items() if m.kind == "lab"}


def _default_batch(name: str) -> int:
    """The default batch of ``torchvision:NAME`` / ``transformers:NAME``: the built-in
    architecture's of that name (the shipped profiles'), else 32."""
    entry = BUILTIN.get(name)
    return entry.default_batch if entry is not None and entry.kind in ("architecture", "transformers") else 32


def builtin_names() -> list[str]:
    """All names :func:`resolve` accepts without a ``:`` (torchvision's only when installed)."""
    names = list(BUILTIN)
    return names + [n for n in torchvision_names() if n not in BUILTIN]


#: Factory names that say nothing of the model: a profile of ``pkg.mod:build`` is named
#: after the module (``mod``) instead.
GENERIC_FACTORY_NAMES = frozenset({
    "build", "make", "create", "get", "load", "factory", "model", "main", "new", "init", "setup",
    "build_model", "make_model", "create_model", "get_model", "load_model", "new_model", "model_fn",
    "model_factory", "factory_fn", "builder"})

#: The attribute of a module that names the model in messages and in a profile's
#: ``meta.model`` (:func:`build` sets it to the spec's name unless the factory set it first).
MODEL_NAME_ATTR = "usbyte_model_name"


def model_name(spec: str | Callable) -> str:
    """The profile name a model spec gets by default: the built-in name, else the factory's
    name, else (a ``package.module:factory`` spec whose factory has a generic name such as
    ``build``, ``make_model`` or ``get_model``: :data:`GENERIC_FACTORY_NAMES`) the last part of
    its module's name. A callable is named by its ``__name__``.

    Example::

        >>> model_name("mlp"), model_name("torchvision:resnet50"), model_name("my.models:big_cnn")
        ('mlp', 'resnet50', 'big_cnn')
        >>> model_name("my_pkg.lightning_train:build"), model_name("zoo:get_model")
        ('lightning_train', 'zoo')
    """
    if not isinstance(spec, str):  # a callable given in Python: its own name
        return getattr(spec, "__name__", "model").strip("<>_") or "model"
    if ":" not in spec:
        return spec
    module, _, factory = spec.rpartition(":")
    if factory in GENERIC_FACTORY_NAMES and module not in ("torchvision", "transformers", "hf"):
        return module.rsplit(".", 1)[-1] or factory
    return factory


def resolve(spec: str | Factory) -> tuple[Factory, int]:
    """Turn ``spec`` into ``(factory, default_batch_size)``; a callable is taken as a factory.

    Raises :class:`~usbyte_opt.errors.UsageError` (one line, exit code 2) for an unknown name,
    a module that cannot be imported or an attribute that is missing or not callable.

    Example::

        >>> resolve("nope")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsageError: unknown model 'nope': expected a built-in name (mlp, ...
    """
    if callable(spec):
        return spec, factory_batch(spec)
    if not isinstance(spec, str) or not spec:
        raise UsageError(f"model spec: expected a name or package.module:factory, got {spec!r}")
    if spec in BUILTIN:
        entry = BUILTIN[spec]
        if entry.needs:
            import_optional(entry.needs, spec)  # a missing package is reported now, not at build
        return entry.factory, entry.default_batch
    prefix, _, rest = spec.partition(":")
    if prefix == "torchvision" and rest:
        return torchvision_factory(rest), _default_batch(rest)
    if prefix in ("transformers", "hf") and rest:
        return transformers_factory(rest), _default_batch(rest)
    if ":" not in spec:
        if spec in torchvision_names():
            return torchvision_factory(spec), _default_batch(spec)
        # fall through to "unknown model"; torchvision:NAME gives torchvision's import error
        raise UsageError(f"unknown model {spec!r}: expected a built-in name ({', '.join(BUILTIN)}) or "
                          "package.module:factory")
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UsageError(f"model spec {spec!r}: expected package.module:factory")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the user's own modules are found
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise UsageError(f"model spec {spec!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {first}); expected package.module:factory "
                          "importable from the current directory or PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UsageError(f"model spec {spec!r}: module {module_name!r} has no attribute {attr!r}; "
                          f"expected {PROTOCOL}")
    if not callable(factory):
        raise UsageError(f"model spec {spec!r}: {attr!r} is a {type(factory).__name__}, not callable; "
                          f"expected {PROTOCOL}")
    check_signature(factory, spec)
    return factory, factory_batch(factory)


def factory_batch(factory: Callable) -> int:
    """A user's factory's own default batch size: the default of its first parameter
    (``def build(batch_size=16)``), else 32.

    Example::

        >>> factory_batch(lambda batch_size=16: None), factory_batch(lambda batch_size: None)
        (16, 32)
    """
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return 32
    if params and isinstance(params[0].default, int) and not isinstance(params[0].default, bool) \
            and params[0].default >= 1:
        return int(params[0].default)
    return 32


def check_signature(factory: Callable, label: str) -> None:
    """Raise :class:`~usbyte_opt.errors.UsageError` (one line) unless ``factory`` can be
    called as ``factory(batch_size)``, one positional argument: the one call every command
    makes (:data:`~usbyte_opt.models.protocol.PROTOCOL`). A callable whose signature Python
    cannot read passes.

    Example::

        >>> def make(batch_size, width): ...
        >>> check_signature(make, "my.models:make")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsageError: model 'my.models:make': factory make(batch_size, width) cannot ...
        >>> check_signature(lambda batch_size, width=8: None, "ok")
    """
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(1)
    except TypeError as e:
        name = getattr(factory, "__name__", type(factory).__name__)
        raise UsageError(f"model {label!r}: factory {name}{sig} cannot be called as "
                         f"{name}(batch_size) ({e}); expected {PROTOCOL}") from None


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def build(spec: str | Factory, batch_size: int | None = None,
          device: str | torch.device = "cpu") -> Built:
    """Resolve ``spec``, call its factory and check the result against the protocol.

    The model is moved to ``device`` and put in training mode; tensor inputs are moved too.
    An optimizer the factory gives (:func:`build_with_optimizer`) is dropped.

    Args:
        spec: a built-in name, ``package.module:factory`` or a factory callable.
        batch_size: per-rank batch size; ``None`` takes the model's default.
        device: where to put the model and the inputs.

    Returns:
        ``(model, inputs, loss_fn)`` with ``inputs`` a tuple.
    """
    return build_with_optimizer(spec, batch_size, device)[0]


def build_with_optimizer(spec: str | Factory, batch_size: int | None = None,
                         device: str | torch.device = "cpu") -> tuple[Built, torch.optim.Optimizer | None]:
    """:func:`build`, and the optimizer the model trains with when the factory gives one:
    the factory may return it as a 4th element (``(model, inputs, loss_fn, optimizer)``, an
    optimizer over the model's parameters), or carry an ``optimizer`` attribute, a callable
    that builds it from the parameters (``build.optimizer = functools.partial(torch.optim.AdamW,
    lr=3e-4)``). ``None`` when it gives neither (the profiler then times ``--optimizer``).

    Example::

        >>> def toy(batch_size):
        ...     m = torch.nn.Linear(2, 2)
        ...     return m, (torch.zeros(batch_size, 2),), lambda out: out.sum(), torch.optim.AdamW(m.parameters())
        >>> (model, _, _), opt = build_with_optimizer(toy, 1)
        >>> type(opt).__name__, getattr(model, MODEL_NAME_ATTR)
        ('AdamW', 'toy')
    """
    factory, default_batch = resolve(spec)
    batch = default_batch if batch_size is None else batch_size
    if not isinstance(batch, int) or batch < 1:
        raise UsageError(f"--batch-size: expected an integer >= 1, got {batch!r}")
    label = spec if isinstance(spec, str) else model_name(spec)
    check_signature(factory, label)
    try:
        result = factory(batch)
    except UsbyteError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise UsbyteError(f"model {label!r}: factory({batch}) raised {type(e).__name__}: {first}") from e
    if not (isinstance(result, (tuple, list)) and len(result) in (3, 4)):
        got = f"a {type(result).__name__}"
        if isinstance(result, (tuple, list)):
            got += f" of length {len(result)}"
        raise UsbyteError(f"model {label!r}: expected {PROTOCOL}, got {got} from factory({batch})")
    model, inputs, loss_fn = result[:3]
    optimizer = result[3] if len(result) == 4 else None
    if not isinstance(model, nn.Module):
        raise UsbyteError(f"model {label!r}: expected {PROTOCOL}, but model is a {type(model).__name__}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)  # a lone tensor is the one positional argument
    if not isinstance(inputs, (tuple, list)):
        raise UsbyteError(f"model {label!r}: expected {PROTOCOL}, but inputs is a {type(inputs).__name__}")
    if not callable(loss_fn):
        raise UsbyteError(f"model {label!r}: expected {PROTOCOL}, but loss_fn is a {type(loss_fn).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise UsbyteError(f"model {label!r} has no trainable parameters: nothing to all-reduce")
    device = torch.device(device)
    model.to(device).train()
    if not isinstance(getattr(model, MODEL_NAME_ATTR, None), str):
        setattr(model, MODEL_NAME_ATTR, model_name(spec))
    optimizer = _factory_optimizer(label, model, optimizer, getattr(factory, "optimizer", None))
    return (model, tuple(_to(x, device) for x in inputs), loss_fn), optimizer


def _factory_optimizer(label: str, model: nn.Module, given: Any, attribute: Any) -> torch.optim.Optimizer | None:
    """The optimizer of :func:`build_with_optimizer`: the factory's 4th element, else its
    ``optimizer`` attribute called on the trainable parameters (after the model was moved)."""
    if given is None and attribute is not None:
        if not callable(attribute):
            raise UsbyteError(f"model {label!r}: the factory's optimizer attribute is a "
                              f"{type(attribute).__name__}; expected a callable taking the parameters")
        given = attribute([p for p in model.parameters() if p.requires_grad])
    if given is not None and not isinstance(given, torch.optim.Optimizer):
        raise UsbyteError(f"model {label!r}: the factory's optimizer is a {type(given).__name__}; "
                          "expected a torch.optim.Optimizer over the model's parameters")
    return given


