"""Real architectures from torchvision and transformers, when they are installed.

Both are imported only when a model of theirs is asked for, and every model is built with
random weights from a config: nothing is ever downloaded.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..errors import UsbyteError
from .protocol import Built, Factory, RandomTargetLoss


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


def import_optional(package: str, what: str) -> Any:
    """Import ``package`` for model ``what``, or raise a one-line :class:`UsbyteError` that
    says how to install it."""
    try:
        return importlib.import_module(package)
    except Exception as e:  # an ABI mismatch raises RuntimeError/OSError, not only ImportError
        raise UsbyteError(f"model {what!r} needs {package}, which cannot be imported here "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          f"install it: {install_hint(package)}; or give "
                          "package.module:factory") from None


def torchvision_names() -> list[str]:
    """torchvision's classification models, sorted; empty when torchvision cannot be imported."""
    try:
        import torchvision

        return sorted(torchvision.models.list_models(module=torchvision.models))
    except Exception:
        return []  # torchvision missing or unusable beside this torch: its names are not offered


def torchvision_factory(name: str, image_size: int | None = None) -> Factory:
    """A factory for torchvision classification model ``name`` with random weights.

    Inputs are random ``image_size``-pixel images (224, or 299 for Inception v3) and the
    loss is cross-entropy against random labels of its 1000 classes.
    """
    tv = import_optional("torchvision", name)
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
    tf = import_optional("transformers", name)
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


def transformers_model(name: str) -> Factory:
    """The registry's factory for transformers model ``name``: :func:`transformers_factory`
    with its default sequence length, importing transformers only when called.

    Example::

        >>> transformers_model("gpt2").__name__
        'gpt2'
    """
    if name not in HF_MODELS:
        raise UsbyteError(f"unknown transformers model {name!r}: expected one of {', '.join(HF_MODELS)}")

    def factory(batch_size: int) -> Built:
        return transformers_factory(name)(batch_size)

    factory.__name__ = name
    return factory
