"""The `hf:` workload of a model as a configuration names it: a Hub id, a local model folder or config.json, or a
membench preset."""

from __future__ import annotations

from pathlib import Path

from bench.core.errors import UsageError


def model_workload(name: str, key: str) -> str:
    """The workload spec (without options) of `name`, the value of configuration key `key`: a folder holding a
    config.json or a .json file -> `hf:<that file>`; a membench preset (`llama-3.1-8b`) -> `hf:<preset>`; otherwise a
    Hub id (`meta-llama/Llama-3.1-8B`, `org/name@revision`) -> `hf:<id>`, whose config.json membench reads from the
    Hub cache (workloads.framework.hf_config). A UsageError for an empty name or one with `:` (a workload option
    separator)."""
    if not isinstance(name, str) or not name.strip():
        raise UsageError(f"{key}: expected a model id (org/name), a model folder or a config.json path, got "
                         f"{name!r}")
    name = name.strip()
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return f"hf:{path / 'config.json'}"
    if name.endswith(".json"):
        return f"hf:{path}"
    if ":" in name:
        raise UsageError(f"{key}: {name!r} has a ':', which separates a workload's options; give the Hub id "
                         "(org/name) or a path")
    return f"hf:{name}"  # a preset's name (PRESETS) or a Hub id: workloads.framework.hf_config tells them apart
