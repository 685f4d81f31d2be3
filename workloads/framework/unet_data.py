"""Captcha images with an exact mask of their characters, made locally for the UNet workload, cached on disk.

`ImageCaptcha.generate_image` draws, in order: a background colour, a character colour, the characters
(`create_captcha_image`), noise dots and a noise curve in the character colour, then smooths the image. The mask
replays the same seeded draws up to the characters, with white characters on black, so it covers exactly the
glyphs: not the noise dots and curve, which share the characters' colour, and not the smoothing's halo.
Images are N,3,H,W RGB in [0, 1]; masks N,1,H,W of 0.0 and 1.0.
"""

from __future__ import annotations

from unittest import mock

import numpy
import torch

from workloads.framework import captcha_data

CACHE_VERSION = 1
FONT_SIZES_AT_60_PX = (42, 50, 56)  # the `captcha` package's defaults, for its default height of 60
WHITE, BLACK = (255, 255, 255), (0, 0, 0)
MASK_THRESHOLD = 128  # a pixel is glyph when at least half covered in the white-on-black replay


def _to_tensor(img) -> torch.Tensor:
    """An RGB or L image as C,H,W float32 in [0, 1]."""
    arr = numpy.asarray(img, dtype=numpy.uint8)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr.copy()).permute(2, 0, 1) / 255.0


def generate(count: int, seed: int, width: int, height: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """`count` captchas of width x height from `seed`: images (count,3,H,W), masks (count,1,H,W), texts."""
    import captcha.image
    from captcha.image import ImageCaptcha

    rng = captcha_data.SeededSecrets(seed)
    # fonts scaled to the height, so that any image size shows whole characters as the package's 60 px default does
    font_sizes = tuple(max(8, round(size * height / 60)) for size in FONT_SIZES_AT_60_PX)
    generator = ImageCaptcha(width=width, height=height, font_sizes=font_sizes)
    images, masks, codes = [], [], []
    with mock.patch.object(captcha.image, "secrets", rng):
        for _ in range(count):
            code = captcha_data.random_code(rng)
            before = rng.getstate()
            image = generator.generate_image(code)
            after = rng.getstate()
            rng.setstate(before)
            captcha.image.random_color(238, 255)  # background, as generate_image draws it
            opacity = rng.randbelow(36) + 220
            captcha.image.random_color(10, 200, opacity)  # character colour
            glyphs = generator.create_captcha_image(code, (*WHITE, opacity), BLACK).convert("L")
            rng.setstate(after)
            images.append(_to_tensor(image.convert("RGB")))
            masks.append((_to_tensor(glyphs) >= MASK_THRESHOLD / 255.0).float())
            codes.append(code)
    return torch.stack(images), torch.stack(masks), codes


def load(count: int, seed: int, width: int, height: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and masks for (`count`, `seed`, size), generated once and then read from the cache."""
    def make():
        images, masks, _ = generate(count, seed, width, height)
        return {"images": images, "masks": masks}

    saved = captcha_data.cached(f"unet-captcha-v{CACHE_VERSION}-{width}x{height}-seed{seed}-n{count}.pt", make)
    return saved["images"], saved["masks"]
