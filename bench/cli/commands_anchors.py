"""`anchors`: every published GPU measurement of bench/anchors/ predicted on fake CUDA with its GPU, the error of
each, written as an anchors table (bench.analysis.anchors). Its options are in bench/cli/commands/anchors.py, whose
run function imports this module when it runs."""

from __future__ import annotations

import time
from concurrent import futures

from bench.analysis import anchors
from bench.cli import interrupt
from bench.cli.arguments import csv_list
from bench.cli.console import status
from bench.core.errors import UsageError
from bench.core.anchors_table import ANCHORS
from bench.core.results import new_run_id, write_table
from bench.measure import fake_cuda
from bench.run.preflight import check_output_dir


def cmd_anchors(args) -> int:
    """Predicts each anchor (one fake-CUDA process each, `--jobs` at once), prints the table and the median and
    largest |error|, and writes `anchors-<run>.csv` to --out, in the anchors' order whatever order they finish in."""
    selected = anchors.load_anchors(only=csv_list(args.only) if args.only else None)
    if fake_cuda.environment_python() is None:
        raise UsageError(f"anchors predicts on fake CUDA: {fake_cuda.unavailable_reason()}")
    out = check_output_dir(args.out, "--out")
    path = out / f"anchors-{new_run_id('cuda')}.csv"
    interrupt.set_file_note(path, f"interrupted: the anchors predicted so far are in {path}",
                            "interrupted: no anchor was finished, nothing was written")
    start = time.perf_counter()
    finished: dict[int, dict] = {}
    pool = futures.ThreadPoolExecutor(max_workers=args.jobs)  # threads: each waits on its own process
    with anchors.cores_shared(args.jobs > 1):  # several processes at once have the cores
        try:
            pending = {pool.submit(anchors.anchor_row, anchor): index for index, anchor in enumerate(selected)}
            for count, done in enumerate(futures.as_completed(pending), 1):
                index = pending[done]
                finished[index] = done.result()
                status(f"[{count}/{len(selected)}] {selected[index].name} on fake CUDA ({selected[index].gpu}): "
                       f"{finished[index]['duration_s']:.0f} s")
                # after each anchor (a long run interrupted keeps what it predicted); the first write creates the file
                write_table(ANCHORS, [finished[i] for i in sorted(finished)], path, new=count == 1)
        finally:  # an interrupt starts no other anchor; the running ones' processes got the signal too
            pool.shutdown(wait=True, cancel_futures=True)
    rows = [finished[i] for i in sorted(finished)]
    elapsed = time.perf_counter() - start
    print(anchors.format_table(rows))
    print()
    print(anchors.format_summary(anchors.summary(rows)))
    print(f"\n{len(rows)} anchors in {elapsed:.0f} s ({args.jobs} at once); wrote {path}")
    return 0
