"""A Hugging Face `TrainerCallback` that measures each training step's peak memory and breakdown (membench.measure
around the Trainer's own loop) and writes them as rows of membench's results table, which `python -m bench report
--html` draws. Needs the `hf` extra (transformers)."""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

from workloads.hf import import_transformers

TrainerCallback = import_transformers().TrainerCallback  # torchvision's stand-in operators first, where needed

from bench.core.results import RESULTS, Role, Status, new_run_id, now_iso, write_rows  # noqa: E402
from bench.measure.env import environment  # noqa: E402
from membench.measuring import Measurement, StepMemory  # noqa: E402


class MembenchCallback(TrainerCallback):
    """Measures every optimizer step of a `transformers.Trainer` run (from `on_step_begin` to `on_step_end`: the
    forward, loss, backward, clipping, optimizer step and zero_grad of one step) with `membench.measure`: the exact
    live tensor bytes on the CPU, CUDA's max_memory_allocated and reserved on a GPU, with the breakdown by category
    (the tensors the Trainer hands the model, its collated batch, filed as the batch).
    At the end of training (and after each step with `write_each_step`) the steps are written to
    `results_dir/<run id>.csv`, one row per step in membench's results table (`strategy` = `trainer:stepN`,
    `workload` = `workload` or the model's name), so that `python -m bench report --results DIR --html` draws the
    run. `snapshot_dir`: a memory snapshot per step as well. `steps` holds the StepMemory of each step.

    Example:
        >>> from transformers import Trainer, TrainingArguments
        >>> callback = MembenchCallback("results/finetune")                                  # doctest: +SKIP
        >>> Trainer(model, TrainingArguments("out", max_steps=2), train_dataset=data,
        ...         callbacks=[callback]).train()                                            # doctest: +SKIP
        >>> callback.steps[-1].peak_bytes, callback.path                                     # doctest: +SKIP
    """

    def __init__(self, results_dir: str | Path = "results", workload: str | None = None,
                 snapshot_dir: str | Path | None = None, write_each_step: bool = False):
        self.results_dir = Path(results_dir)
        self.workload = workload
        self.snapshot_dir = snapshot_dir
        self.write_each_step = write_each_step
        self.measurement: Measurement | None = None
        self.run_id: str | None = None
        self.path: Path | None = None
        self._written: Path | None = None  # the file this callback created (its next writes rewrite it)
        self.batch_size: int | None = None
        self._started: float | None = None
        self._hook = None

    @property
    def steps(self) -> list[StepMemory]:
        return [] if self.measurement is None else self.measurement.steps

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper: the torch optimizer inside
        name = self.workload or getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
        self.workload = name
        self.batch_size = args.per_device_train_batch_size * max(1, args.gradient_accumulation_steps)
        self.measurement = Measurement(model, optimizer, snapshot_dir=self.snapshot_dir, name=name).start()
        self._hook = model.register_forward_pre_hook(self._inputs_are_the_batch, with_kwargs=True)
        self.run_id = new_run_id(self.measurement.device)
        self.path = self.results_dir / f"{self.run_id}.csv"

    def _inputs_are_the_batch(self, module, args, kwargs):
        """The tensors the Trainer hands the model in a step (input_ids, labels, ...: its collated batch, made by
        its data loader inside the loop) are filed as the batch, as membench's loop files its batch; 0-d tensors
        (the Trainer's `num_items_in_batch`) are not."""
        if self.measurement is not None and self.measurement.in_step:
            self.measurement.track_batch((args, kwargs))

    def on_step_begin(self, args, state, control, **kwargs):
        if self.measurement is not None:
            self._started = time.perf_counter()
            self.measurement.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        if self.measurement is None or not self.measurement.in_step:
            return
        step = self.measurement.step_end()
        step.time_ms = (time.perf_counter() - self._started) * 1000 if self._started else None
        if self.write_each_step:
            self.write()

    def on_train_end(self, args, state, control, **kwargs):
        if self.measurement is not None:
            self._hook.remove()
            self.measurement.stop()
            self.write()

    def rows(self) -> list[dict[str, Any]]:
        """The steps as rows of membench's results table."""
        device = self.measurement.device if self.measurement else "cpu"
        env = environment(device)
        rows = []
        for step in self.steps:
            time_ms = step.time_ms
            row = {name: None for name in RESULTS.names}
            row.update(env)
            row.update(schema_version=RESULTS.version, run_id=self.run_id, timestamp=now_iso(),
                       workload=self.workload, strategy=f"trainer:step{step.index + 1}",
                       strategy_role=Role.TECHNIQUE.value if step.index else Role.BASELINE.value,
                       phase="train", device=device, batch_size=self.batch_size, data="trainer", warmup_steps=0,
                       measured_steps=1, step_time_ms_median=time_ms, step_time_ms_min=time_ms,
                       samples_per_s=(self.batch_size / time_ms * 1000) if time_ms else None,
                       memory_method=f"{device}_live_tensor_bytes" if device == "cpu" else "cuda_max_memory_allocated",
                       status=Status.OK.value, message="measured in a transformers Trainer run (membench.hf)",
                       host_name=platform.node(), **step.columns())
            rows.append(row)
        return rows

    def write(self) -> Path | None:
        """Writes the steps so far to `path` (atomically); None before the first step."""
        if self.path is None or not self.steps:
            return None
        self.results_dir.mkdir(parents=True, exist_ok=True)
        # the first write creates the file, never over another run's of the same id; later ones rewrite our own
        write_rows(self.rows(), self.path, new=self.path != self._written)
        self._written = self.path
        return self.path


__all__ = ["MembenchCallback"]
