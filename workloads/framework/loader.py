"""From a workload spec to a Workload: registered names with options, the user's files and modules, entry points.

Accepted wherever a workload is named (command line, suite files):
- `captcha_resnet18`, `deep_mlp:layers=100:width=10`, `timm:resnet18`, `hf:llama-3.2-1b:layers=2`,
  `hf:path/to/config.json` (a registered name, its options, and the bare value of its `positional_option`);
- `path/to/file.py:NAME[:opt=value...]` and `package.module:NAME[:opt=value...]`, where NAME is a Workload
  subclass or a function that returns one (a subclass or an instance);
- names that installed packages register through the entry point group `membench.workloads`.
Every failure is a UsageError of one line that names the bad part.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import tempfile
import warnings
from pathlib import Path

from bench.core.errors import UsageError, WorkloadCodeError, choices_error
from bench.core.options import parse_option_parts
from workloads.framework.base import WORKLOADS, Workload

ENTRY_POINT_GROUP = "membench.workloads"
USER_FORMS = "path/to/file.py:NAME or package.module:NAME"


@functools.lru_cache(maxsize=1)
def load_entry_points() -> tuple[str, ...]:
    """Registers the workloads of installed packages (entry point group `membench.workloads`); returns their names.

    A broken entry point is a warning, not a failure: one bad plug-in must not stop every run."""
    names = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in WORKLOADS:
            continue
        try:
            cls = entry.load()
            if not (inspect.isclass(cls) and issubclass(cls, Workload)):
                raise TypeError(f"{entry.value} is not a Workload subclass")
            if cls.name != entry.name:
                cls = type(cls.__name__, (cls,), {"name": entry.name, "__module__": cls.__module__})
            WORKLOADS.register(cls)
            names.append(entry.name)
        except Exception as error:  # noqa: BLE001 - a plug-in's own bug
            warnings.warn(f"membench: entry point {entry.name!r} ({entry.value}) not loaded: {error}", stacklevel=2)
    return tuple(names)


def _is_reference(head: str) -> bool:
    return head.endswith(".py") or "/" in head or "\\" in head or "." in head


_shipped: dict[str, Path] = {}  # a workload file's path as specs name it -> where its shipped source was written


def ship_file(path: str, source: str) -> None:
    """Makes the workload file `path` resolve to `source` in this process, which does not have the file (a
    worker on another machine of a Ray cluster)."""
    if path in _shipped:
        return
    folder = Path(tempfile.mkdtemp(prefix="membench-workload-"))
    copy = folder / Path(path).name
    copy.write_text(source, encoding="utf-8")
    _shipped[path] = copy


def file_reference(spec: str) -> str | None:
    """The file path of a `path/file.py:NAME` workload spec, else None."""
    head = str(spec).strip().split(":")[0]
    return head if head.lower().endswith(".py") else None


@functools.lru_cache(maxsize=None)
def _import_file(path: str):
    file = _shipped.get(path, Path(path))
    if not file.is_file():
        raise UsageError(f"workload file {path!r} does not exist")
    module_name = f"membench_user_{file.stem}_{hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise UsageError(f"workload file {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise UsageError(f"workload file {path!r} failed to import: {type(error).__name__}: {error}") from None
    return module


def _import_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise UsageError(f"workload module {name!r} not found ({error}); expected {USER_FORMS}") from None
    except Exception as error:
        raise UsageError(f"workload module {name!r} failed to import: {type(error).__name__}: {error}") from None


def _user_class(source: str, attribute: str) -> type[Workload] | Workload:
    module = _import_file(source) if source.endswith(".py") else _import_module(source)
    if not hasattr(module, attribute):
        raise UsageError(f"{source!r} has no {attribute!r}; expected a Workload subclass or a function returning one")
    obj = getattr(module, attribute)
    if inspect.isclass(obj):
        if not issubclass(obj, Workload):
            raise UsageError(f"{source}:{attribute} is a class but not a subclass of workloads.Workload")
        return obj
    if callable(obj):
        made = _users_code(f"{source}:{attribute}()", obj)
        if isinstance(made, Workload) or (inspect.isclass(made) and issubclass(made, Workload)):
            return made
        raise UsageError(f"{source}:{attribute}() returned {type(made).__name__}, not a workloads.Workload")
    raise UsageError(f"{source}:{attribute} is a {type(obj).__name__}, not a Workload subclass or a function")


def _users_code(what: str, function, *args, **kwargs):
    """`function(*args, **kwargs)`, code of the user's workload (a factory, `__init__`, `configure`): what it raises
    (or a sys.exit in it) is a one-line UsageError naming the workload and the error, not a traceback."""
    try:
        return function(*args, **kwargs)
    except UsageError:
        raise
    except SystemExit as error:
        raise WorkloadCodeError(f"workload {what!r}: its code called sys.exit({error.code!r}) while building the "
                         "workload") from None
    except Exception as error:  # noqa: BLE001 - the user's own bug, named in one line
        detail = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
        raise WorkloadCodeError(f"workload {what!r} failed while building the workload: {detail}") from None


def _instantiate(made: type[Workload] | Workload, reference: str, parts: list[str], text: str) -> Workload:
    cls = made if inspect.isclass(made) else type(made)
    owner = reference or cls.name
    options = parse_option_parts("workload", owner, parts, cls.options, text)
    if inspect.isclass(made):
        workload = _users_code(text, made, **options) if reference else made(**options)
    else:
        workload = made
        if options:
            workload.settings = {**workload.settings, **options}
            _users_code(text, workload.configure)
    workload.reference = reference
    return workload


def resolve_workload(text: str) -> Workload:
    """The Workload a spec names, with its options applied; a UsageError of one line otherwise."""
    text = str(text).strip()
    load_entry_points()
    head, *parts = text.split(":")
    if head in WORKLOADS:
        cls = WORKLOADS.get(head)
        if parts and cls.positional_option and "=" not in parts[0]:
            parts[0] = f"{cls.positional_option}={parts[0]}"
        return _instantiate(cls, "", parts, text)
    if head.lower().endswith(".py") or (_is_reference(head) and parts and "=" not in parts[0]):
        if not parts or not parts[0] or "=" in parts[0]:
            raise UsageError(f"workload {text!r} names no object; expected {USER_FORMS}")
        reference = f"{head}:{parts[0]}"
        return _instantiate(_user_class(head, parts[0]), reference, parts[1:], text)
    raise choices_error("workload", head, [*WORKLOADS.names(), USER_FORMS])
