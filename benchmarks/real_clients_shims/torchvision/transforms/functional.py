"""torchvision.transforms.functional for PIL images and tensors: the few functions used."""

from enum import Enum

import numpy as np
import torch
from PIL import Image

from torchvision import missing


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_PIL = {InterpolationMode.NEAREST: Image.NEAREST, InterpolationMode.BILINEAR: Image.BILINEAR,
        InterpolationMode.BICUBIC: Image.BICUBIC, InterpolationMode.BOX: Image.BOX,
        InterpolationMode.HAMMING: Image.HAMMING, InterpolationMode.LANCZOS: Image.LANCZOS}


def _need_pil(img, what):
    if not isinstance(img, Image.Image):
        raise NotImplementedError(f"torchvision stand-in: {what} of a {type(img).__name__}")


def get_image_size(img):
    _need_pil(img, "get_image_size")
    return list(img.size)


def get_dimensions(img):
    _need_pil(img, "get_dimensions")
    return [len(img.getbands()), img.size[1], img.size[0]]


def resize(img, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
    _need_pil(img, "resize")
    w, h = img.size
    if isinstance(size, int) or len(size) == 1:          # the shorter side to size, as torchvision
        s = size if isinstance(size, int) else size[0]
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = s, int(s * long / short)
        if max_size is not None and new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
        ow, oh = (new_short, new_long) if w <= h else (new_long, new_short)
    else:
        oh, ow = size
    if (ow, oh) == (w, h):
        return img
    return img.resize((ow, oh), _PIL[interpolation])


def crop(img, top, left, height, width):
    _need_pil(img, "crop")
    return img.crop((left, top, left + width, top + height))


def center_crop(img, output_size):
    _need_pil(img, "center_crop")
    if isinstance(output_size, int):
        output_size = (output_size, output_size)
    elif len(output_size) == 1:
        output_size = (output_size[0], output_size[0])
    w, h = img.size
    ch, cw = output_size
    if cw > w or ch > h:
        raise NotImplementedError("torchvision stand-in: center_crop with padding")
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    return crop(img, top, left, ch, cw)


def resized_crop(img, top, left, height, width, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
    return resize(crop(img, top, left, height, width), size, interpolation)


def pil_to_tensor(pic):
    _need_pil(pic, "pil_to_tensor")
    arr = np.array(pic, copy=True)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def to_tensor(pic):
    if isinstance(pic, np.ndarray):
        arr = pic[:, :, None] if pic.ndim == 2 else pic
        t = torch.from_numpy(arr.transpose(2, 0, 1).copy())
        return t.to(torch.get_default_dtype()).div(255) if t.dtype == torch.uint8 else t
    return pil_to_tensor(pic).to(torch.get_default_dtype()).div(255)


def normalize(tensor, mean, std, inplace=False):
    if not inplace:
        tensor = tensor.clone()
    mean = torch.as_tensor(mean, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
    return tensor.sub_(mean).div_(std)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing("transforms.functional", name)
