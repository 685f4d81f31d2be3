"""Reading a configuration file (YAML, JSON, or TOML as torchtitan's job files are) and applying command-line
overrides to it as `tune run` takes them.

An override is `key=value` (a dotted key reaches into a section: `optimizer.fused=False`; the value is read as YAML,
so `true`, `2`, `3e-4`, `[q_proj, v_proj]` and `null` have their types) or `~key` (the key deleted). As torchtune's
CLI does (torchtune/config/_utils.py, `_merge_yaml_and_cli_args`), `key=value` on a section that builds a component
(`optimizer=torch.optim.AdamW` where the file has `optimizer: {_component_: ...}`) sets that section's
`_component_` and keeps its other keys.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any, Iterable

import yaml

from bench.core.errors import UsageError

COMPONENT = "_component_"
_INTERPOLATION = re.compile(r"\$\{([^}]+)\}")


def shipped_config(name: str) -> Path | None:
    """A configuration torchtune ships, by the name `tune run --config` takes (`llama3_1/8B_lora_single_device`, with
    or without `.yaml`), where torchtune is installed; None otherwise."""
    import importlib.metadata

    try:
        distribution = importlib.metadata.distribution("torchtune")
    except importlib.metadata.PackageNotFoundError:
        return None
    for candidate in (name, f"{name}.yaml"):
        path = Path(distribution.locate_file(f"recipes/configs/{candidate}"))
        if path.is_file():
            return path
    return None


def load_file(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML, JSON or TOML (by its suffix) configuration file holds (a name of torchtune's shipped
    configurations where no such file exists: `llama3_1/8B_lora_single_device`); a UsageError naming the file
    otherwise."""
    path = Path(path)
    if not path.exists():
        path = shipped_config(str(path)) or path
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise UsageError(f"--config {path}: {error.strerror or error}") from None
    language = {".json": "JSON", ".toml": "TOML"}.get(path.suffix, "YAML")
    try:
        data = json.loads(text) if language == "JSON" else tomllib.loads(text) if language == "TOML" else \
            yaml.safe_load(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as error:
        raise UsageError(f"--config {path}: not valid {language}: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of keys to values, found {type(data).__name__}")
    return data


def parse_value(text: str) -> Any:
    """An override's value read as YAML (`true`, `2`, `[a, b]`), or the text itself where it is not YAML."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value):
        return float(value)  # YAML 1.1 reads 3e-4 as a string; tune run's OmegaConf reads it as a float
    return value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """`data` with each override applied in order (a copy; `data` is unchanged); a UsageError for a malformed one."""
    result = json.loads(json.dumps(data, default=str))
    for override in overrides:
        if override.startswith("~"):
            _delete(result, override[1:], override)
            continue
        key, sep, text = override.partition("=")
        if not sep or not key or key != key.strip():
            raise UsageError(f"override {override!r}: expected key=value (a dotted key for a section: "
                             "optimizer.lr=1e-4) or ~key to delete one")
        section, name = _section(result, key, override, create=True)
        value = parse_value(text)
        if isinstance(section.get(name), dict) and COMPONENT in section[name] and not isinstance(value, dict):
            section[name][COMPONENT] = value
        else:
            section[name] = value
    return result


def _section(data: dict, key: str, override: str, create: bool) -> tuple[dict, str]:
    *path, name = key.split(".")
    section = data
    for part in path:
        if not isinstance(section.get(part), dict):
            if not create or part in section:
                raise UsageError(f"override {override!r}: {part!r} is not a section of the configuration")
            section[part] = {}
        section = section[part]
    return section, name


def _delete(data: dict, key: str, override: str) -> None:
    section, name = _section(data, key, override, create=False)
    if name not in section:
        raise UsageError(f"override {override!r}: the configuration has no key {key!r} to delete")
    del section[name]


def resolve_interpolations(data: dict[str, Any]) -> dict[str, Any]:
    """`${key}` in string values replaced by the value of that top-level (or dotted) key, as OmegaConf resolves
    torchtune's `${output_dir}/logs`; an unknown reference is left as it is."""
    def lookup(dotted: str) -> Any:
        node: Any = data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def resolve(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, str):
            whole = _INTERPOLATION.fullmatch(value)
            if whole and lookup(whole.group(1)) is not None:
                return lookup(whole.group(1))
            return _INTERPOLATION.sub(lambda m: str(lookup(m.group(1)) if lookup(m.group(1)) is not None
                                                    else m.group(0)), value)
        return value

    return resolve(data)
