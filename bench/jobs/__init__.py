"""Reading the training configuration a user already wrote (Trainer/TRL arguments, torchtune recipes, axolotl YAML,
fsdp_qlora's train.py arguments, torchtitan's TOML job files, accelerate's FSDP and DeepSpeed plugin YAML, DeepSpeed's
JSON) as the membench case it describes: `derive_job(...)` -> `DerivedJob` (workload and strategy specs, batch, every
key accounted for).

    >>> job = derive_job("recipes/configs/llama3_1/8B_lora_single_device.yaml", ["batch_size=4"])  # doctest: +SKIP
    >>> job.workload, job.strategy, job.batch_size  # doctest: +SKIP

Which reader reads a file: `kind=` when given (KINDS), else the file's keys: a `model` section with a `_component_` is
torchtune's, one with a `flavor` (or a `parallelism` section) torchtitan's, `distributed_type` (or `fsdp_config`
without `base_model`) accelerate's, `zero_optimization` DeepSpeed's, `base_model` axolotl's, `train_type` or
`context_length` fsdp_qlora's train.py arguments, anything else the Trainer's (TRL's where a key only SFTConfig or
TRL's ModelConfig has is present). Python objects (TrainingArguments, SFTConfig, peft's LoraConfig, transformers'
BitsAndBytesConfig and PretrainedConfig) are read by `job_from_trainer_objects`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any, Iterable

from bench.core.errors import UsageError
from bench.jobs.files import apply_overrides, load_file
from bench.jobs.job import DerivedJob, KeyUse

KINDS = ("trainer", "trl", "torchtune", "axolotl", "fsdp_qlora", "torchtitan", "accelerate", "deepspeed")

__all__ = ["DerivedJob", "KeyUse", "KINDS", "derive_job", "job_from_trainer_objects", "kind_of_file"]


def kind_of_file(values: dict[str, Any]) -> str:
    """Which trainer a configuration mapping is for (see the module's docstring)."""
    from bench.jobs.trainer import kind_of

    if isinstance(values.get("model"), dict) and "_component_" in values["model"]:
        return "torchtune"
    if (isinstance(values.get("model"), dict) and "flavor" in values["model"]) or isinstance(
            values.get("parallelism"), dict):
        return "torchtitan"
    axolotl = "base_model" in values or "base_model_config" in values
    if "distributed_type" in values or ("fsdp_config" in values and not axolotl):  # axolotl's has an fsdp_config too
        return "accelerate"
    if isinstance(values.get("zero_optimization"), dict) or "train_micro_batch_size_per_gpu" in values:
        return "deepspeed"  # DeepSpeed's own JSON (bench/jobs/deepspeed.py)
    if axolotl:
        return "axolotl"
    if "train_type" in values or "context_length" in values:
        return "fsdp_qlora"
    return kind_of(values)


def derive_job(config: str | Path | dict | Any, overrides: Iterable[str] = (), *, kind: str | None = None,
               model: str | None = None, peft_config: Any = None, quantization_config: Any = None,
               model_config: Any = None, max_length: int | None = None, ranks: int | None = None,
               workload: str | None = None) -> DerivedJob:
    """The DerivedJob of `config`: a configuration file's path (YAML or JSON), a mapping, or a TrainingArguments or
    SFTConfig object (then `peft_config`, `quantization_config` and `model_config` may hold the objects beside it);
    `overrides` as `tune run` takes them (`key=value`, `~key`); `model`: the workload's model where the
    configuration's is not to be used (a preset such as `llama-3.1-8b`, a config.json path, `hf:...`); `max_length`:
    the sequence length where a Trainer object has none (the longest row of its data); `ranks`: the processes the job
    is launched on, where the command states them (torchtitan's shard degree -1 takes the ranks left over);
    `workload`: the training script's model and sequence where the configuration has none (accelerate's).
    A UsageError, one line naming the key and what is valid, for anything the readers refuse."""
    overrides = tuple(overrides)
    if kind is not None and kind not in KINDS:
        raise UsageError(f"unknown configuration kind {kind!r}; valid choices: {', '.join(KINDS)}")
    if not isinstance(config, (str, Path, dict)):
        if overrides:
            raise UsageError("overrides apply to a configuration file; change the object's fields instead")
        return job_from_trainer_objects(config, peft_config, quantization_config, model_config, model=model,
                                        max_length=max_length)
    if isinstance(config, dict):
        values, source = apply_overrides(config, overrides), "<mapping>"
    else:
        values, source = apply_overrides(load_file(config), overrides), str(config)
    if peft_config is not None or quantization_config is not None:
        values = {**values, **_beside(peft_config, quantization_config)}
    if model is None and model_config is not None:
        model = config_file_of(model_config)
    kind = kind or kind_of_file(values)
    if kind == "torchtitan":
        from bench.jobs.torchtitan import read_torchtitan

        job = read_torchtitan(values, source, overrides, ranks=ranks)
        if model:
            job, _ = job.with_explicit(workload=_hf(model))
        return job
    if kind == "accelerate":
        from bench.jobs.accelerate import read_accelerate

        return read_accelerate(values, source, overrides, workload=_hf(model) or workload)
    if kind == "deepspeed":
        from bench.jobs.deepspeed import read_deepspeed

        return read_deepspeed(values, source, overrides, workload=_hf(model) or workload)
    if kind == "torchtune":
        from bench.jobs.torchtune import read_torchtune

        job = read_torchtune(values, source, overrides)
        if model:
            job, _ = job.with_explicit(workload=model if model.startswith("hf:") else f"hf:{model}")
        return job
    if kind == "axolotl":
        from bench.jobs.axolotl import read_axolotl

        return read_axolotl(values, source, overrides, model=_hf(model))
    if kind == "fsdp_qlora":
        from bench.jobs.fsdp_qlora import read_fsdp_qlora

        return read_fsdp_qlora(values, source, overrides, model=_hf(model))
    from bench.jobs.trainer import read_trainer

    return read_trainer(values, source, overrides, kind=kind, model=_hf(model))


def _hf(model: str | None) -> str | None:
    return None if model is None else model if model.startswith("hf:") else f"hf:{model}"


def object_values(obj: Any) -> dict[str, Any]:
    """The fields of a configuration object (a dataclass such as TrainingArguments, or an object with `to_dict`)
    whose values differ from the class's defaults: what the user set."""
    if dataclasses.is_dataclass(obj):
        values = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            value = value.value if isinstance(value, enum.Enum) else value
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            default = default.value if isinstance(default, enum.Enum) else default
            if value != default:
                values[f.name] = _plain(value)
        return values
    if hasattr(obj, "to_dict"):
        return {k: _plain(v) for k, v in obj.to_dict().items()}
    raise UsageError(f"config: a {type(obj).__name__}; valid: a file path, a mapping, or a TrainingArguments/SFTConfig "
                     "object")


def _plain(value: Any) -> Any:
    """A value as a configuration file would hold it: enums by value, dtypes by name, sets as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value).removeprefix("torch.")
    if isinstance(value, (set, tuple)):
        return sorted(value) if isinstance(value, set) else list(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _beside(peft_config: Any, quantization_config: Any) -> dict[str, Any]:
    values = {}
    if peft_config is not None:
        lora = object_values(peft_config) if not isinstance(peft_config, dict) else dict(peft_config)
        values["lora"] = {k: v for k, v in lora.items() if v is not None and k not in ("peft_type",)} or {"r": 8}
    if quantization_config is not None:
        quantization = (object_values(quantization_config) if not isinstance(quantization_config, dict)
                        else dict(quantization_config))
        values["quantization"] = {k: v for k, v in quantization.items() if v is not None}
    return values


def config_file_of(model_config: Any) -> str:
    """A config.json of a transformers PretrainedConfig object (or a mapping of its values), written once into the
    temporary folder by its content's hash, for the `hf:` workload to read."""
    values = model_config if isinstance(model_config, dict) else model_config.to_dict()
    text = json.dumps(values, sort_keys=True, default=str)
    folder = Path(tempfile.gettempdir()) / "membench-model-configs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        path.write_text(text)
    return str(path)


def job_from_trainer_objects(args: Any, peft_config: Any = None, quantization_config: Any = None,
                             model_config: Any = None, model: str | None = None,
                             max_length: int | None = None) -> DerivedJob:
    """The DerivedJob of a Trainer's objects: TrainingArguments or SFTConfig `args`, peft's LoraConfig, transformers'
    BitsAndBytesConfig, and the model's PretrainedConfig (or `model`, a workload model name) — what a dry run of a
    constructed Trainer reads (its `args`, its model's `config`, `peft_config`, `quantization_config`); `max_length`:
    the tokens of the longest row (a dry run's collated batch), where `args` has no max_length of its own."""
    from bench.jobs.trainer import read_trainer
    from bench.jobs.trainer_keys import KIND_TRAINER, KIND_TRL

    values = object_values(args)
    values.update(_beside(peft_config, quantization_config))
    if max_length is not None:
        values["max_length"] = max_length
    if model is None and model_config is not None:
        model = config_file_of(model_config)
        dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
        if dtype is not None and "dtype" not in values:
            values["dtype"] = _plain(dtype)
    kind = KIND_TRL if type(args).__name__ == "SFTConfig" else KIND_TRAINER
    return read_trainer(values, f"{type(args).__name__} object", (), kind=kind, model=_hf(model))
