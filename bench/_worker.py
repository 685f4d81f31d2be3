"""`python -m bench._worker`: runs one repeat of one case in this fresh process (see bench.isolation).

Reads {"case", "env", "options", "verify"} as JSON on stdin; prints the row as one `MEMBENCH_ROW {json}` line on
stdout (other output of the case may precede it). Modules named in $MEMBENCH_PLUGINS are imported first, so
strategies registered outside the `strategies` package exist here too.
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def main() -> int:
    job = json.loads(sys.stdin.read())
    for module in filter(None, (m.strip() for m in os.environ.get("MEMBENCH_PLUGINS", "").split(","))):
        importlib.import_module(module)

    from bench.isolation import ROW_MARKER, RunOptions
    from bench.runner import Case, run_case

    options = RunOptions(**{**job["options"], "isolate": False, "repeats": 1})
    row = run_case(Case(**job["case"]), job["env"], options, verify_result=job["verify"])
    row["isolated"] = True
    sys.stdout.write(ROW_MARKER + json.dumps(row, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
