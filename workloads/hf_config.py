"""What an `hf:` workload is built from: a preset's published configuration or a local config.json, read and turned
into a transformers configuration object with the layer count asked for (workloads.hf)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from bench.core.errors import UsageError
from workloads import hf_checks
from workloads.hf_presets import PRESETS

FILE_FORM = "path/to/config.json"


def is_file_reference(model: str) -> bool:
    """Whether `model` names a config file or a model folder rather than a preset."""
    return model.endswith(".json") or "/" in model or "\\" in model or Path(model).is_dir()


def read_config_file(model: str) -> dict[str, Any]:
    """The dictionary of a local `config.json` (or of the one in the folder `model`); a UsageError otherwise."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"hf: configuration file {str(path)!r} does not exist; expected a preset "
                         f"({', '.join(PRESETS)}) or {FILE_FORM}")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UsageError(f"hf: {str(path)!r} is not a readable JSON file: {error}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise UsageError(f"hf: {str(path)!r} has no 'model_type'; expected a transformers config.json")
    return values


def config_values(model: str) -> dict[str, Any]:
    """The configuration dictionary `model` names: a preset's, or a local config file's."""
    if is_file_reference(model):
        return read_config_file(model)
    if model not in PRESETS:
        close = difflib.get_close_matches(model, PRESETS, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown hf preset {model!r}{hint}; valid choices: {', '.join(PRESETS)}, {FILE_FORM}")
    return dict(PRESETS[model])


def make_config(transformers, values: dict[str, Any], layers: int, source: str = "the configuration"):
    """The transformers configuration object of `values`, with `layers` layers (0: its own) and no KV cache;
    `source` names the values in an error."""
    model_type = values["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        raise UsageError(f"hf: model_type {model_type!r} is not known to transformers {transformers.__version__}")
    values = {key: value for key, value in values.items() if key not in ("torch_dtype", "dtype")}
    try:
        config = transformers.CONFIG_MAPPING[model_type].from_dict(values)
    except Exception as error:  # noqa: BLE001 - transformers' own validation of a value hf_checks does not read
        raise hf_checks.config_error(source, error) from None
    if layers:
        config.num_hidden_layers = layers
        if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (Qwen2, Mistral...)
            config.layer_types = config.layer_types[:layers]
    config.use_cache = False
    return config
