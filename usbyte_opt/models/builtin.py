"""The small built-in models ``mlp``, ``cnn`` and ``transformer``: they run on a CPU in a
fraction of a second, for the demo and the tests.

Example::

    >>> from usbyte_opt.models import parameter_count
    >>> model, (ids,), loss_fn = transformer(2, seq=16)
    >>> tuple(ids.shape), parameter_count(model), loss_fn(model(ids)).dim()
    ((2, 16), 4212224, 0)
"""

from __future__ import annotations

import torch
from torch import nn

from .protocol import Built, RandomTargetLoss


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


def mlp(batch_size: int) -> Built:
    """:class:`MLP` on random 1024-feature inputs."""
    torch.manual_seed(0)
    return MLP(), (torch.randn(batch_size, 1024),), RandomTargetLoss(10, (batch_size,))


def cnn(batch_size: int) -> Built:
    """:class:`SmallCNN` on random 32x32 images."""
    torch.manual_seed(0)
    return SmallCNN(), (torch.randn(batch_size, 3, 32, 32),), RandomTargetLoss(10, (batch_size,))


def transformer(batch_size: int, seq: int = 64) -> Built:
    """:class:`TinyGPT` on random token ids, ``seq`` tokens per sample."""
    torch.manual_seed(0)
    m = TinyGPT(context=seq)
    ids = torch.randint(4096, (batch_size, seq), generator=torch.Generator().manual_seed(1))
    return m, (ids,), RandomTargetLoss(4096, (batch_size, seq))
