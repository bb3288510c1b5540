"""The transforms a no-augmentation timm pipeline runs, as torchvision defines them."""

import numbers

import torch

from torchvision import missing

from . import functional
from .functional import InterpolationMode


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, img):
        for t in self.transforms:
            img = t(img)
        return img


class Resize(torch.nn.Module):
    def __init__(self, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
        super().__init__()
        self.size, self.interpolation, self.max_size, self.antialias = size, interpolation, max_size, antialias

    def forward(self, img):
        return functional.resize(img, self.size, self.interpolation, self.max_size, self.antialias)


class CenterCrop(torch.nn.Module):
    def __init__(self, size):
        super().__init__()
        self.size = (int(size), int(size)) if isinstance(size, numbers.Number) else tuple(size)

    def forward(self, img):
        return functional.center_crop(img, self.size)


class ToTensor:
    def __call__(self, pic):
        return functional.to_tensor(pic)


class PILToTensor:
    def __call__(self, pic):
        return functional.pil_to_tensor(pic)


class Normalize(torch.nn.Module):
    def __init__(self, mean, std, inplace=False):
        super().__init__()
        self.mean, self.std, self.inplace = mean, std, inplace

    def forward(self, tensor):
        return functional.normalize(tensor, self.mean, self.std, self.inplace)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing("transforms", name)
