"""The table of the keys each reader understands, from the readers' own declarations (`KEYS`), for
docs/from-your-config.md: `python -m bench.jobs.keys_table` rewrites the page's marked blocks, and a test fails
when the page differs from what the declarations give."""

from __future__ import annotations

import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "from-your-config.md"
_BLOCK = re.compile(r"(<!-- keys: (\w+) -->\n)(.*?)(<!-- /keys -->)", re.S)


def reader_keys() -> dict:
    """Each reader's declared keys, by the name of its block."""
    from bench.jobs import accelerate, axolotl, deepspeed, fsdp_qlora, torchtitan, torchtune, trainer_keys

    return {"trainer": trainer_keys.KEYS, "torchtune": torchtune.KEYS, "axolotl": axolotl.KEYS,
            "fsdp_qlora": fsdp_qlora.KEYS, "torchtitan": torchtitan.KEYS, "accelerate": accelerate.KEYS,
            "deepspeed": deepspeed.KEYS}


def keys_table(name: str) -> str:
    """A markdown table of reader `name`'s keys: the key, its fate, what it becomes or why."""
    lines = ["| key | fate | in the prediction |", "| --- | --- | --- |"]
    for key in reader_keys()[name]:
        lines.append(f"| `{key.name}` | {key.fate} | {key.meaning.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def regenerated(text: str) -> str:
    """`text` with every marked block replaced by its table."""
    return _BLOCK.sub(lambda m: m.group(1) + keys_table(m.group(2)) + m.group(4), text)


if __name__ == "__main__":
    PAGE.write_text(regenerated(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    sys.exit(0)
