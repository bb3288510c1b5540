"""ResNet-50/152, VGG-16 and DenseNet-201 without torchvision, tensor for tensor as torchvision's.

The shipped profiles (``profiles/*.json``) were made from torchvision's models. These
definitions have exactly torchvision's trainable tensors — the same names, shapes, dtypes
and registration order — so that ``usbyte-opt profile resnet50`` and a training script that
builds ``resnet50`` here produce and accept the same schedules as torchvision's model does
(same :func:`usbyte_opt.formats.fingerprint`; ``tests/test_models.py`` checks it
against each shipped profile). Their forward computes what torchvision's does, and weights
are initialised the way torchvision initialises them (random: nothing is ever downloaded).

They exist because torchvision must match the installed torch build exactly, and on the
CPU-only install ``pip install torchvision`` replaces the CPU torch with a multi-GB CUDA
build. Any other torchvision model stays available as ``torchvision:NAME``.

Example::

    >>> with torch.device("meta"):                    # shapes only, no memory
    ...     m = resnet50()
    >>> sum(p.numel() for p in m.parameters()), next(iter(m.state_dict()))
    (25557032, 'conv1.weight')
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import UsbyteError
from .protocol import Built, Factory, RandomTargetLoss

# --------------------------------------------------------------------------------------------
# ResNet (He et al., 2016), torchvision's v1.5 layout: the stride is on the 3x3 convolution
# --------------------------------------------------------------------------------------------


def _conv3x3(i: int, o: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(i, o, 3, stride=stride, padding=1, bias=False)


def _conv1x1(i: int, o: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(i, o, 1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4; identity or 1x1 projection."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ``ResNet`` with :class:`Bottleneck` blocks (``layers`` per stage)."""

    def __init__(self, layers: Sequence[int], num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(_conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                                       nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50: 161 tensors, 25.6 M parameters."""
    return ResNet([3, 4, 6, 3], num_classes)


def resnet152(num_classes: int = 1000) -> ResNet:
    """ResNet-152: 467 tensors, 60.2 M parameters."""
    return ResNet([3, 8, 36, 3], num_classes)


# --------------------------------------------------------------------------------------------
# VGG-16 (Simonyan and Zisserman, 2015), configuration D without batch norm
# --------------------------------------------------------------------------------------------

#: Output channels of VGG-16's convolutions, ``"M"`` a 2x2 max pool.
VGG16_CFG: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                                    512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    """torchvision's ``VGG``: ``features`` (convolutions with bias, ReLU, max pools), a 7x7
    adaptive average pool and a three-layer classifier with dropout."""

    def __init__(self, cfg: Sequence[int | str] = VGG16_CFG, num_classes: int = 1000,
                 dropout: float = 0.5):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(channels, int(v), kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                channels = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:  # always, in VGG-16; for the type checker
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg16(num_classes: int = 1000) -> VGG:
    """VGG-16: 32 tensors, 138.4 M parameters (most in the first classifier layer)."""
    return VGG(VGG16_CFG, num_classes)


# --------------------------------------------------------------------------------------------
# DenseNet-201 (Huang et al., 2017)
# --------------------------------------------------------------------------------------------


class _DenseLayer(nn.Module):
    """Batch norm, ReLU, 1x1 convolution to ``bn_size * growth`` channels, batch norm, ReLU,
    3x3 convolution to ``growth`` new channels, on the concatenation of all earlier ones."""

    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, kernel_size=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, kernel_size=3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        bottleneck = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class _DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers: int, num_input_features: int, bn_size: int, growth_rate: int):
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"denselayer{i + 1}",
                            _DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size))

    def forward(self, init_features: torch.Tensor) -> torch.Tensor:
        features = [init_features]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    def __init__(self, num_input_features: int, num_output_features: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, kernel_size=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


class DenseNet(nn.Module):
    """torchvision's ``DenseNet``: stem, dense blocks joined by halving transitions, a final
    batch norm and a linear classifier."""

    def __init__(self, growth_rate: int = 32, block_config: Sequence[int] = (6, 12, 48, 32),
                 num_init_features: int = 64, bn_size: int = 4, num_classes: int = 1000):
        super().__init__()
        self.features = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(3, num_init_features, kernel_size=7, stride=2, padding=3, bias=False)),
            ("norm0", nn.BatchNorm2d(num_init_features)),
            ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]))
        n = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", _DenseBlock(num_layers, n, bn_size, growth_rate))
            n += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", _Transition(n, n // 2))
                n //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(n))
        self.classifier = nn.Linear(n, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.features(x), inplace=True)
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(out, (1, 1)), 1))


def densenet201(num_classes: int = 1000) -> DenseNet:
    """DenseNet-201: 604 tensors, 20.0 M parameters."""
    return DenseNet(32, (6, 12, 48, 32), 64, 4, num_classes)


#: The architectures by the name the registry and the shipped profiles use.
ARCHITECTURES = {"resnet50": resnet50, "resnet152": resnet152, "vgg16": vgg16,
                 "densenet201": densenet201}


def architecture_factory(name: str, image_size: int = 224) -> Factory:
    """A factory for built-in architecture ``name`` (:data:`ARCHITECTURES`) on random
    ``image_size``-pixel images, with cross-entropy against random labels of its 1000
    classes: what :func:`~usbyte_opt.models.external.torchvision_factory` gives for
    torchvision's model of that name.

    Example::

        >>> factory = architecture_factory("resnet50", image_size=64)
        >>> model, (x,), loss_fn = factory(2)
        >>> tuple(x.shape), loss_fn(model(x)).dim()
        ((2, 3, 64, 64), 0)
    """
    if name not in ARCHITECTURES:
        raise UsbyteError(f"unknown built-in architecture {name!r}: expected one of {', '.join(ARCHITECTURES)}")

    def factory(batch_size: int) -> Built:
        torch.manual_seed(0)
        model = ARCHITECTURES[name]()
        x = torch.randn(batch_size, 3, image_size, image_size)
        return model, (x,), RandomTargetLoss(1000, (batch_size,))

    factory.__name__ = name
    return factory


__all__ = ["ARCHITECTURES", "DenseNet", "ResNet", "VGG", "architecture_factory", "densenet201", "resnet152",
           "resnet50", "vgg16"]
