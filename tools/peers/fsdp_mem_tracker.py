"""PyTorch's FSDPMemTracker, run the way torchtitan's memory estimator runs it, on the model and configuration that
`python -m bench predict --ranks N --strategies fsdp[+checkpoint:segments=all]` predicts: the peer's per-rank peak
for docs/peers.md.

torchtitan's `scripts/estimate/estimation.py`: PyTorch's fake process group (`FakeStore`, backend "fake") of N ranks,
the device mesh built outside the fake mode, the model built on the meta device under FakeTensorMode, activation
checkpointing applied to each block (`checkpoint_wrapper`), `fully_shard` on each block and on the root,
`to_empty(device="cuda")`, the optimizer built after sharding, a dummy batch on the device, then
`FSDPMemTracker(mod=model, optm=optimizer)` with `track_inputs(batch)` around two training steps and
`display_snapshot("peak")`. What is membench's here, so that both run the same step:
- the model, its batch's shapes, its loss and its optimizer are membench's workload's (`get_workload(spec)`: for an
  `hf:` preset transformers' model in float32, cross-entropy on the logits, AdamW lr 5e-5, no weight decay);
- the blocks are the workload's checkpoint units (an `hf:` model's decoder layers), as membench's `fsdp` shards them
  (each unit, then the root; torchtitan also shards the embedding and the output head apart, membench does not);
- the loop is membench's, the literal `pred = model(x); loss = criterion(pred, y); loss.backward()`: the logits stay
  alive during the backward (`--del-output`: torchtitan's `del pred` before the backward); no gradient clipping
  (torchtitan clips, membench's step does not);
- with `--device cuda` (the default) it runs in membench's fake-CUDA environment (`.venv-cuda-fake/bin/python`, torch's
  CUDA build on stub CUDA libraries), under membench's `FakeCudaMode` (a FakeTensorMode that does not touch the stub
  device, `bench.measure.fake_cuda_mode`), with its placeholder scalars (a value read from a fake tensor) and the
  optimizers' foreach path on fake tensors, as membench's fake-CUDA engine runs a step. membench's own allocator
  model (`FakeAllocator`) is not entered: the tracker is the only thing counting. `--device cpu` runs the same on the
  CPU with PyTorch's plain FakeTensorMode, where the tracker does not round to CUDA's 512-byte blocks.

The peak is the tracker's (`get_tracker_snapshot("peak")`), in bytes per category, for the traced rank (`--rank`,
default 0: with `torch.tensor_split`'s batch split rank 0 holds the most samples, and with FSDP2's dim-0 chunks the
largest shards). Usage (from the repository root):

    .venv-cuda-fake/bin/python tools/peers/fsdp_mem_tracker.py --workload hf:llama-3.2-1b:seq_len=2048 \\
        --ranks 8 --batch-size 8 [--checkpoint] [--json out.json]

`--compare PREDICT_CSV` puts membench's row for the same strategy (allocated and reserved) beside the tracker's peak.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GIB = 1024 ** 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="hf:llama-3.2-1b:seq_len=2048", help="a membench workload spec")
    parser.add_argument("--ranks", type=int, default=8, help="world size of the fake process group")
    parser.add_argument("--rank", type=int, default=0, help="the rank traced (default 0: the largest share)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="the GLOBAL batch, split across the ranks as membench's --batch-size is")
    parser.add_argument("--checkpoint", action="store_true",
                        help="checkpoint every unit (torchtitan's full AC; membench's checkpoint:segments=all)")
    parser.add_argument("--del-output", action="store_true",
                        help="torchtitan's loop: `del pred` before the backward (default: membench's loop, which "
                             "keeps the output alive during the backward)")
    parser.add_argument("--steps", type=int, default=2, help="training steps under the tracker (torchtitan: 2)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--fake-mode", choices=("membench", "plain"), default="membench",
                        help="on CUDA: membench's FakeCudaMode with its placeholder scalars (default), or torch's plain "
                             "FakeTensorMode as torchtitan enters it")
    parser.add_argument("--propagation-outside", action="store_true",
                        help="a workaround, not the peer as shipped: DTensor's sharding propagation in its own fake "
                             "mode, so that the tracker skips its full-size tensors (see "
                             "propagation_in_its_own_fake_mode)")
    parser.add_argument("--verbose", action="store_true", help="the tracker's current snapshot after each stage")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    parser.add_argument("--compare", default=None, help="a `bench predict` CSV whose row for this strategy to compare")
    args = parser.parse_args(argv)
    if args.ranks < 1 or not 0 <= args.rank < args.ranks:
        parser.error(f"--rank {args.rank} must be between 0 and --ranks - 1 ({args.ranks - 1})")
    if args.batch_size < args.ranks:
        parser.error(f"--batch-size {args.batch_size} is the global batch: at least one sample per rank "
                     f"({args.ranks} ranks)")
    return args


def local_batch(global_batch: int, ranks: int, rank: int) -> int:
    """Rank `rank`'s share of the global batch, as `torch.tensor_split` (membench's `shard_batch`) splits it."""
    return global_batch // ranks + (1 if rank < global_batch % ranks else 0)


def membench_strategy(checkpoint: bool) -> str:
    """The spec of membench's strategy that runs the step this script traces (as its predict CSV names it: the
    composition `fsdp+checkpoint:segments=all` in membench's order)."""
    return "checkpoint:segments=all+fsdp" if checkpoint else "fsdp"


def predict_row(csv_path: str | Path, strategy: str) -> dict | None:
    """membench's predict row of `strategy` (train phase) in a `bench predict` CSV."""
    with open(csv_path, newline="", encoding="utf-8") as handle:
        return next((row for row in csv.DictReader(handle)
                     if row["strategy"] == strategy and row["phase"] == "train"), None)


def comparison(tracker_bytes: int, allocated: int, reserved: int | None = None) -> dict:
    """membench's predicted allocated (and reserved) peak against the tracker's: the differences in bytes and
    membench's figure as a ratio of the tracker's."""
    result = {"tracker_bytes": tracker_bytes, "membench_allocated_bytes": allocated,
              "allocated_minus_tracker_bytes": allocated - tracker_bytes,
              "allocated_over_tracker": round(allocated / tracker_bytes, 4) if tracker_bytes else None}
    if reserved is not None:
        result.update(membench_reserved_bytes=reserved, reserved_minus_tracker_bytes=reserved - tracker_bytes,
                      reserved_over_tracker=round(reserved / tracker_bytes, 4) if tracker_bytes else None)
    return result


def _fake_modes(device: str, mode: str) -> contextlib.ExitStack:
    """The fake mode the step runs under, and what it needs (see the module docstring): membench's on CUDA, or
    PyTorch's plain FakeTensorMode (torchtitan's)."""
    stack = contextlib.ExitStack()
    if device == "cuda" and mode == "membench":
        from bench.measure.fake_cuda_mode import FakeCudaMode, foreach_on_fake_tensors

        import torch
        torch.cuda.init()  # as membench's fake_cuda(): checkpoint refuses a device first initialised in its forward
        stack.enter_context(foreach_on_fake_tensors())
        stack.enter_context(FakeCudaMode())
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode

        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=device == "cpu"))
    return stack


@contextlib.contextmanager
def propagation_in_its_own_fake_mode(enabled: bool):
    """With `enabled`, DTensor's sharding propagation computes its output metadata in a fresh FakeTensorMode instead
    of the one active (`torch.distributed.tensor._sharding_prop`: `detect_fake_mode() or FakeTensorMode()`), so that
    FSDPMemTracker's guard (it tracks an op only when `active_fake_mode() is` the mode it was entered under) skips the
    propagation's global-shape tensors, as its comment says it does. Without it, under a FakeTensorMode (torchtitan's
    estimation runs the tracker inside one), every DTensor op the optimizer step makes on the sharded parameters is
    counted again at the parameters' full, unsharded size."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor import _sharding_prop

    saved = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


def track(args: argparse.Namespace) -> dict:
    """Runs the steps under FSDPMemTracker; the peak snapshot of the traced rank, per device and category."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from workloads import get_workload

    workload = get_workload(args.workload)
    samples = local_batch(args.batch_size, args.ranks, args.rank)
    inputs_cpu, target_cpu = workload.make_batch(samples, "synthetic" if "synthetic" in workload.data_sources
                                                 else workload.data_sources[0])
    gc.disable()
    gc.collect(1)
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.ranks)
    try:
        if args.device == "cuda":
            torch.cuda.set_device(0)
        mesh = DeviceMesh(args.device, list(range(args.ranks)))  # outside the fake mode, as torchtitan builds it
        with _fake_modes(args.device, args.fake_mode), propagation_in_its_own_fake_mode(args.propagation_outside):
            with torch.device("meta"):
                model = workload.build_model()
            units = workload.checkpoint_units(model)
            if args.checkpoint:  # torchtitan: apply_ac before fully_shard, each block wrapped (non-reentrant)
                wanted = {id(unit) for unit in units}
                places = [(parent, name, child) for parent in model.modules()
                          for name, child in parent.named_children() if id(child) in wanted]
                for parent, name, child in places:
                    parent.register_module(name, checkpoint_wrapper(child))
                units = [wrapper for parent, name, _ in places for wrapper in [getattr(parent, name)]]
            for unit in units:
                if any(True for _ in unit.parameters()):
                    fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.to_empty(device=args.device)
            model.train()
            optimizer = workload.make_optimizer(model)

            def on_device(value):
                """A dummy batch on the device of the workload's shapes and dtypes (torchtitan: torch.randint)."""
                if isinstance(value, dict):
                    return {k: on_device(v) for k, v in value.items()}
                if value.is_floating_point():
                    return torch.randn(value.shape, dtype=value.dtype, device=args.device)
                return torch.randint(0, 2, value.shape, dtype=value.dtype, device=args.device)

            inputs, target = on_device(inputs_cpu), on_device(target_cpu)
            tracker = FSDPMemTracker(mod=model, optm=optimizer)
            tracker.track_inputs((inputs, target))

            def show(moment: str) -> None:
                if args.verbose:
                    print(f"current, {moment}:", flush=True)
                    tracker.display_snapshot("current", units="MiB")
                    print(f"peak so far, {moment}:", flush=True)
                    tracker.display_snapshot("peak", units="MiB")
            with tracker:
                for step in range(args.steps):
                    # membench's loop: the previous output lives until this forward returns, the previous loss
                    # until this one exists (both rebound here)
                    pred = workload.run_model(model, inputs)
                    loss = workload.loss(pred, target)
                    show("after the forward and loss")
                    if args.del_output:
                        del pred
                    loss.backward()
                    show("after the backward")
                    optimizer.step()
                    show("after the optimizer step")
                    optimizer.zero_grad()
                    print(f"Peak memory at step {step}:", flush=True)
                    tracker.display_snapshot("peak", units="MiB")
                    if step == 0:
                        tracker.reset_mod_stats()  # torchtitan: step 0 has no optimizer state
                    gc.collect(1)
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
        gc.enable()
    return {str(device): {str(getattr(key, "value", key)): int(value) for key, value in snap.items()}
            for device, snap in peak.items()}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torch here sees no CUDA device: run with .venv-cuda-fake/bin/python (make cuda-fake-env), "
                         "or pass --device cpu")
    load = os.getloadavg()
    start = time.perf_counter()
    peak = track(args)
    wall = time.perf_counter() - start
    device_key = next((k for k in peak if k.startswith(args.device)), None)
    total = peak[device_key]["Total"] if device_key else 0
    result = {
        "tool": "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker", "torch": torch.__version__,
        "workload": args.workload, "ranks": args.ranks, "rank": args.rank, "global_batch": args.batch_size,
        "local_batch": local_batch(args.batch_size, args.ranks, args.rank),
        "membench_strategy": membench_strategy(args.checkpoint), "checkpoint": "every unit" if args.checkpoint else "none",
        "loop": "torchtitan (del pred before backward)" if args.del_output else "membench (output kept in backward)",
        "steps": args.steps, "device": args.device, "fake_mode": args.fake_mode if args.device == "cuda" else "plain",
        "propagation_outside": args.propagation_outside, "peak_device": device_key, "peak_bytes": total, "peak": peak,
        "wall_s": round(wall, 1), "load_average_at_start": [round(x, 2) for x in load],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
    }
    print(f"\nFSDPMemTracker peak ({device_key}, rank {args.rank} of {args.ranks}, local batch "
          f"{result['local_batch']}): {total:,} B = {total / GIB:.2f} GiB; {wall:.0f} s")
    for category, value in peak.get(device_key, {}).items():
        print(f"  {category}: {value / GIB:.3f} GiB")
    if args.compare:
        row = predict_row(args.compare, membench_strategy(args.checkpoint))
        if row is None or row.get("status") != "ok":
            print(f"membench's CSV has no ok train row for {membench_strategy(args.checkpoint)}")
        else:
            reserved = int(row["predicted_reserved_bytes"]) if row.get("predicted_reserved_bytes") else None
            result["comparison"] = comparison(total, int(row["predicted_bytes"]), reserved)
            print("membench vs tracker:", json.dumps(result["comparison"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
