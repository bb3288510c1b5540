"""Models the profiler can run, named on the command line as ``MODEL``.

``MODEL`` is one of:

- a built-in name, a row of the one table :data:`~usbyte_opt.models.registry.BUILTIN`:
  ``mlp``, ``cnn``, ``transformer`` (small models that run on a CPU in a fraction of a
  second: for the demo and the tests, :mod:`~usbyte_opt.models.builtin`); ``lab-cnn``,
  ``lab-vgg``, ``lab-transformer`` (sized for ``usbyte-opt bench``'s emulated network,
  :mod:`~usbyte_opt.models.lab`); ``resnet50``, ``resnet152``, ``vgg16``, ``densenet201``
  (the architectures of the shipped profiles, defined in
  :mod:`~usbyte_opt.models.architectures` tensor for tensor as torchvision's, without
  torchvision); ``bert-base``, ``bert-large``, ``gpt2``, ``gpt2-medium`` (built with
  transformers from a config object, when it is installed: :mod:`~usbyte_opt.models.external`).
- ``torchvision:NAME`` for any other torchvision classification model (when torchvision is
  installed; a bare name that is not built in is looked up there too).
- ``package.module:factory``, a function of your own following the protocol below. The
  current directory is on the import path, as for ``python -m``.

Real architectures get random weights and are built offline: nothing is ever downloaded.

**Factory protocol.** ``factory(batch_size: int)`` returns ``(model, inputs, loss_fn)``:
``model`` a :class:`torch.nn.Module`, ``inputs`` a tuple of positional arguments (tensors
are moved to the profiling device), ``loss_fn`` a callable taking ``model(*inputs)`` and
returning a scalar tensor. The profiler runs ``loss_fn(model(*inputs)).backward()``. A
``loss_fn`` that holds targets should create them on ``output.device`` (as the built-ins
do with :class:`RandomTargetLoss`), since the profiler moves the model after the factory
returns. The model trains with an optimizer of its own (AdamW for a transformer, say)? The
factory may give it, and ``usbyte-opt profile`` then times its step instead of
``--optimizer``'s: as a 4th element, ``(model, inputs, loss_fn, optimizer)`` (an optimizer over
the model's parameters), or as an ``optimizer`` attribute of the factory, a callable that builds
it from the trainable parameters (``build.optimizer = functools.partial(torch.optim.AdamW,
lr=3e-4)``). A model may name itself in messages and in its profile's ``meta.model`` with a
string attribute ``usbyte_model_name`` (default: the spec's name, as the profile's).

Example::

    >>> model, inputs, loss_fn = build("mlp", batch_size=4)
    >>> loss = loss_fn(model(*inputs))
    >>> loss.dim(), sum(p.numel() for p in model.parameters())
    (0, 10512394)
"""

from __future__ import annotations

from .architectures import ARCHITECTURES, architecture_factory
from .external import HF_MODELS, install_hint, torchvision_factory, transformers_factory
from .protocol import PROTOCOL, Built, Factory, RandomTargetLoss, check_loss, make_batches, parameter_count
from .registry import (
    BUILTIN,
    LAB_MODELS,
    MODEL_NAME_ATTR,
    BuiltinModel,
    build,
    build_with_optimizer,
    builtin_names,
    model_name,
    resolve,
)

__all__ = ["ARCHITECTURES", "BUILTIN", "HF_MODELS", "LAB_MODELS", "MODEL_NAME_ATTR", "PROTOCOL", "Built",
           "BuiltinModel", "Factory", "RandomTargetLoss", "architecture_factory", "build", "build_with_optimizer",
           "builtin_names", "check_loss", "install_hint",
           "make_batches", "model_name", "parameter_count", "resolve", "torchvision_factory",
           "transformers_factory"]
