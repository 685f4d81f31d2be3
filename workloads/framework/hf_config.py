"""What an `hf:` workload is built from: a preset's published configuration, a local config.json, or a Hub model's
config.json by its id, read and turned into a transformers configuration object with the layer count asked for
(workloads.hf).

A Hub id (`hf:Qwen/Qwen2.5-7B-Instruct`, `hf:mistralai/Mixtral-8x7B-v0.1@<revision>`) is read through
huggingface_hub's own `hf_hub_download`, the function transformers' `from_pretrained` uses, and of the repository
only `config.json`: never weights. So the user's cache (`HF_HOME`, `HF_HUB_CACHE`), token (`HF_TOKEN`, `hf auth
login`), `HF_HUB_OFFLINE` and revisions behave as they do in transformers. The file and the commit it was read
at are recorded in the row (`ConfigSource`).

A configuration whose architecture is not in transformers (its `auto_map` names the repository's own Python
classes) needs that code run; like transformers, membench refuses unless the user says `trust_remote_code=true`.

Limitations: a Hub config is read anew by each process that builds the model (predict's workers too), from the
cache once the first has fetched it; a gated or private model needs the user's token, as in transformers.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core.errors import UsageError
from workloads.framework import hf_checks
from workloads.framework.hf_presets import PRESETS

FILE_FORM = "path/to/config.json"
HUB_FORM = "org/name[@revision] (a Hugging Face Hub id)"
# huggingface_hub's repository ids: `org/name`, letters, digits, `-`, `_`, `.`; `@` then a branch, tag or commit
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?")
# transformers' Auto classes a remote-code `auto_map` may name, by membench's task
REMOTE_TASK_CLASSES = {"causal_lm": "AutoModelForCausalLM", "masked_lm": "AutoModelForMaskedLM",
                       "seq_cls": "AutoModelForSequenceClassification"}


@dataclass(frozen=True)
class ConfigSource:
    """A configuration's values and where they were read: `kind` is preset, file or hub; `file` the path read;
    `revision` the Hub commit the file belongs to; `code_location` where a remote-code architecture's Python
    classes are loaded from (the Hub id or the model folder), None when transformers has the architecture."""

    values: dict[str, Any]
    kind: str
    file: str | None = None
    revision: str | None = None
    code_location: str | None = None
    repo_id: str | None = field(default=None)

    @property
    def remote_code(self) -> bool:
        """Whether the architecture's code is the repository's own (its `auto_map`), not transformers'."""
        return self.code_location is not None

    def recorded(self) -> dict[str, str]:
        """What a results row records of the source: the file read and, for the Hub, the commit."""
        return {key: value for key, value in (("config_file", self.file), ("config_revision", self.revision))
                if value}


def is_hub_id(model: str) -> bool:
    """Whether `model` names a Hub repository (`org/name[@revision]`) rather than a file or folder on disk: the
    form of an id, not ending in `.json`, and no such path here (a local folder wins, as in transformers)."""
    if not _HUB_ID.fullmatch(model) or model.endswith(".json"):
        return False
    return not Path(model).exists() and not Path(model.split("@")[0]).exists()


def is_file_reference(model: str) -> bool:
    """Whether `model` names a config file or a model folder rather than a preset or a Hub id."""
    if is_hub_id(model):
        return False
    return model.endswith(".json") or "/" in model or "\\" in model or Path(model).is_dir()


def _read_json(path: Path, shown: str) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UsageError(f"hf: {shown!r} is not a readable JSON file: {error}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise UsageError(f"hf: {shown!r} has no 'model_type'; expected a transformers config.json")
    return values


def read_config_file(model: str) -> dict[str, Any]:
    """The dictionary of a local `config.json` (or of the one in the folder `model`); a UsageError otherwise."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"hf: configuration file {str(path)!r} does not exist; expected a preset "
                         f"({', '.join(PRESETS)}), {FILE_FORM} or {HUB_FORM}")
    return _read_json(path, str(path))


def _hub_error(repo_id: str, revision: str | None, error: Exception, hub) -> UsageError:
    """The one line that says why the Hub gave no config.json for `repo_id`, and what to do."""
    errors = hub.errors
    at = f" at revision {revision!r}" if revision else ""
    get = f"hf download {repo_id} config.json" + (f" --revision {revision}" if revision else "")
    if isinstance(error, errors.LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if hub.constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        return UsageError(f"hf: {repo_id}{at}: its config.json is not in the Hugging Face cache "
                          f"({hub.constants.HF_HUB_CACHE}) and {why}; get it where there is a network with `{get}` "
                          f"(the same HF_HOME), or give hf:{FILE_FORM}")
    if isinstance(error, errors.GatedRepoError):
        return UsageError(f"hf: {repo_id} is gated: accept its conditions on its Hub page, then log in (`hf auth "
                          "login` or HF_TOKEN) and try again")
    if isinstance(error, errors.RepositoryNotFoundError):
        return UsageError(f"hf: no model {repo_id!r} on the Hub (or it is private and no token with access was "
                          f"given: `hf auth login` or HF_TOKEN); valid forms: a preset ({', '.join(PRESETS)}), "
                          f"{FILE_FORM} or {HUB_FORM}")
    if isinstance(error, errors.RevisionNotFoundError):
        return UsageError(f"hf: {repo_id} has no revision {revision!r} (a branch, tag or commit of the repository)")
    if isinstance(error, (errors.EntryNotFoundError, errors.RemoteEntryNotFoundError)):
        return UsageError(f"hf: {repo_id}{at} has no config.json (not a transformers model repository?)")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return UsageError(f"hf: {repo_id}{at}: config.json could not be read from the Hub: {first_line}")


def read_hub_config(model: str) -> ConfigSource:
    """`config.json` of the Hub model `org/name[@revision]`, through huggingface_hub (the user's cache, token,
    offline mode and revision as in transformers); a UsageError of one line when it cannot be had."""
    repo_id, _, revision = model.partition("@")
    try:
        import huggingface_hub as hub
        from huggingface_hub import errors  # noqa: F401 - hub.errors below
    except ImportError:
        raise UsageError(f"hf:{model} needs the huggingface_hub package (installed with transformers): "
                         "pip install 'membench[hf]'") from None
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)  # its retry warnings: the one line below says what failed
    try:
        path = Path(hub.hf_hub_download(repo_id, "config.json", revision=revision or None))
    except (OSError, ValueError, hub.errors.EntryNotFoundError) as error:
        raise _hub_error(repo_id, revision or None, error, hub) from None
    finally:
        hub_logger.setLevel(level)
    values = _read_json(path, f"{repo_id}'s config.json")
    # the cache's layout is models--org--name/snapshots/<commit>/config.json (huggingface_hub's, documented)
    commit = path.parent.name if path.parent.parent.name == "snapshots" else (revision or None)
    return ConfigSource(values, "hub", str(path), commit, repo_id=repo_id)


def _remote_code_location(values: dict[str, Any], model: str, source: ConfigSource, transformers,
                          trust_remote_code: bool) -> str | None:
    """Where the repository's own classes are loaded from when transformers lacks the architecture and the config
    names its own (`auto_map`); None when transformers has it. Refused without `trust_remote_code`."""
    model_type = values.get("model_type")
    if "auto_map" not in values or not isinstance(model_type, str) or model_type in transformers.CONFIG_MAPPING:
        return None  # a model_type of the wrong type is hf_checks' to name
    auto_map = values["auto_map"]
    if not isinstance(auto_map, dict) or "AutoConfig" not in auto_map:
        return None  # no code of its own to run: transformers' own "unknown model_type" is the error
    if source.kind == "preset":
        return None
    location = source.repo_id or str(Path(source.file).parent)
    if not trust_remote_code:
        classes = ", ".join(f"{value}" for value in auto_map.values() if isinstance(value, str))
        raise UsageError(f"hf:{model}: its architecture ({values.get('model_type')!r}) is not in transformers "
                         f"{transformers.__version__}; its config names the repository's own Python code "
                         f"({classes}), which building the model would import and run from {location}: add "
                         f":trust_remote_code=true only if you trust that code")
    return location


def resolve_config(model: str, transformers=None, trust_remote_code: bool = False) -> ConfigSource:
    """The configuration `model` names (a preset, a local file or folder, a Hub id) and where it was read.
    With `transformers` given, an architecture transformers lacks is checked against `trust_remote_code`."""
    if is_hub_id(model):
        source = read_hub_config(model)
    elif is_file_reference(model):
        path = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
        source = ConfigSource(read_config_file(model), "file", str(path))
    elif model in PRESETS:
        source = ConfigSource(dict(PRESETS[model]), "preset")
    else:
        close = difflib.get_close_matches(model, PRESETS, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown hf preset {model!r}{hint}; valid choices: {', '.join(PRESETS)}, {FILE_FORM}, "
                         f"{HUB_FORM}")
    if transformers is None:
        return source
    location = _remote_code_location(source.values, model, source, transformers, trust_remote_code)
    if location is None:
        return source
    return ConfigSource(source.values, source.kind, source.file, source.revision, location, source.repo_id)


def config_values(model: str) -> dict[str, Any]:
    """The configuration dictionary `model` names: a preset's, a local config file's or a Hub model's."""
    return resolve_config(model).values


def remote_tasks(values: dict[str, Any]) -> list[str]:
    """The tasks a remote-code configuration's `auto_map` has a class for, in membench's order."""
    auto_map = values.get("auto_map", {})
    return [task for task, auto_name in REMOTE_TASK_CLASSES.items() if auto_name in auto_map]


def remote_class(source: ConfigSource, auto_name: str):
    """The repository's own class that its `auto_map` names for `auto_name` (`AutoConfig`, `AutoModelForCausalLM`),
    imported through transformers' dynamic modules (the user trusted the code: `trust_remote_code=true`)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    reference = source.values["auto_map"][auto_name]
    if isinstance(reference, (list, tuple)):  # (slow, fast) pairs are for tokenizers; a model names one class
        reference = reference[0]
    return get_class_from_dynamic_module(reference, source.code_location, revision=source.revision)


def make_config(transformers, values: dict[str, Any], layers: int, source: str = "the configuration",
                config_source: ConfigSource | None = None):
    """The transformers configuration object of `values`, with `layers` layers (0: its own) and no KV cache;
    `source` names the values in an error; a remote-code `config_source` builds it with the repository's class."""
    model_type = values["model_type"]
    if config_source is not None and config_source.remote_code:
        config_class = remote_class(config_source, "AutoConfig")
    elif model_type not in transformers.CONFIG_MAPPING:
        raise UsageError(f"hf: model_type {model_type!r} is not known to transformers {transformers.__version__}")
    else:
        config_class = transformers.CONFIG_MAPPING[model_type]
    values = {key: value for key, value in values.items() if key not in ("torch_dtype", "dtype")}
    try:
        config = config_class.from_dict(values)
    except Exception as error:  # noqa: BLE001 - transformers' own validation of a value hf_checks does not read
        raise hf_checks.config_error(source, error) from None
    if config_source is not None and config_source.remote_code:
        config._name_or_path = config_source.code_location  # where transformers' Auto classes find the code
    if layers:
        config.num_hidden_layers = layers
        if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (Qwen2, Mistral...)
            config.layer_types = config.layer_types[:layers]
    config.use_cache = False
    return config
