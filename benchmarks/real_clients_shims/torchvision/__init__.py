"""A stand-in for the parts of torchvision that the trainers of benchmarks/real_clients.py import.

torchvision has no build beside this CPU torch, and a trainer that imports it would not start.
This package satisfies those imports and nothing more: the pieces a run actually executes
(resizing and cropping PIL images, a random resized crop, to-tensor, normalisation, ``FrozenBatchNorm2d``) follow
torchvision's definitions; anything else raises when it is used, so a run can never
silently train with a stand-in of something it did not implement.
"""

__version__ = "0.0.0+usbyte.shim"


class _Missing:
    """A torchvision name the stand-in does not provide: importable, refused when used."""

    _name = "?"

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"torchvision stand-in: {self._name} is not provided")


def missing(module: str, name: str):
    return type(name, (_Missing,), {"_name": f"{module}.{name}"})
