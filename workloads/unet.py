"""A small UNet that segments captcha characters (the memory-saving article): encoder feature maps kept for the decoder.

Article 002 §4.2 points at UNet-style networks, whose forward must keep every encoder level's feature map until
the decoder level that concatenates it, and suggests `del`-ing each one as soon as it is used. This is the plain
UNet: `depth` times [max-pool 2x2, double conv] down, then `depth` times [2x2 transposed conv up, concatenate the
skip, double conv], where a double conv is (conv3x3 - BatchNorm - ReLU) x 2, and a 1x1 conv to one logit per
pixel. The ReLUs are `nn.ReLU` modules, so that the in-place ReLU strategy finds them; no block writes over its
own input, so each block can be checkpointed on its own although its output also feeds a skip connection.

Options:
- `depth` (4): down-samplings; both image sides must be divisible by 2**depth.
- `base_channels` (16): channels of the first level, doubled at each level down.
- `image_size` ("128x48", width x height): the captchas are drawn at this size.
- `release_skips` (False): the article's `del`: drop each skip feature map once its decoder level has used it.
  In training autograd saves those maps anyway (the next max-pool and the ReLU that made them keep them), so the
  peak does not move (fwd+bwd at batch 16: 150,334,880 bytes either way); without autograd (eval under no_grad)
  the deeper levels' maps are freed before the top level runs (49,069,908 -> 43,564,884 bytes).

At the defaults the model has 1,942,577 parameters (7.8 MB in float32). Batch 16 by default: one training step
takes about 0.55 s on one CPU thread, and at the training peak (in backward) the saved activations (~129 MB)
outweigh the weights, gradients and Adam state (~31 MB together), as in the article's figure. Live tensor bytes,
torch 2.13 CPU.

Data: "captcha" (default) are 4-character captchas drawn locally with the `captcha` package
(`workloads.framework.unet_data`), RGB in [0, 1], with a mask of the characters as target; "synthetic" are uniform
random images and a random binary mask. Loss: binary cross-entropy with logits, per pixel.
"""

from __future__ import annotations

import torch
from torch import nn

from bench.core.errors import UsageError
from workloads import Workload, register_workload
from workloads.framework import unet_data


class DoubleConv(nn.Sequential):
    """(conv3x3 - BatchNorm - ReLU) x 2, keeping the spatial size."""

    def __init__(self, channels_in: int, channels_out: int):
        super().__init__(
            nn.Conv2d(channels_in, channels_out, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(channels_out),
            nn.ReLU(),
            nn.Conv2d(channels_out, channels_out, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(channels_out),
            nn.ReLU(),
        )


class EncoderBlock(nn.Module):
    """One level down: max-pool 2x2 (except at the first level), then a double conv."""

    def __init__(self, channels_in: int, channels_out: int, downsample: bool):
        super().__init__()
        self.pool = nn.MaxPool2d(2) if downsample else nn.Identity()
        self.conv = DoubleConv(channels_in, channels_out)

    def forward(self, x):
        return self.conv(self.pool(x))


class DecoderBlock(nn.Module):
    """One level up: transposed conv 2x2 (halving the channels), concatenate the skip, double conv."""

    def __init__(self, channels_in: int, channels_out: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(channels_in, channels_out, kernel_size=2, stride=2)
        self.conv = DoubleConv(2 * channels_out, channels_out)

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """Encoder blocks (the last is the bottleneck), decoder blocks, and a 1x1 conv to one logit per pixel."""

    def __init__(self, depth: int, base_channels: int, release_skips: bool = False, channels_in: int = 3):
        super().__init__()
        self.release_skips = release_skips
        channels = [base_channels * 2**level for level in range(depth + 1)]
        self.encoders = nn.ModuleList(
            [EncoderBlock(channels_in, channels[0], downsample=False)]
            + [EncoderBlock(channels[level - 1], channels[level], downsample=True) for level in range(1, depth + 1)])
        self.decoders = nn.ModuleList(
            [DecoderBlock(channels[level + 1], channels[level]) for level in reversed(range(depth))])
        self.head = nn.Conv2d(channels[0], 1, kernel_size=1)

    def forward(self, x):
        skips = []
        for encoder in self.encoders:
            x = encoder(x)
            skips.append(x)
        del skips[-1]  # the bottleneck's output goes up, not across
        for level, decoder in zip(reversed(range(len(skips))), self.decoders):
            x = decoder(x, skips[level])
            if self.release_skips:
                del skips[level]  # the list held the last reference: no decoder level after this one reads it
        return self.head(x)


@register_workload
class UNetWorkload(Workload):
    """Captcha-character segmentation with a small UNet, BCE with logits, Adam, batch 16."""

    name = "unet"
    description = "UNet (depth 4, 16 base channels) segmenting captcha characters, 3x48x128 -> 1x48x128, BCE, Adam"
    default_batch_size = 16
    seed = 0
    data_sources = ("captcha", "synthetic")
    options = {"depth": 4, "base_channels": 16, "image_size": "128x48", "release_skips": False}
    units_chain = False  # encoder outputs also feed the decoder's skip connections
    small = ("unet:depth=2:base_channels=4:image_size=32x16", 2)
    small_for = {"peak_in_backward": ("unet:depth=2:base_channels=4:image_size=32x16", 4),
                 "fake_cuda": ("unet:depth=1", 2)}

    def configure(self) -> None:
        self.require_positive("depth", "base_channels")
        depth = self.settings["depth"]
        width, sep, height = self.settings["image_size"].lower().partition("x")
        if not (sep and width.isdigit() and height.isdigit()):
            raise UsageError(f"bad value {self.settings['image_size']!r} for unet:image_size; expected WIDTHxHEIGHT")
        self.image_width, self.image_height = int(width), int(height)
        if self.image_width % 2**depth or self.image_height % 2**depth or not self.image_width * self.image_height:
            raise UsageError(f"unet:image_size={self.settings['image_size']}: both sides must be positive multiples "
                             f"of 2**depth = {2**depth}")

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return UNet(self.settings["depth"], self.settings["base_channels"], self.settings["release_skips"])

    def checkpoint_units(self, model: nn.Module) -> list[nn.Module]:
        return [*model.encoders, *model.decoders]

    def make_batch(self, batch_size: int, data: str = "captcha") -> tuple[torch.Tensor, torch.Tensor]:
        if self.check_data(data) == "captcha":
            return unet_data.load(batch_size, self.seed, self.image_width, self.image_height)
        gen = torch.Generator().manual_seed(self.seed)
        images = torch.rand((batch_size, 3, self.image_height, self.image_width), generator=gen)
        masks = torch.randint(2, (batch_size, 1, self.image_height, self.image_width), generator=gen).float()
        return images, masks

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(output, target)
