"""A Hugging Face Hub cache made in a test's folder, in the layout huggingface_hub writes, so that `hf:org/name`
loads offline (`HF_HUB_OFFLINE=1`) from it and nothing reaches the network.

The layout (huggingface_hub's documented cache: https://huggingface.co/docs/huggingface_hub/guides/manage-cache):
`<cache>/models--org--name/blobs/<sha256>` holds each file's bytes, `snapshots/<commit>/<file>` links to its blob,
`refs/<branch>` holds the commit a branch points at.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_model(cache: Path, repo_id: str, files: dict[str, str | dict], commit: str = COMMIT,
              branch: str = "main") -> Path:
    """Writes `files` (name -> text, or a dict written as JSON) of `repo_id` at `commit`, with `branch` pointing at
    it; returns the snapshot's folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        text = json.dumps(content, indent=2) if isinstance(content, dict) else content
        data = text.encode("utf-8")
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot


def offline_environment(home: Path) -> dict[str, str]:
    """The environment of a process that reads the Hub only from the cache under `home` (HF_HOME)."""
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("HF_") and key != "HUGGINGFACE_HUB_CACHE"}
    environment.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    return environment
