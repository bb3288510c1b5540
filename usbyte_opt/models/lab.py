"""Models sized for the lab: communication about as long as compute at 200 Mbit/s.

The built-in ``cnn`` (9.5 M parameters, 38 MB of gradients) is hopelessly
communication-bound at 200 Mbit/s, so every schedule looks the same. These three keep the
built-ins' shapes but are sized so that, on one CPU thread per rank, one all-reduce of all
gradients at 200 Mbit/s takes about as long as forward plus backward — the regime where
scheduling matters (the measurements: ``docs/bench.md``, item 1 of "What the measurements
show"). At 1 Gbit/s the same models are compute-bound.

* :func:`lab_cnn` — the built-in CNN's convolution stack (with batch norm) and a classifier of
  one 8192x128 layer: 1.14 M parameters (4.6 MB), most of them at the output side, ready
  early in backward and needed late in forward.
* :func:`lab_vgg` — a VGG-style stack: two stem convolutions, then eight 3x3 convolutions of
  128 channels at 8x8, global average pooling and a 128x10 classifier: 1.22 M parameters
  (4.9 MB) spread evenly over the depth in 0.6 MB tensors, as in VGG and ResNet conv stacks.
  DDP's first bucket (1 MiB) then holds only the two output-side convolutions and the other
  3.7 MB go out after backward; a per-tensor schedule can overlap them with backward and the
  next forward.
* :func:`lab_transformer` — a 4-layer causal transformer of width 192 with an *untied* vocabulary
  of 2048: 2.6 M parameters (10.3 MB); the token embedding is needed first in forward and ready
  last in backward, the head the other way round.

Name them as ``lab-cnn`` / ``lab-vgg`` / ``lab-transformer`` anywhere a model is named
(built-in names of :mod:`usbyte_opt.models.registry`, with their default batches), or as
``usbyte_opt.models.lab:lab_cnn``.

Example::

    >>> from usbyte_opt.models import build, parameter_count
    >>> model, inputs, loss_fn = build(lab_cnn, batch_size=2)
    >>> parameter_count(model), loss_fn(model(*inputs)).dim()
    (1143466, 0)
    >>> parameter_count(build(lab_vgg, batch_size=2)[0])
    1221034
"""

from __future__ import annotations

import torch
from torch import nn

from .protocol import Built, RandomTargetLoss


def conv_bn_relu(i: int, o: int) -> nn.Sequential:
    """A 3x3 convolution (no bias), batch norm and ReLU: the block of both lab CNNs."""
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())


class LabCNN(nn.Module):
    """Three 3x3 convolutions with batch norm (32, 64, 128 channels) and two linear layers."""

    def __init__(self, classes: int = 10, hidden: int = 128):
        super().__init__()
        block = conv_bn_relu
        self.features = nn.Sequential(block(3, 32), block(32, 64), nn.MaxPool2d(2),
                                      block(64, 128), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 8 * 8, hidden), nn.ReLU(),
                                        nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class LabVGG(nn.Module):
    """Stem convolutions (32 channels at 32x32, 128 at 16x16), ``depth`` 3x3 convolutions of
    ``width`` channels at 8x8 (batch norm, ReLU), global average pooling, one linear layer."""

    def __init__(self, classes: int = 10, width: int = 128, depth: int = 8):
        super().__init__()
        block = conv_bn_relu
        self.features = nn.Sequential(block(3, 32), nn.MaxPool2d(2), block(32, width), nn.MaxPool2d(2),
                                      *[block(width, width) for _ in range(depth)])
        self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class LabGPT(nn.Module):
    """A causal transformer with separate input embedding and output head."""

    def __init__(self, vocab: int = 2048, width: int = 192, layers: int = 4, heads: int = 4,
                 context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(s, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(s, device=ids.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def lab_cnn(batch_size: int) -> Built:
    """:class:`LabCNN` on random 32x32 images (default batch 16 in ``bench``)."""
    torch.manual_seed(0)
    return LabCNN(), (torch.randn(batch_size, 3, 32, 32),), RandomTargetLoss(10, (batch_size,))


def lab_vgg(batch_size: int) -> Built:
    """:class:`LabVGG` on random 32x32 images (default batch 12 in ``bench``)."""
    torch.manual_seed(0)
    return LabVGG(), (torch.randn(batch_size, 3, 32, 32),), RandomTargetLoss(10, (batch_size,))


def lab_transformer(batch_size: int, seq: int = 64) -> Built:
    """:class:`LabGPT` on random token ids, ``seq`` tokens per sample (default batch 12 in ``bench``)."""
    torch.manual_seed(0)
    m = LabGPT(context=seq)
    ids = torch.randint(2048, (batch_size, seq), generator=torch.Generator().manual_seed(1))
    return m, (ids,), RandomTargetLoss(2048, (batch_size, seq))

