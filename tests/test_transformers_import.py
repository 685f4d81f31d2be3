"""Importing transformers for the `hf:` workloads (workloads/framework/transformers_import.py): its models folder's
import structure is read once a process, not twice, and transformers knows the same names it knows imported alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

# the files under transformers/models opened while transformers is imported (an audit hook sees every open), and the
# names its lazy modules map to their modules
_PROBE = """
import collections, json, sys
opened = collections.Counter()
def hook(event, args):
    if event == "open" and isinstance(args[0], str) and "/transformers/models/" in args[0]:
        opened[args[0]] += 1
sys.addaudithook(hook)
if sys.argv[1] == "membench":
    from workloads.framework.transformers_import import import_transformers
    transformers = import_transformers()
else:
    import transformers
    from transformers import CONFIG_MAPPING
import transformers.models
names = {"top": sorted(transformers._class_to_module.items()),
         "models": sorted(transformers.models._class_to_module.items())}
print(json.dumps({"opened": sum(opened.values()), "files": len(opened), "names": names}))
"""


def _probe(how: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, how], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_models_import_structure_is_read_once_and_the_same():
    alone, once = _probe("plain"), _probe("membench")
    assert alone["opened"] >= 2 * alone["files"] - 50  # transformers alone reads nearly every file twice
    assert once["files"] == pytest.approx(alone["files"], abs=50)
    assert once["opened"] <= once["files"] + 50  # each once (a few opened again to be imported)
    assert once["names"] == alone["names"]
