"""Real captcha images made locally with the `captcha` package, deterministic from a seed, cached on disk.

The article generates 120x50 captchas of 4 characters from a-z0-9, resizes them to 56x24 RGB, stores them
as C,W,H (it transposes numpy's H,W,C) and divides by 255. `captcha` 0.7 draws its randomness from the
`secrets` module, which cannot be seeded, so generation swaps in a seeded stand-in for that module.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Callable
from unittest import mock

import numpy
import torch

from bench.core.job_environment import CACHE_VARIABLE, variable

ALPHA_NUMS = "abcdefghijklmnopqrstuvwxyz0123456789"
DIGITS = 4
NUM_LABELS = len(ALPHA_NUMS) * DIGITS
CAPTCHA_SIZE = (120, 50)
IMAGE_SIZE = (56, 24)  # PIL (width, height), as in the article
CACHE_VERSION = 1


class SeededSecrets(random.Random):
    """The three `secrets` functions `captcha.image` calls, drawn from a seeded generator."""

    def randbelow(self, n: int) -> int:
        return self.randrange(n)

    def randbits(self, k: int) -> int:
        return self.getrandbits(k)


def cache_dir() -> Path:
    """Where generated data sets are kept: $MEMBENCH_CACHE, else ~/.cache/membench (never inside git; a blank
    $MEMBENCH_CACHE is unset, not the working directory)."""
    return Path(variable(CACHE_VARIABLE) or Path.home() / ".cache" / "membench")


def random_code(rng: random.Random) -> str:
    """A captcha text of DIGITS characters from ALPHA_NUMS."""
    return "".join(rng.choice(ALPHA_NUMS) for _ in range(DIGITS))


def image_to_tensor(img) -> torch.Tensor:
    """The article's conversion: resize, RGB, H,W,C -> C,W,H, scaled to [0, 1]."""
    arr = numpy.asarray(img.resize(IMAGE_SIZE).convert("RGB"))
    return torch.from_numpy(arr.copy()).transpose(0, 2) / 255.0


def code_to_tensor(code: str) -> torch.Tensor:
    """One-hot target of NUM_LABELS: position i*36 + symbol index is 1 for each character i."""
    t = torch.zeros((NUM_LABELS,))
    for index, c in enumerate(code.lower()):
        t[index * len(ALPHA_NUMS) + ALPHA_NUMS.index(c)] = 1
    return t


def tensor_to_code(tensor: torch.Tensor) -> str:
    """The most likely captcha text for one output or target row."""
    indices = tensor.reshape(DIGITS, len(ALPHA_NUMS)).max(dim=1).indices
    return "".join(ALPHA_NUMS[i] for i in indices)


def generate(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """`count` captchas from `seed`: images (count,3,56,24) float32, one-hot targets (count,144), texts."""
    from captcha.image import ImageCaptcha
    import captcha.image

    rng = SeededSecrets(seed)
    generator = ImageCaptcha(width=CAPTCHA_SIZE[0], height=CAPTCHA_SIZE[1])
    images, targets, codes = [], [], []
    with mock.patch.object(captcha.image, "secrets", rng):
        for _ in range(count):
            code = random_code(rng)
            images.append(image_to_tensor(generator.generate_image(code)))
            targets.append(code_to_tensor(code))
            codes.append(code)
    return torch.stack(images), torch.stack(targets), codes


def fallback_cache_dir() -> Path:
    """Where data sets go when `cache_dir()` cannot be written: a folder of this user's in the temporary folder."""
    return Path(tempfile.gettempdir()) / f"membench-cache-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _save(tensors: dict[str, torch.Tensor], name: str) -> None:
    """Saves `tensors` as `name` (atomically) in the cache, or in the fallback folder when the cache is unusable: an
    unwritable cache must cost a regeneration next time, never the case."""
    preferred, fallback = cache_dir(), fallback_cache_dir()
    for folder in (preferred, fallback):
        path = folder / name
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(tensors, tmp)
            os.replace(tmp, path)
            return
        except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            reason = getattr(error, "strerror", None) or str(error).splitlines()[0]
            if folder == preferred:
                _warn_once(f"the data cache {str(preferred)!r} is not usable ({reason}); using {str(fallback)!r} "
                           "instead (set MEMBENCH_CACHE to choose another folder)")
            else:
                _warn_once(f"the data cache fallback {str(fallback)!r} is not usable either ({reason}); the data "
                           "is made again each time")


def cached(name: str, make: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors saved as `name` in the cache (or its fallback), else `make()`'s, saved there for next time."""
    for folder in (cache_dir(), fallback_cache_dir()):
        path = folder / name
        if path.is_file():
            try:
                return torch.load(path, weights_only=True)
            except Exception:  # a truncated or foreign file: regenerate it
                pass
    tensors = make()
    _save(tensors, name)
    return tensors


def load(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and targets for (`count`, `seed`), generated once and then read from the cache."""
    def make():
        images, targets, _ = generate(count, seed)
        return {"images": images, "targets": targets}

    saved = cached(f"captcha-v{CACHE_VERSION}-seed{seed}-n{count}.pt", make)
    return saved["images"], saved["targets"]
