"""The captcha-recognition ResNet-18 of the source article, with Adam, BCELoss and batch size 100.

Module names and structure follow the article's `MyModel` exactly, so its state_dict keys are the same.
The only addition is `inplace_relu`, a flag each module reads when it calls `relu`, which is False
(the article's code) unless a strategy sets it.
"""

from __future__ import annotations

import torch
from torch import nn

from workloads import Workload, register_workload
from workloads.framework import captcha_data

DIGITS = captcha_data.DIGITS
SYMBOLS = len(captcha_data.ALPHA_NUMS)
NUM_LABELS = captcha_data.NUM_LABELS


class BasicBlock(nn.Module):
    """ResNet basic block: conv3x3-BN-ReLU-conv3x3-BN, plus identity or 1x1 conv-BN shortcut, then ReLU."""

    expansion = 1

    def __init__(self, channels_in: int, channels_out: int, stride: int):
        super().__init__()
        self.inplace_relu = False
        self.conv1 = nn.Sequential(
            nn.Conv2d(channels_in, channels_out, kernel_size=3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(channels_out))
        self.conv2 = nn.Sequential(
            nn.Conv2d(channels_out, channels_out, kernel_size=3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(channels_out))
        self.identity = nn.Sequential()
        if stride != 1 or channels_in != channels_out * self.expansion:
            self.identity = nn.Sequential(
                nn.Conv2d(channels_in, channels_out * self.expansion, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(channels_out * self.expansion))

    def forward(self, x):
        tmp = self.conv1(x)
        tmp = nn.functional.relu(tmp, inplace=self.inplace_relu)
        tmp = self.conv2(tmp)
        tmp += self.identity(x)
        return nn.functional.relu(tmp, inplace=self.inplace_relu)


class Stem(nn.Module):
    """The article's first stage: conv3x3 3->64 + BN (its `conv1`) followed by ReLU."""

    def __init__(self, model: "CaptchaResNet18"):
        super().__init__()
        self.model = [model]  # a list, so the parent is not registered as a submodule

    def forward(self, x):
        model = self.model[0]
        return nn.functional.relu(model.conv1(x), inplace=model.inplace_relu)


class Head(nn.Module):
    """The article's last stage: average pool, flatten, linear 512->144, softmax per character."""

    def __init__(self, model: "CaptchaResNet18"):
        super().__init__()
        self.model = [model]

    def forward(self, x):
        model = self.model[0]
        tmp = model.avgPool(x)
        tmp = tmp.view(tmp.shape[0], -1)
        tmp = model.fc_model(tmp)
        tmp = tmp.reshape(tmp.shape[0], DIGITS, SYMBOLS)
        tmp = model.softmax(tmp)
        return tmp.reshape(tmp.shape[0], NUM_LABELS)


class CaptchaResNet18(nn.Module):
    """The article's `MyModel`: ResNet-18 (BasicBlock x [2,2,2,2]) for 4-character captchas."""

    def __init__(self, block_type=BasicBlock, width: int = 64):
        """`width`: the stem's and first stage's channels (the article's 64), doubled at each later stage."""
        super().__init__()
        self.inplace_relu = False
        self.previous_channels_out = width
        self.conv1 = nn.Sequential(
            nn.Conv2d(3, self.previous_channels_out, kernel_size=3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(self.previous_channels_out))
        self.layer1 = self._make_layer(block_type, channels_out=width, num_blocks=2, stride=1)
        self.layer2 = self._make_layer(block_type, channels_out=2 * width, num_blocks=2, stride=2)
        self.layer3 = self._make_layer(block_type, channels_out=4 * width, num_blocks=2, stride=2)
        self.layer4 = self._make_layer(block_type, channels_out=8 * width, num_blocks=2, stride=2)
        self.avgPool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc_model = nn.Linear(8 * width * block_type.expansion, NUM_LABELS)
        self.softmax = nn.Softmax(dim=2)
        self._stages: list[nn.Module] | None = None  # a plain list, built once: not registered a second time

    def _make_layer(self, block_type, channels_out, num_blocks, stride):
        blocks = [block_type(self.previous_channels_out, channels_out, stride)]
        self.previous_channels_out = channels_out * block_type.expansion
        for _ in range(num_blocks - 1):
            blocks.append(block_type(self.previous_channels_out, self.previous_channels_out, 1))
            self.previous_channels_out *= block_type.expansion
        return nn.Sequential(*blocks)

    def stages(self) -> list[nn.Module]:
        """Stem, the eight blocks, head: chaining them computes exactly `forward`."""
        if self._stages is None:
            blocks = [block for layer in (self.layer1, self.layer2, self.layer3, self.layer4) for block in layer]
            self._stages = [Stem(self), *blocks, Head(self)]
        return self._stages

    def forward(self, x):
        for stage in self.stages():
            x = stage(x)
        return x


@register_workload
class CaptchaResNet18Workload(Workload):
    """Captcha ResNet-18 (article 000): 3x56x24 input, 144 outputs, BCELoss, Adam, batch 100."""

    name = "captcha_resnet18"
    description = "captcha ResNet-18 (BasicBlock x[2,2,2,2]), 3x56x24 -> 4x36 softmax, BCELoss, Adam"
    default_batch_size = 100
    seed = 0
    data_sources = ("captcha", "synthetic")
    input_shape = (3, 56, 24)
    num_outputs = NUM_LABELS
    # `width` scales every stage's channels (the article's 64); the registry-wide tests run every strategy at 16, the
    # same blocks and modules with a 16th of the weights (each case's weights, gradients, Adam's moments and the
    # verification's copies of them were most of its time at 64). On fake CUDA, where a step costs the same at any
    # size, at the article's width.
    options = {"width": 64}
    small = ("captcha_resnet18:width=16", 2)
    small_for = {"peak_in_backward": ("captcha_resnet18:width=16", 4), "fake_cuda": ("captcha_resnet18", 2)}

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return CaptchaResNet18(width=self.settings["width"])

    def checkpoint_units(self, model: nn.Module) -> list[nn.Module]:
        return model.stages()

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy(output, target)  # the article's nn.BCELoss()

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters())

    def make_batch(self, batch_size: int, data: str = "captcha") -> tuple[torch.Tensor, torch.Tensor]:
        if self.check_data(data) == "captcha":
            return captcha_data.load(batch_size, self.seed)
        gen = torch.Generator().manual_seed(self.seed)
        images = torch.rand((batch_size, *self.input_shape), generator=gen)
        symbols = torch.randint(SYMBOLS, (batch_size, DIGITS), generator=gen)
        targets = nn.functional.one_hot(symbols, SYMBOLS).reshape(batch_size, NUM_LABELS).float()
        return images, targets
