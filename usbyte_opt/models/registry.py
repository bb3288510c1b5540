"""Models the profiler can run, named on the command line as ``MODEL``.

``MODEL`` is one of:

- a built-in name: ``mlp``, ``cnn``, ``transformer`` (small models that run on a CPU in a
  fraction of a second: for the demo and the tests); ``lab-cnn``, ``lab-vgg``,
  ``lab-transformer`` (sized for ``usbyte-opt bench``'s emulated network,
  :mod:`usbyte_opt.bench.models`); ``resnet50``, ``resnet152``, ``vgg16``,
  ``densenet201`` (the architectures of the shipped profiles, defined in
  :mod:`usbyte_opt.architectures` tensor for tensor as torchvision's, without torchvision);
  ``torchvision:NAME`` for any other torchvision classification model (when torchvision is
  installed; a bare name that is not built in is looked up there too); ``bert-base``,
  ``bert-large``, ``gpt2``, ``gpt2-medium`` (built with transformers from a config object,
  when it is installed). Real architectures get random weights and are built offline:
  nothing is ever downloaded.
- ``package.module:factory``, a function of your own following the protocol below. The
  current directory is on the import path, as for ``python -m``.

**Factory protocol.** ``factory(batch_size: int)`` returns ``(model, inputs, loss_fn)``:
``model`` a :class:`torch.nn.Module`, ``inputs`` a tuple of positional arguments (tensors
are moved to the profiling device), ``loss_fn`` a callable taking ``model(*inputs)`` and
returning a scalar tensor. The profiler runs ``loss_fn(model(*inputs)).backward()``. A
``loss_fn`` that holds targets should create them on ``output.device`` (as the built-ins
do with :class:`RandomTargetLoss`), since the profiler moves the model after the factory
returns.

Example::

    >>> model, inputs, loss_fn = build("mlp", batch_size=4)
    >>> loss = loss_fn(model(*inputs))
    >>> loss.dim(), sum(p.numel() for p in model.parameters())
    (0, 10512394)
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import UsbyteError

#: What a factory returns: ``(model, inputs, loss_fn)``.
Built = tuple[nn.Module, tuple, Callable[[Any], torch.Tensor]]
Factory = Callable[[int], Built]

#: The expected shape of a factory's result, quoted in errors.
PROTOCOL = "factory(batch_size: int) -> (model: torch.nn.Module, inputs: tuple, loss_fn: callable)"


class RandomTargetLoss:
    """Cross-entropy against fixed random targets, made on the output's device at first use.

    Args:
        classes: number of classes (vocabulary size for language models).
        shape: shape of the target tensor (``(batch,)`` or ``(batch, seq)``).
        pick: optional function selecting the logits from the model output (e.g. an
            attribute of a transformers output object); default: the output itself.
        seed: seed of the targets, so every rank and every run sees the same ones.

    Example::

        >>> loss = RandomTargetLoss(10, (4,))
        >>> round(float(loss(torch.zeros(4, 10))), 4)   # uniform logits: log(10)
        2.3026
    """

    def __init__(self, classes: int, shape: Sequence[int], pick: Callable[[Any], torch.Tensor] | None = None,
                 seed: int = 0):
        self.classes, self.shape, self.pick, self.seed = classes, tuple(shape), pick, seed
        self._targets: torch.Tensor | None = None

    def __call__(self, output: Any) -> torch.Tensor:
        logits = self.pick(output) if self.pick is not None else output
        if self._targets is None or self._targets.device != logits.device:
            g = torch.Generator().manual_seed(self.seed)
            self._targets = torch.randint(self.classes, self.shape, generator=g).to(logits.device)
        return F.cross_entropy(logits.reshape(-1, self.classes).float(), self._targets.reshape(-1))


# --------------------------------------------------------------------------------------------
# Small built-in models (CPU-sized)
# --------------------------------------------------------------------------------------------


class MLP(nn.Sequential):
    """Four fully connected layers, 1024 -> 2048 -> 2048 -> 2048 -> 10 (10.5 M parameters)."""

    def __init__(self, width: int = 2048, inputs: int = 1024, classes: int = 10):
        super().__init__(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))


class SmallCNN(nn.Module):
    """A communication-heavy CNN for 32x32 images: three small convolutions (with batch norm)
    and a large classifier, 9.5 M parameters for ~50 M multiply-adds per image, so that its
    all-reduce costs as much as its compute even on a loopback network."""

    def __init__(self, classes: int = 10):
        super().__init__()

        def block(i: int, o: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

        self.features = nn.Sequential(block(3, 32), block(32, 64), nn.MaxPool2d(2),
                                      block(64, 128), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 8 * 8, 1024), nn.ReLU(),
                                        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class TinyGPT(nn.Module):
    """A small causal transformer (4 layers, width 256, vocabulary 4096, 4.2 M parameters).

    It has the three shapes that a profiler must get right: the output projection is tied
    to the token embedding (one tensor, two uses), the position embedding is a parameter of
    this (non-leaf) module used in its own ``forward``, and ``nn.MultiheadAttention`` uses
    its ``out_proj`` weight through a functional call without running ``out_proj``.
    """

    def __init__(self, vocab: int = 4096, width: int = 256, layers: int = 4, heads: int = 4,
                 context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.tok.weight, std=0.02)  # GPT-2's init; N(0, 1) gives huge tied logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.tok(ids) + self.pos[:s]
        mask = nn.Transformer.generate_square_subsequent_mask(s, device=ids.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def _mlp(batch_size: int) -> Built:
    torch.manual_seed(0)
    return MLP(), (torch.randn(batch_size, 1024),), RandomTargetLoss(10, (batch_size,))


def _cnn(batch_size: int) -> Built:
    torch.manual_seed(0)
    return SmallCNN(), (torch.randn(batch_size, 3, 32, 32),), RandomTargetLoss(10, (batch_size,))


def _transformer(batch_size: int, seq: int = 64) -> Built:
    torch.manual_seed(0)
    m = TinyGPT(context=seq)
    ids = torch.randint(4096, (batch_size, seq), generator=torch.Generator().manual_seed(1))
    return m, (ids,), RandomTargetLoss(4096, (batch_size, seq))


def architecture_factory(name: str, image_size: int = 224) -> Factory:
    """A factory for built-in architecture ``name`` (:data:`usbyte_opt.architectures.ARCHITECTURES`)
    on random ``image_size``-pixel images, with cross-entropy against random labels of its
    1000 classes: what :func:`torchvision_factory` gives for torchvision's model of that name.

    Example::

        >>> factory = architecture_factory("resnet50", image_size=64)
        >>> model, (x,), loss_fn = factory(2)
        >>> tuple(x.shape), loss_fn(model(x)).dim()
        ((2, 3, 64, 64), 0)
    """
    from .architectures import ARCHITECTURES

    if name not in ARCHITECTURES:
        raise UsbyteError(f"unknown built-in architecture {name!r}: expected one of {', '.join(ARCHITECTURES)}")

    def factory(batch_size: int) -> Built:
        torch.manual_seed(0)
        model = ARCHITECTURES[name]()
        x = torch.randn(batch_size, 3, image_size, image_size)
        return model, (x,), RandomTargetLoss(1000, (batch_size,))

    factory.__name__ = name
    return factory


def _lab(name: str) -> Factory:
    """A built-in name for a lab model of :mod:`usbyte_opt.bench.models` (imported at first use:
    that module builds on this one)."""

    def factory(batch_size: int) -> Built:
        from . import lab

        return getattr(lab, name)(batch_size)

    factory.__name__ = name.replace("_", "-")
    return factory


# --------------------------------------------------------------------------------------------
# Real architectures: torchvision and transformers, when installed
# --------------------------------------------------------------------------------------------

def install_hint(package: str, torch_version: str | None = None) -> str:
    """The exact command that installs ``package`` beside the installed torch without
    replacing it: torchvision must be the release made for that torch (torch 2.N pairs
    with torchvision 0.(N+15)) and come from the index of its build (CPU or CUDA), since
    the default index would bring a multi-GB CUDA torch with it; transformers does not
    depend on torch at all.

    Example::

        >>> install_hint("torchvision", "2.13.0+cpu")
        "pip install 'torchvision==0.28.*' --index-url https://download.pytorch.org/whl/cpu"
        >>> install_hint("torchvision", "2.14.1+cu130")
        "pip install 'torchvision==0.29.*' --index-url https://download.pytorch.org/whl/cu130"
        >>> install_hint("transformers")
        "pip install 'transformers>=4.40'"
    """
    if package == "transformers":
        return "pip install 'transformers>=4.40'"
    if package != "torchvision":
        return f"pip install {package}"
    version = torch_version or torch.__version__
    base, _, build = version.partition("+")
    major, minor = (base.split(".") + ["0", "0"])[:2]
    if major != "2" or not minor.isdigit():
        return "pip install torchvision (the release made for your torch, from PyTorch's index)"
    index = f" --index-url https://download.pytorch.org/whl/{build}" if build else ""
    return f"pip install 'torchvision==0.{int(minor) + 15}.*'{index}"


def _import_optional(package: str, what: str):
    try:
        return importlib.import_module(package)
    except Exception as e:  # an ABI mismatch raises RuntimeError/OSError, not only ImportError
        raise UsbyteError(f"model {what!r} needs {package}, which cannot be imported here "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          f"install it: {install_hint(package)}; or give "
                          "package.module:factory") from None


def torchvision_factory(name: str, image_size: int | None = None) -> Factory:
    """A factory for torchvision classification model ``name`` with random weights.

    Inputs are random ``image_size``-pixel images (224, or 299 for Inception v3) and the
    loss is cross-entropy against random labels of its 1000 classes.
    """
    tv = _import_optional("torchvision", name)
    models = tv.models
    available = set(models.list_models(module=models))
    if name not in available:
        raise UsbyteError(f"unknown torchvision model {name!r}: expected a classification model "
                          f"of torchvision.models ({', '.join(sorted(available)[:8])}, ...)")
    size = image_size or (299 if name == "inception_v3" else 224)

    def factory(batch_size: int) -> Built:
        torch.manual_seed(0)
        kwargs = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
        model = models.get_model(name, weights=None, **kwargs)
        x = torch.randn(batch_size, 3, size, size)
        return model, (x,), RandomTargetLoss(1000, (batch_size,))

    factory.__name__ = name
    return factory


#: transformers configurations: (model class, config class, config overrides, sequence length).
HF_MODELS: dict[str, tuple[str, str, dict[str, Any], int]] = {
    "bert-base": ("BertForPreTraining", "BertConfig", {}, 128),
    "bert-large": ("BertForPreTraining", "BertConfig",
                   {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "intermediate_size": 4096}, 128),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {}, 1024),
    "gpt2-medium": ("GPT2LMHeadModel", "GPT2Config", {"n_embd": 1024, "n_layer": 24, "n_head": 16}, 1024),
}


def transformers_factory(name: str, seq_len: int | None = None) -> Factory:
    """A factory for ``bert-*`` (pre-training heads: masked LM + next sentence) or ``gpt2*``
    (language-model head tied to the embedding), built from the default config of the
    original release with random weights: nothing is downloaded.

    ``seq_len`` defaults to 128 for BERT (phase-1 pre-training) and 1024 for GPT-2.
    """
    if name not in HF_MODELS:
        raise UsbyteError(f"unknown transformers model {name!r}: expected one of {', '.join(HF_MODELS)}")
    tf = _import_optional("transformers", name)
    model_cls, config_cls, overrides, default_seq = HF_MODELS[name]
    seq = seq_len or default_seq

    def factory(batch_size: int) -> Built:
        torch.manual_seed(0)
        config = getattr(tf, config_cls)(**overrides)
        model = getattr(tf, model_cls)(config)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(config.vocab_size, (batch_size, seq), generator=g)
        if name.startswith("bert"):
            mask = torch.ones(batch_size, seq, dtype=torch.long)
            types = torch.zeros(batch_size, seq, dtype=torch.long)
            mlm = RandomTargetLoss(config.vocab_size, (batch_size, seq), lambda o: o.prediction_logits)
            nsp = RandomTargetLoss(2, (batch_size,), lambda o: o.seq_relationship_logits, seed=2)
            return model, (ids, mask, types), lambda out: mlm(out) + nsp(out)
        return model, (ids,), RandomTargetLoss(config.vocab_size, (batch_size, seq), lambda o: o.logits)

    factory.__name__ = name
    return factory


# --------------------------------------------------------------------------------------------
# Registry and resolution
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A built-in model name."""

    factory: Factory
    default_batch: int
    description: str


#: Small models that run anywhere.
BUILTIN: dict[str, BuiltinModel] = {
    "mlp": BuiltinModel(_mlp, 64, "4-layer MLP, 10.5 M parameters"),
    "cnn": BuiltinModel(_cnn, 16, "small communication-heavy CNN on 32x32 images, 9.5 M parameters"),
    "transformer": BuiltinModel(_transformer, 8, "4-layer causal transformer with tied embedding, 4.2 M parameters"),
    "lab-cnn": BuiltinModel(_lab("lab_cnn"), 16, "CNN sized for the 200 Mbit/s lab, 1.1 M parameters"),
    "lab-vgg": BuiltinModel(_lab("lab_vgg"), 12, "VGG-style CNN sized for the lab, 1.2 M parameters"),
    "lab-transformer": BuiltinModel(_lab("lab_transformer"), 12,
                                    "untied 4-layer transformer sized for the lab, 2.6 M parameters"),
    "resnet50": BuiltinModel(architecture_factory("resnet50"), 64, "ResNet-50 on 224x224 images, 25.6 M parameters"),
    "resnet152": BuiltinModel(architecture_factory("resnet152"), 32, "ResNet-152 on 224x224 images, 60.2 M parameters"),
    "vgg16": BuiltinModel(architecture_factory("vgg16"), 32, "VGG-16 on 224x224 images, 138.4 M parameters"),
    "densenet201": BuiltinModel(architecture_factory("densenet201"), 32,
                                "DenseNet-201 on 224x224 images, 20.0 M parameters"),
}

#: Default batch sizes of the real architectures (per rank; the shipped profiles' batches);
#: anything else defaults to 32.
DEFAULT_BATCH = {"bert-base": 32, "bert-large": 8, "gpt2": 4, "gpt2-medium": 2,
                 "resnet50": 64, "resnet152": 32, "vgg16": 32, "densenet201": 32}


def builtin_names() -> list[str]:
    """All names :func:`resolve` accepts without a ``:`` (torchvision's only when installed)."""
    names = list(BUILTIN) + list(HF_MODELS)
    try:
        import torchvision  # noqa: F401 - only to list its names

        names += sorted(set(torchvision.models.list_models(module=torchvision.models)) - set(names))
    except Exception:
        pass  # torchvision missing or unusable beside this torch: its names are not offered
    return names


def model_name(spec: str | Callable) -> str:
    """The profile name a model spec gets by default: the built-in name or the factory's name.

    Example::

        >>> model_name("mlp"), model_name("torchvision:resnet50"), model_name("my.models:big_cnn")
        ('mlp', 'resnet50', 'big_cnn')
    """
    if not isinstance(spec, str):
        return getattr(spec, "__name__", "model").strip("<>_") or "model"
    return spec.rsplit(":", 1)[-1] if ":" in spec else spec


def resolve(spec: str | Factory) -> tuple[Factory, int]:
    """Turn ``spec`` into ``(factory, default_batch_size)``; a callable is taken as a factory.

    Raises :class:`UsbyteError` (one line) for an unknown name, a module that cannot be
    imported or an attribute that is missing or not callable.

    Example::

        >>> resolve("nope")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsbyteError: unknown model 'nope': expected a built-in name (mlp, ...
    """
    if callable(spec):
        return spec, 32
    if not isinstance(spec, str) or not spec:
        raise UsbyteError(f"model spec: expected a name or package.module:factory, got {spec!r}")
    if spec in BUILTIN:
        return BUILTIN[spec].factory, BUILTIN[spec].default_batch
    prefix, _, rest = spec.partition(":")
    if prefix == "torchvision" and rest:
        return torchvision_factory(rest), DEFAULT_BATCH.get(rest, 32)
    if prefix in ("transformers", "hf") and rest:
        return transformers_factory(rest), DEFAULT_BATCH.get(rest, 32)
    if spec in HF_MODELS:
        return transformers_factory(spec), DEFAULT_BATCH.get(spec, 32)
    if ":" not in spec:
        try:
            import torchvision

            if spec in torchvision.models.list_models(module=torchvision.models):
                return torchvision_factory(spec), DEFAULT_BATCH.get(spec, 32)
        except Exception:
            pass  # fall through to "unknown model"; torchvision:NAME gives the import error
        known = ", ".join(list(BUILTIN) + ["bert-base", "..."])
        raise UsbyteError(f"unknown model {spec!r}: expected a built-in name ({known}) or "
                          "package.module:factory")
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UsbyteError(f"model spec {spec!r}: expected package.module:factory")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the user's own modules are found
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise UsbyteError(f"model spec {spec!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {first}); expected package.module:factory "
                          "importable from the current directory or PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UsbyteError(f"model spec {spec!r}: module {module_name!r} has no attribute {attr!r}; "
                          f"expected {PROTOCOL}")
    if not callable(factory):
        raise UsbyteError(f"model spec {spec!r}: {attr!r} is a {type(factory).__name__}, not callable; "
                          f"expected {PROTOCOL}")
    return factory, 32


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

    Args:
        spec: a built-in name, ``package.module:factory`` or a factory callable.
        batch_size: per-rank batch size; ``None`` takes the model's default.
        device: where to put the model and the inputs.

    Returns:
        ``(model, inputs, loss_fn)`` with ``inputs`` a tuple.
    """
    factory, default_batch = resolve(spec)
    batch = default_batch if batch_size is None else batch_size
    if not isinstance(batch, int) or batch < 1:
        raise UsbyteError(f"--batch-size: expected an integer >= 1, got {batch!r}")
    label = spec if isinstance(spec, str) else model_name(spec)
    try:
        result = factory(batch)
    except UsbyteError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise UsbyteError(f"model {label!r}: factory({batch}) raised {type(e).__name__}: {first}") from e
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        got = f"a {type(result).__name__}"
        if isinstance(result, (tuple, list)):
            got += f" of length {len(result)}"
        raise UsbyteError(f"model {label!r}: expected {PROTOCOL}, got {got}")
    model, inputs, loss_fn = result
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
    return model, tuple(_to(x, device) for x in inputs), loss_fn


def check_loss(label: str, loss: Any) -> torch.Tensor:
    """Raise :class:`UsbyteError` unless ``loss`` is a scalar tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else f"a {type(loss).__name__}")
        raise UsbyteError(f"model {label!r}: loss_fn(model(*inputs)) must return a scalar tensor, got {what}")
    if not loss.requires_grad:
        raise UsbyteError(f"model {label!r}: the loss does not depend on any trainable parameter")
    return loss.reshape(())


def make_batches(inputs: Sequence[Any], rank: int, count: int = 4) -> list[tuple]:
    """``count`` synthetic batches shaped like ``inputs`` (a factory's), different on every
    rank and reproducible, for training without a dataset (the bench, ``examples/train.py``):
    floating tensors get normal noise, integer tensors (token ids) uniform ids below the
    largest id of the factory's own inputs, anything else is passed as is.

    Example::

        >>> b = make_batches((torch.zeros(2, 3), torch.tensor([[1, 5]]), "x"), rank=1, count=2)
        >>> len(b), b[0][0].shape, int(b[1][1].max()) <= 5, b[0][2]
        (2, torch.Size([2, 3]), True, 'x')
    """
    out = []
    for j in range(count):
        g = torch.Generator().manual_seed(10_007 * (rank + 1) + j)
        batch = []
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                batch.append(torch.randn(x.shape, generator=g, dtype=x.dtype).to(x.device))
            elif isinstance(x, torch.Tensor) and x.dtype in (torch.int64, torch.int32):
                hi = int(x.max()) + 1 if x.numel() else 1
                batch.append(torch.randint(hi, x.shape, generator=g, dtype=x.dtype).to(x.device))
            else:
                batch.append(x)
        out.append(tuple(batch))
    return out


def parameter_count(model: nn.Module) -> int:
    """Trainable elements of ``model`` (tied tensors counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = ["BUILTIN", "HF_MODELS", "PROTOCOL", "RandomTargetLoss", "architecture_factory",
           "build", "builtin_names", "install_hint",
           "check_loss", "make_batches", "model_name", "parameter_count", "resolve",
           "torchvision_factory",
           "transformers_factory"]
