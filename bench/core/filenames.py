"""File names that every file system takes: at most 255 bytes with the atomic writer's temporary name, a long name
shortened with a hash that keeps it unique and its start readable."""

from __future__ import annotations

import hashlib

FILE_SYSTEM_LIMIT_BYTES = 255  # a file name's limit on ext4, XFS, btrfs, APFS and NTFS (in UTF-16 units there)
# the atomic writer's temporary beside it is `.<name>.<8 random>.tmp` (bench.core.atomic): 14 bytes more, and room
NAME_LIMIT_BYTES = FILE_SYSTEM_LIMIT_BYTES - 24


def bounded_name(stem: str, suffix: str = "", limit: int = NAME_LIMIT_BYTES) -> str:
    """`stem + suffix`, or, where that is over `limit` bytes, the start of `stem`, `~`, 12 hex digits of its
    SHA-256 and `suffix` (two stems that differ anywhere get different names)."""
    name = stem + suffix
    if len(name.encode()) <= limit:
        return name
    digest = hashlib.sha256(stem.encode()).hexdigest()[:12]
    room = limit - len(suffix.encode()) - len(digest) - 1
    if room < 1:
        raise ValueError(f"a file name suffix of {len(suffix.encode())} bytes leaves no room under {limit} bytes")
    head = stem.encode()[:room].decode(errors="ignore")
    return f"{head}~{digest}{suffix}"
