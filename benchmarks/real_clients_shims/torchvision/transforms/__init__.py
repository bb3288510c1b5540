"""The transforms a no-augmentation timm pipeline and Accelerate's cv examples run, as
torchvision defines them."""

import math
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


def _setup_size(size):
    if isinstance(size, numbers.Number):
        return int(size), int(size)
    if len(size) == 1:
        return size[0], size[0]
    if len(size) != 2:
        raise ValueError("Please provide only two dimensions (h, w) for size.")
    return tuple(size)


class RandomResizedCrop(torch.nn.Module):
    """A crop of random area (``scale`` of the image's) and aspect ratio (``ratio``, drawn
    log-uniformly), resized to ``size``: torchvision's draws, from torch's global generator, in
    its order (10 tries, then the central crop)."""

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0),
                 interpolation=InterpolationMode.BILINEAR, antialias=True):
        super().__init__()
        self.size = _setup_size(size)
        self.interpolation, self.antialias, self.scale, self.ratio = interpolation, antialias, scale, ratio

    @staticmethod
    def get_params(img, scale, ratio):
        _, height, width = functional.get_dimensions(img)
        area = height * width
        log_ratio = torch.log(torch.tensor(ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        in_ratio = float(width) / float(height)          # the central crop
        if in_ratio < min(ratio):
            w = width
            h = int(round(w / min(ratio)))
        elif in_ratio > max(ratio):
            h = height
            w = int(round(h * max(ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def forward(self, img):
        i, j, h, w = self.get_params(img, self.scale, self.ratio)
        return functional.resized_crop(img, i, j, h, w, self.size, self.interpolation, antialias=self.antialias)


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
