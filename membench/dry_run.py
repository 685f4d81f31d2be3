"""`membench.dry_run(trainer, gpu=...)`: a constructed Hugging Face Trainer (or TRL SFTTrainer) predicted before it
trains: its model's configuration, its arguments, its peft and quantisation settings and the longest batch its
data would give, judged against a GPU; where it does not fit, the cheapest change in the Trainer's own terms.

Example:
    >>> trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)  # doctest: +SKIP
    >>> print(membench.dry_run(trainer, gpu="RTX 4090"))  # doctest: +SKIP
    Trainer's step on RTX 4090: does not fit (judged 31,204.0 MiB of 23,552.0) ...
      cheapest change that fits: activation_checkpointing=True (judged 17,112.4 MiB, est. 2,315.0 ms a step)

Limitations: the batch is the longest `per_device_train_batch_size` examples of `trainer.train_dataset` put
through `trainer.data_collator` (an iterable dataset: its first examples, said); its rows run full length, without
an attention mask over padding (the shape padding gives, not what padding masks). The changes tried are the
Trainer's own memory levers (`activation_checkpointing`, a smaller `per_device_train_batch_size` with more
`gradient_accumulation_steps`, an 8-bit AdamW), singly, then in pairs, then all three; the model and the data are
not changed. Nothing full-size is allocated: every candidate is predicted on fake tensors, as `plan` predicts.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from bench.analysis import plan as planning
from bench.core.units import MiB
from bench.jobs import DerivedJob, job_from_trainer_objects
from bench.jobs.job import workload_options
from membench import _engine
from membench.workload import InputError

# the longest examples the dry run looks for in a dataset with no length column it can read at once
ITERABLE_EXAMPLES = 1000
LIGHT_STATE_OPTIMS = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_torch_8bit", "adamw_torch_4bit",
                    "paged_adamw_32bit", "adafactor", "lion_8bit", "paged_lion_8bit")


@dataclass(frozen=True)
class TrainerChange:
    """One change of the Trainer's arguments: `text` in the Trainer's terms, `fields` the TrainingArguments values,
    `keeps_result` whether training computes the same thing (up to floating point) after it."""

    text: str
    fields: dict[str, Any]
    keeps_result: bool


@dataclass
class DryRun:
    """A dry run's answer: the Trainer's `job` (the membench case its settings describe, at its longest batch),
    its plan row `current` (predicted and judged memory, estimated step time, `fits`), and where it does not fit
    the `change` that makes it fit (None: it fits, or nothing tried fits) with its row; `tried` is every
    candidate's (change, row); `batch_shape` the longest batch's (rows, tokens); `notes` what was assumed."""

    job: DerivedJob
    target: str
    current: dict
    batch_shape: tuple[int, int]
    change: list[TrainerChange] | None = None
    change_row: dict | None = None
    tried: list[tuple[list[TrainerChange], dict]] = field(default_factory=list, repr=False)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether the Trainer's step as it is fits the target."""
        return bool(self.current.get("fits"))

    @property
    def change_text(self) -> str | None:
        """The suggested change as the Trainer's arguments, e.g. `gradient_checkpointing=True`; None when none."""
        return ", ".join(c.text for c in self.change) if self.change else None

    def __str__(self) -> str:
        def judged(row: dict) -> str:
            if row.get("judged_bytes") is None:
                return f"{row.get('status')}: {row.get('message')}"
            time = row.get("est_step_time_ms")
            return (f"judged {row['judged_bytes'] / MiB:,.1f} MiB of {row['limit_bytes'] / MiB:,.1f}"
                    + (f", est. {time:,.1f} ms a step" if time is not None else ""))

        rows, tokens = self.batch_shape
        lines = [f"{self.job.kind} step on {self.target}, longest batch {rows} x {tokens} tokens: "
                 f"{'fits' if self.fits else 'does not fit'} ({judged(self.current)})",
                 f"  as membench runs it: {self.job.command()}"]
        if not self.fits:
            if self.change:
                changes_result = [] if all(c.keeps_result for c in self.change) else [
                    " (changes the training result: an 8-bit optimizer state)"]
                lines.append(f"  cheapest change that fits: {self.change_text} ({judged(self.change_row)})"
                             + "".join(changes_result))
            else:
                lines.append(f"  no change tried fits ({len(self.tried)} tried: "
                             + "; ".join(", ".join(c.text for c in change) for change, _ in self.tried) + ")")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


# --- what the Trainer holds -----------------------------------------------------------------------------------

def _unwrapped(model):
    """The transformers model under peft's wrapper (its `config` is the base model's)."""
    return getattr(model, "get_base_model", lambda: model)()


def trainer_objects(trainer) -> tuple[Any, Any, Any, Any]:
    """(args, peft_config, quantization_config, model_config) of a constructed Trainer."""
    model = trainer.model
    peft_configs = getattr(model, "peft_config", None)
    peft_config = None
    if isinstance(peft_configs, dict) and peft_configs:
        peft_config = peft_configs.get(getattr(model, "active_adapter", "default")) or next(iter(peft_configs.values()))
    model_config = getattr(_unwrapped(model), "config", None)
    if model_config is None:
        raise InputError("trainer: its model has no transformers `config`; a dry run reads the model from it "
                         "(use membench.estimate with a build function for another model)")
    quantization_config = getattr(model_config, "quantization_config", None)
    return trainer.args, peft_config, quantization_config, model_config


def _length(example: Any) -> int:
    ids = example.get("input_ids") if isinstance(example, dict) else None
    if ids is None:
        raise InputError("trainer: its train_dataset's examples have no `input_ids`; a dry run takes the longest "
                         "batch from them")
    return len(ids)


def longest_batch(trainer) -> tuple[tuple[int, int], list[str]]:
    """(rows, tokens) of the batch the Trainer's collator makes of its dataset's longest examples, one device's
    `per_device_train_batch_size` of them; and notes."""
    dataset, rows = trainer.train_dataset, trainer.args.per_device_train_batch_size
    if dataset is None:
        raise InputError("trainer: it has no train_dataset; a dry run takes the longest batch from it")
    notes = []
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        column = dataset["input_ids"] if hasattr(dataset, "column_names") else None
        lengths = [len(ids) for ids in column] if column is not None else [_length(dataset[i]) for i in
                                                                           range(len(dataset))]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:rows]
        examples = [dataset[i] for i in order]
    else:
        examples = sorted(itertools.islice(iter(dataset), ITERABLE_EXAMPLES), key=_length, reverse=True)[:rows]
        notes.append(f"an iterable dataset: the longest of its first {ITERABLE_EXAMPLES} examples")
    if not examples:
        raise InputError("trainer: its train_dataset is empty")
    batch = trainer.data_collator(examples)
    ids = batch["input_ids"]
    if len(examples) < rows:
        notes.append(f"the dataset has {len(examples)} examples, fewer than per_device_train_batch_size ({rows})")
    return (int(ids.shape[0]), int(ids.shape[1])), notes


# --- the changes ----------------------------------------------------------------------------------------------

def trainer_changes(args) -> list[TrainerChange]:
    """The Trainer's own memory levers that `args` does not already pull."""
    changes = []
    # transformers 5 renamed the argument activation_checkpointing (gradient_checkpointing is its deprecated alias,
    # which dataclasses.replace does not carry over): the name the installed Trainer reads
    name = "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    if not getattr(args, name, False) and not getattr(args, "gradient_checkpointing", False):
        changes.append(TrainerChange(f"{name}=True", {name: True}, True))
    rows, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    factor = 2
    while rows % factor == 0 and rows // factor >= 1:
        changes.append(TrainerChange(f"per_device_train_batch_size={rows // factor} with gradient_accumulation_steps="
                                     f"{steps * factor}", {"per_device_train_batch_size": rows // factor,
                                                           "gradient_accumulation_steps": steps * factor}, True))
        factor *= 2
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in LIGHT_STATE_OPTIMS:
        changes.append(TrainerChange('optim="adamw_8bit"', {"optim": "adamw_8bit"}, False))
    return changes


def change_tiers(changes: list[TrainerChange]) -> list[list[list[TrainerChange]]]:
    """The combinations of `changes` by how many they combine: singles, then pairs, then triples; never two batch
    splits together."""
    split = [c for c in changes if "per_device_train_batch_size" in c.fields]
    others = [c for c in changes if c not in split]
    tiers = [[[c] for c in changes]]
    for size in (2, 3):
        tier = [list(group) for group in itertools.combinations(others, size)]
        tier += [[s, *group] for s in split for group in itertools.combinations(others, size - 1)]
        if tier:
            tiers.append(tier)
    return tiers


# --- the dry run ----------------------------------------------------------------------------------------------

def _job_at(objects: tuple, batch_shape: tuple[int, int], fields: dict[str, Any]) -> DerivedJob:
    """The membench case of the Trainer with `fields` changed in its arguments, at its longest batch's length."""
    args, peft_config, quantization_config, model_config = objects
    changed = dataclasses.replace(args, **fields) if fields else args
    job = job_from_trainer_objects(changed, peft_config, quantization_config, model_config)
    rows, tokens = batch_shape
    base, options = workload_options(job.workload)
    workload = ":".join([base, *(f"{k}={v}" for k, v in {**options, "seq_len": tokens}.items())])
    batch = min(rows, changed.per_device_train_batch_size) * changed.gradient_accumulation_steps
    return dataclasses.replace(job, workload=workload, batch_size=batch)


def dry_run(trainer, gpu: str | None = None, *, budget: int | str | None = None, headroom: float = 0.0,
            progress: Callable[[str], None] = lambda text: None) -> DryRun:
    """The Trainer's step predicted for `gpu` (a name of `python -m bench plan --list-gpus`), or on this CPU
    against `budget` bytes (exact), from what the constructed `trainer` holds; where it does not fit, the
    cheapest change of its arguments that does: the fastest (by plan's step-time estimate) among the fewest
    changes that fit, those that keep the training result before an 8-bit optimizer. See the module's docstring.

    Example: `print(membench.dry_run(trainer, gpu="RTX 4090"))`; `.fits`, `.change_text`."""
    from membench.planning import size_bytes

    if (gpu is None) == (budget is None):
        raise InputError("dry_run: give gpu= (a GPU's name) or budget= (bytes on this CPU), one of them")
    limit = None if budget is None else size_bytes(budget, "budget")
    objects = trainer_objects(trainer)
    batch_shape, notes = longest_batch(trainer)
    job = _job_at(objects, batch_shape, {})
    request = _engine.plan_request(job.workload, "synthetic", job.batch_size, gpu, limit, headroom)
    (current,), note = _engine.evaluate_candidates([(request, job.strategy, 1)])
    result = DryRun(job, request.target, current, batch_shape, notes=notes + ([note] if note else []))
    if current.get("fits") or current.get("status") != "ok":
        return result
    for tier in change_tiers(trainer_changes(objects[0])):
        progress(f"dry run: {len(tier)} changes of {len(tier[0])} of the Trainer's arguments to predict")
        jobs = [_job_at(objects, batch_shape, {k: v for c in combo for k, v in c.fields.items()}) for combo in tier]
        rows, _ = _engine.evaluate_candidates([(dataclasses.replace(request, workload=j.workload,
                                                                    batch_size=j.batch_size), j.strategy, len(combo))
                                               for combo, j in zip(tier, jobs)])
        result.tried += list(zip(tier, rows))
        for keeping in (True, False):  # a change that keeps the training result first
            pool = [row for combo, row in zip(tier, rows) if all(c.keeps_result for c in combo) == keeping]
            answer = planning.decide(pool, allow_different=True)
            if answer is not None:
                result.change = next(combo for combo, row in zip(tier, rows) if row is answer)
                result.change_row = answer
                return result
    return result
