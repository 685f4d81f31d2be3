"""Checks of an `hf:` configuration before any model is built: the values membench reads (their types and ranges,
named in one line rather than in transformers' traceback) and the size of the model they describe.

A config.json is a file the user was handed; a string where a number belongs, `1e400` (JSON's infinity), a list or
a negative layer count must be refused naming the field, the value and what is valid. A configuration whose
weights alone would need more than `bench.core.units.MAX_SIZE_BYTES` is refused before the first case, with the
figure: its parameters are counted on the meta device (no memory) at one and two layers and extrapolated.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from bench.core.errors import UsageError
from bench.core.units import MAX_SIZE_BYTES, format_size
from workloads.framework.hf_moe import EXPERT_COUNT_KEYS

# The integer sizes membench reads from a configuration, or that size the model it builds (transformers' names;
# a model type's own spelling, gpt2's `n_layer`, is mapped through its config class's `attribute_map`). None is
# valid where transformers takes it as "derive it" (num_key_value_heads, intermediate_size, head_dim).
POSITIVE_INTEGERS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings", "num_labels")
OPTIONAL_POSITIVE_INTEGERS = ("num_key_value_heads", "intermediate_size", "head_dim", "num_experts_per_tok",
                              "moe_intermediate_size")
# No real model has a dimension near this; above it the int64 products of the shapes overflow soon
LARGEST_DIMENSION = 2**31 - 1


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _described(value: Any) -> str:
    shown = "1e400 (infinity)" if value == float("inf") else repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def check_values(values: dict[str, Any], source: str, transformers) -> None:
    """A UsageError naming the first field of `values` (a config's dictionary) whose type or range is wrong."""
    model_type = values.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(f"hf: {source}: model_type = {_described(model_type)} is not valid; expected the name of a "
                         "transformers model type, e.g. \"llama\"")
    config_class = transformers.CONFIG_MAPPING[model_type] if model_type in transformers.CONFIG_MAPPING else None
    aliases = {raw: name for name, raw in getattr(config_class, "attribute_map", {}).items()}
    for key, value in values.items():
        name = aliases.get(key, key)
        if name not in POSITIVE_INTEGERS and name not in OPTIONAL_POSITIVE_INTEGERS:
            continue
        if value is None and name in OPTIONAL_POSITIVE_INTEGERS:
            continue
        if not _is_integer(value) or not 1 <= value <= LARGEST_DIMENSION:
            spelled = key if key == name else f"{key} ({name})"
            kind = type(value).__name__
            raise UsageError(f"hf: {source}: {spelled} = {_described(value)} ({kind}) is not valid; expected an "
                             f"integer from 1 to {LARGEST_DIMENSION:,}" +
                             (" or null" if name in OPTIONAL_POSITIVE_INTEGERS else ""))
    experts_key = next((key for key in EXPERT_COUNT_KEYS if _is_integer(values.get(key))), None)
    per_token = values.get("num_experts_per_tok")
    if experts_key is not None and _is_integer(per_token) and per_token > values[experts_key]:
        raise UsageError(f"hf: {source}: num_experts_per_tok = {per_token} with {experts_key} = "
                         f"{values[experts_key]} is not valid; expected each token routed to 1 to "
                         f"{experts_key} experts")


def config_error(source: str, error: Exception) -> UsageError:
    """What transformers' own refusal of a configuration says, in one line naming the file."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return UsageError(f"hf: {source}: transformers refuses this configuration: {type(error).__name__}: "
                      f"{' '.join(lines[:2])}"[:600])


_COUNTED: dict[tuple[str, str, int], int] = {}  # (config, task, layers) -> parameters


def _parameters_at(key: str, task: str, layers: int, build) -> int:
    if (key, task, layers) not in _COUNTED:
        with torch.device("meta"):
            model = build(layers)
        _COUNTED[key, task, layers] = sum(parameter.numel() for parameter in model.parameters())
    return _COUNTED[key, task, layers]


def parameter_count(values: dict[str, Any], task: str, layers: int, build) -> int:
    """The parameters of the model `values` describes for `task` at `layers` layers, counted on the meta device at
    one and two layers (`build(layers)` makes the model) and extrapolated: one layer's parameters times the layers,
    plus the rest (embeddings, head)."""
    key = json.dumps(values, sort_keys=True, default=str)
    one, two = _parameters_at(key, task, 1, build), _parameters_at(key, task, 2, build)
    return one + (layers - 1) * (two - one)


def check_size(values: dict[str, Any], task: str, layers: int, source: str, build) -> int | None:
    """The model's float32 parameter bytes (None where it cannot be built on meta); a UsageError with the figure where they exceed MAX_SIZE_BYTES."""
    try:
        count = parameter_count(values, task, layers, build)
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: no estimate (its case says why)
        return None
    weights = 4 * count
    if weights > MAX_SIZE_BYTES:
        shape = ", ".join(f"{key}={values[key]:,}" for key in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                               "intermediate_size") if _is_integer(values.get(key)))
        raise UsageError(f"hf: {source}: this configuration describes {count:.3g} parameters, {format_size(weights)} "
                         f"of float32 weights alone (counted on the meta device), more than membench's limit of "
                         f"{format_size(MAX_SIZE_BYTES)}; check its sizes ({shape})")
    return weights
