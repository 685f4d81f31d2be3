"""`python -m bench.run._worker`: runs one repeat of one case in this fresh process (see bench.run.isolation).

Reads {"case", "env", "options", "verify"} as JSON on stdin; prints the case's result (its row's columns and its
side data, `bench.run.result.CaseResult.to_json`) as one `MEMBENCH_ROW {json}` line on stdout (other output of the
case may precede it). Modules named in $MEMBENCH_PLUGINS are imported first, so strategies registered outside the
`strategies` package exist here too.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from bench.core.job_environment import plugin_modules


def import_plugins() -> None:
    """Imports the modules $MEMBENCH_PLUGINS names (a comma list), as the process that started this one did."""
    for module in plugin_modules():
        importlib.import_module(module)


def run_job(job: dict) -> dict:
    """One repeat of one case, as described by `job` (see the module docstring); returns its result as JSON values.

    Also the body of a Ray task (bench.run.ray_executor). `job["workload_files"]` maps the path of a user's workload
    file, as the spec names it, to its source, for a process that does not have the file (another machine)."""
    # imported here, after the plugins: a plugin registers strategies that the case's spec may name
    import_plugins()

    from bench.run.isolation import RunOptions
    from bench.run.case import Case
    from bench.run.runner import measure_case
    from workloads.framework.loader import ship_file

    for path, source in (job.get("workload_files") or {}).items():
        ship_file(path, source)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one rank of a sharded case (bench.run.ranks)
        from bench.run.ranks import join_process_group

        join_process_group(job["case"]["device"])
    options = RunOptions(**{**job["options"], "isolate": False, "repeats": 1})
    if options.memory_fraction is not None and job["case"]["device"] == "cuda":
        import torch

        torch.cuda.set_per_process_memory_fraction(options.memory_fraction)
    result = measure_case(Case(**job["case"]), job["env"], options, verify_result=job["verify"])
    result.row["isolated"] = True
    return result.to_json()


def main() -> int:
    from bench.core import processes, progress
    from bench.run.isolation import ROW_MARKER, STAGE_MARKER

    processes.stop_on_signals()  # SIGTERM from a parent that stops early: the case's cleanup (rank processes) runs

    stages: list[str] = []

    def stage(what: str, done: int, total: int) -> None:
        """Each stage once, on stderr: the parent names it in the row of a case it had to kill (--case-timeout)."""
        if not stages or stages[-1] != what:
            stages.append(what)
            sys.stderr.write(f"{STAGE_MARKER}{what}\n")
            sys.stderr.flush()

    try:
        with progress.listening(stage):
            result = run_job(json.loads(sys.stdin.read()))
    except KeyboardInterrupt as stopped:  # 130 for Ctrl-C (the parent stops too), 143 for SIGTERM, 129 for SIGHUP
        return processes.exit_status(stopped)
    sys.stdout.write(ROW_MARKER + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
