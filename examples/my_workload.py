"""My own workload: a small CNN that classifies 32x32 colour images into 10 classes, measured with membench.

Copy this file next to your code and change the model, the data and the loss; membench does the rest. From the
root of the membench checkout (for your copy, give its path instead):

    python -m bench compare --workload examples/my_workload.py:MyWorkload --strategies checkpoint --device cpu --quick

Options go after the class name, as for the built-in workloads, and `--strategies` takes a comma list (`python -m
bench list` lists the strategies):

    python -m bench compare --workload examples/my_workload.py:MyWorkload:width=64:blocks=6 \
        --strategies checkpoint:segments=3,del_intermediates --device cpu --quick

The data here are random images with random labels: memory and step time do not depend on the values. To train
on your own data, load a batch in `make_batch` and add its name to `data_sources` (e.g. `("mine", "synthetic")`;
`--data mine` picks it).
"""

from __future__ import annotations

import torch
from torch import nn

from workloads import Workload


class ConvBlock(nn.Module):
    """conv 3x3, BatchNorm, ReLU, then a 2x2 max-pool when `downsample` (the image's height and width halve)."""

    def __init__(self, channels: int, downsample: bool):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2) if downsample else nn.Identity()

    def forward(self, x):
        return self.pool(self.relu(self.norm(self.conv(x))))


class SmallCNN(nn.Module):
    """stem (conv to `width` channels), `blocks` ConvBlocks (every other one halves the image), head (pool,
    dropout, linear)."""

    def __init__(self, width: int, blocks: int, num_classes: int, dropout: float):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, kernel_size=3, padding=1), nn.ReLU())
        self.blocks = nn.Sequential(*[ConvBlock(width, downsample=i % 2 == 1) for i in range(blocks)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
                                  nn.Linear(width, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class MyWorkload(Workload):
    """SmallCNN on random 3x32x32 images, cross-entropy, Adam (the default optimizer), batch 64."""

    name = "my_small_cnn"
    description = "my small CNN (stem, conv blocks, dropout head) on random 32x32 images, cross-entropy, Adam"
    default_batch_size = 64
    data_sources = ("synthetic",)
    # declared here, set as examples/my_workload.py:MyWorkload:width=64; the values in use are in self.settings
    options = {"width": 32, "blocks": 4, "num_classes": 10, "dropout": 0.1}
    image_shape = (3, 32, 32)

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)  # the same weights for every strategy
        return SmallCNN(**self.settings)

    def make_batch(self, batch_size: int, data: str = "synthetic"):
        self.check_data(data)
        gen = torch.Generator().manual_seed(self.seed)  # the same batch for every strategy
        images = torch.randn((batch_size, *self.image_shape), generator=gen)
        labels = torch.randint(self.settings["num_classes"], (batch_size,), generator=gen)
        return images, labels

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def checkpoint_units(self, model: SmallCNN) -> list[nn.Module]:
        # the blocks that checkpointing may recompute, in the order forward calls them; each one's output is the
        # next one's only input (units_chain = True, the default), so consecutive units may share a checkpoint
        return [model.stem, *model.blocks, model.head]
