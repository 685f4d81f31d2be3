"""Real text that every Python installation ships, as bytes: the standard library's own top-level source files.

Nothing is downloaded. The corpus is the top-level `*.py` files of `sysconfig.get_paths()["stdlib"]` in sorted
file-name order, concatenated as bytes and cut at `CORPUS_LIMIT_BYTES`, kept in memory once read. Only top-level
modules are used, so optional subpackages (test, idlelib, tkinter, site-packages) cannot change it, and
`_sysconfigdata_*` (written per platform by the build) is left out. The text therefore depends only on the Python
version (3.11.7 gives a different corpus from 3.12.1), except on distributions that patch stdlib modules
(Debian's `site.py`, `sysconfig.py`), which change it slightly: compare `corpus_digest()` across machines.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path

import torch

from bench.core.units import MiB

CORPUS_LIMIT_BYTES = 4 * MiB
PLATFORM_SPECIFIC_PREFIX = "_sysconfigdata"


def stdlib_source_files() -> list[Path]:
    """The standard library's top-level `*.py` files, sorted by name, without the platform-specific ones."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in stdlib.glob("*.py") if f.is_file() and not f.name.startswith(PLATFORM_SPECIFIC_PREFIX)]
    return sorted(files, key=lambda f: f.name)


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of at most CORPUS_LIMIT_BYTES bytes (read once per process)."""
    chunks, size = [], 0
    for file in stdlib_source_files():
        if size >= CORPUS_LIMIT_BYTES:
            break
        data = file.read_bytes()
        chunks.append(data)
        size += len(data)
    corpus = b"".join(chunks)[:CORPUS_LIMIT_BYTES]
    if not corpus:
        raise RuntimeError(f"no Python source files under {sysconfig.get_paths()['stdlib']!r}")
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


def corpus_digest() -> str:
    """SHA-256 of the corpus, to check that two machines train on the same text."""
    return hashlib.sha256(stdlib_corpus().numpy().tobytes()).hexdigest()


def next_token_windows(batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` corpus windows at seeded random offsets: inputs (B, T) int64 and the next bytes (B, T)."""
    corpus = stdlib_corpus()
    window = seq_len + 1
    if window > corpus.numel():
        raise ValueError(f"seq_len {seq_len} needs {window} bytes; the corpus has {corpus.numel()}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(corpus.numel() - window + 1, (batch_size,), generator=gen)
    tokens = corpus[starts[:, None] + torch.arange(window)].long()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
