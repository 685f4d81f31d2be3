"""The case a trainer's configuration derives (`DerivedJob`) and the accounting of every key of that configuration.

A reader (`bench.jobs.trainer`, `torchtune`, `axolotl`, `fsdp_qlora`) declares the keys it understands as `Key`s and
reads a configuration through a `Reading`: each key it consults is marked used (with the part of the spec it
decides), ignored (with why it does not change memory) or not modelled (with what the prediction assumes instead);
a key the reader does not know is a UsageError, and `Reading.finish` refuses to end while any key of the file is
unaccounted for. Nothing is dropped silently.
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from bench.core.errors import UsageError

USED, IGNORED, NOT_MODELLED = "used", "ignored", "not modelled"
FATES = (USED, IGNORED, NOT_MODELLED)


@dataclass(frozen=True)
class Key:
    """A configuration key a reader understands: its `name` (dotted for nested keys; `*` matches any run of
    characters, for families such as `logging_*`), its `fate` when present, and `meaning`: the part of the spec it
    decides (used), why it does not change memory (ignored) or what the prediction assumes instead (not modelled)."""

    name: str
    fate: str
    meaning: str

    def matches(self, key: str) -> bool:
        return fnmatch.fnmatchcase(key, self.name) or key.startswith(self.name + ".")


@dataclass(frozen=True)
class KeyUse:
    """One key of the configuration and what became of it."""

    key: str
    value: Any
    fate: str
    detail: str

    def line(self) -> str:
        return f"{self.key}={_short(self.value)}: {self.fate}: {self.detail}"


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class DerivedJob:
    """The membench case a trainer's configuration describes, and what became of each of its keys.

    `workload` and `strategy` are the specs membench runs (`python -m bench predict --workload W --strategies S
    --batch-size B` predicts the same case); `batch_size` is one device's batch (the Trainer's
    `per_device_train_batch_size` times its accumulation steps: membench's `grad_accumulation` splits it again);
    `ranks` the processes where the configuration states them (None: one device); `keys` accounts for every key of
    the configuration; `assumptions` what the derivation assumed where the configuration says nothing."""

    kind: str
    source: str
    workload: str
    strategy: str
    batch_size: int
    phases: tuple[str, ...] = ("train",)
    ranks: int | None = None
    overrides: tuple[str, ...] = ()
    keys: list[KeyUse] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    model: str = ""  # the model as the configuration names it (a Hub id, a builder, a path)
    # why the case cannot be predicted yet (a strategy the configuration needs that membench has not registered:
    # tensor or context parallelism); empty when it can. The accounting is printed before the refusal.
    unsupported: str = ""
    # the step's batch over every rank, where the ranks do not each load their own (the ranks of a tensor- or
    # context-parallel group share their samples): `--global-batch-size`; None: batch_size x ranks
    global_batch_size: int | None = None

    @property
    def config_text(self) -> str:
        """The configuration as the row records it: its kind, file and overrides."""
        return " ".join([f"{self.kind}:{self.source}", *self.overrides])

    def command(self, command: str = "predict") -> str:
        """The `python -m bench` command line that runs this case without the configuration."""
        ranks = f" --ranks {self.ranks}" if self.ranks and self.ranks > 1 else ""
        batch = (f"--global-batch-size {self.global_batch_size}" if self.global_batch_size is not None
                 else f"--batch-size {self.batch_size}")
        return f"python -m bench {command} --workload {self.workload} --strategies {self.strategy} {batch}{ranks}"

    def by_fate(self, fate: str) -> list[KeyUse]:
        return [use for use in self.keys if use.fate == fate]

    def describe(self) -> str:
        """Several lines: the derived case as the specs it runs, then every key's fate, then the assumptions."""
        lines = [f"from {self.config_text}:", f"  {self.command()}"]
        for fate in FATES:
            uses = self.by_fate(fate)
            if not uses:
                continue
            lines.append(f"  {fate} ({len(uses)}):")
            if fate != IGNORED:
                lines.extend(f"    {use.key}={_short(use.value)}: {use.detail}" for use in uses)
                continue
            reasons: dict[str, list[str]] = {}
            for use in uses:  # the ignored keys a line per reason: the reason matters, not each path's value
                reasons.setdefault(use.detail, []).append(use.key)
            lines.extend(f"    {', '.join(keys)}: {reason}" for reason, keys in reasons.items())
        if self.assumptions:
            lines.append("  assumed where the configuration says nothing:")
            lines.extend(f"    {line}" for line in self.assumptions)
        if self.unsupported:
            lines.append(f"  {self.unsupported}")
        return "\n".join(lines)

    def with_explicit(self, workload: str | None = None, batch_size: int | None = None,
                      ranks: int | None = None) -> tuple["DerivedJob", list[str]]:
        """This job with the options a user gave beside the configuration (they win), and a line for each."""
        notes, job = [], self
        if workload:
            merged = merge_workload(workload, self.workload)
            notes.append(f"--workload {workload} overrides the configuration's model ({self.model or self.workload}): "
                         f"{merged}")
            job = replace(job, workload=merged)
        if batch_size is not None and batch_size != self.batch_size:
            notes.append(f"--batch-size {batch_size} overrides the configuration's batch per device "
                         f"({self.batch_size})")
            job = replace(job, batch_size=batch_size, strategy=_accumulation_checked(job.strategy, batch_size),
                          global_batch_size=None)
        if ranks is not None and ranks != (self.ranks or 1):
            notes.append(f"--ranks {ranks} overrides the configuration's ranks ({self.ranks or 1})")
            job = replace(job, ranks=ranks)
        return job, notes


def _accumulation_checked(strategy: str, batch_size: int) -> str:
    """`strategy`, once its grad_accumulation member's micro-batch count is checked to divide `batch_size`."""
    from strategies import STRATEGIES

    for part in strategy.split("+"):
        name, *options = part.split(":")
        if name == "grad_accumulation":
            settings = dict(option.split("=", 1) for option in options)
            micro = int(settings.get("micro_batches", STRATEGIES.get(name).options["micro_batches"]))
            if batch_size % micro:
                raise UsageError(f"--batch-size {batch_size}: the configuration accumulates {micro} micro-batches, "
                                 f"which must divide the batch; give a multiple of {micro}")
    return strategy


def workload_options(spec: str) -> tuple[str, dict[str, str]]:
    """`hf:model:seq_len=8:loss=model` -> ('hf:model', {'seq_len': '8', 'loss': 'model'}); a Windows-free path or Hub
    id with `:` is not expected."""
    head, *parts = spec.split(":")
    model_parts, options = [], {}
    for part in parts:
        name, sep, value = part.partition("=")
        if sep and name.isidentifier():
            options[name] = value
        else:
            model_parts.append(part)
    return ":".join([head, *model_parts]), options


def merge_workload(explicit: str, derived: str) -> str:
    """The user's `explicit` workload with the options the configuration derived that it does not set itself."""
    base, options = workload_options(explicit)
    _, derived_options = workload_options(derived)
    merged = {**derived_options, **options} if base.startswith("hf:") else options
    return ":".join([base, *(f"{k}={v}" for k, v in merged.items())])


class Reading:
    """A configuration being read: its keys (flattened to dotted names where `nested` sections are given), what
    became of each, and the declared `keys` of the reader that reads it."""

    def __init__(self, kind: str, values: dict[str, Any], keys: Iterable[Key], nested: Iterable[str] = ()):
        self.kind = kind
        self.keys = tuple(keys)
        self.values = flatten(values, tuple(nested))
        self.uses: dict[str, KeyUse] = {}
        self.assumptions: list[str] = []

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def declared(self, key: str) -> Key | None:
        return next((k for k in self.keys if k.matches(key)), None)

    def get(self, key: str, default: Any = None, types: tuple[type, ...] | None = None,
            choices: Iterable[Any] | None = None) -> Any:
        """The value of `key` (or `default` when absent), checked against `types` and `choices`: a UsageError
        naming the key and what is valid otherwise. Reading a key does not account for it."""
        if key not in self.values:
            return default
        value = self.values[key]
        if types is not None and not _is_instance(value, types):
            names = " or ".join(t.__name__ if t is not type(None) else "null" for t in types)
            raise UsageError(f"{self.kind} key {key}: {value!r} is not a {names}")
        if choices is not None:
            choices = list(choices)
            if value not in choices:
                raise UsageError(f"{self.kind} key {key}: unknown value {value!r}; valid choices: "
                                 f"{', '.join(str(c) for c in choices)}")
        return value

    def mark(self, key: str, fate: str, detail: str | None = None) -> None:
        """Accounts for `key` (when the configuration has it): `detail`, else its declaration's meaning."""
        if key not in self.values:
            return
        declared = self.declared(key)
        if detail is None:
            if declared is None:
                raise AssertionError(f"{self.kind}: key {key} is marked without a declaration or a detail")
            detail = declared.meaning
        self.uses[key] = KeyUse(key, self.values[key], fate, detail)

    def used(self, key: str, detail: str | None = None) -> None:
        self.mark(key, USED, detail)

    def ignored(self, key: str, detail: str | None = None) -> None:
        self.mark(key, IGNORED, detail)

    def not_modelled(self, key: str, detail: str | None = None) -> None:
        self.mark(key, NOT_MODELLED, detail)

    def assume(self, line: str) -> None:
        self.assumptions.append(line)

    def finish(self, valid: Iterable[str] = ()) -> list[KeyUse]:
        """Every key accounted for: the keys the reader marked, then each other key by its declaration (a family such
        as `logging_*`); a key neither declared nor in `valid` (the trainer's own fields) is a UsageError naming it
        and the nearest valid names; one in `valid` but not declared is not modelled, the default assumed."""
        valid = set(valid)
        for key, value in self.values.items():
            if key in self.uses:
                continue
            declared = self.declared(key)
            if declared is not None:
                self.uses[key] = KeyUse(key, value, declared.fate, declared.meaning)
            elif key in valid:
                self.uses[key] = KeyUse(key, value, NOT_MODELLED, "not read by membench: the prediction assumes "
                                                                  "the trainer's default for it")
            else:
                names = sorted(valid | {k.name for k in self.keys if "*" not in k.name})
                near = difflib.get_close_matches(key, names, n=3) or names[:8]
                raise UsageError(f"{self.kind} key {key}: not a key this configuration has; valid choices include: "
                                 f"{', '.join(near)}")
        return [self.uses[key] for key in self.values]


def _is_instance(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False  # True is an int to Python, not to a configuration
    if isinstance(value, int) and float in types and not isinstance(value, bool):
        return True
    return isinstance(value, types)


def flatten(values: dict[str, Any], nested: tuple[str, ...], prefix: str = "") -> dict[str, Any]:
    """The keys of `values`, the sections named in `nested` (and every section below them) spread into dotted
    keys: {'model': {'_component_': x}} -> {'model._component_': x} where 'model' is nested (or '*' is)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        spread = "*" in nested or name in nested or any(name.startswith(n + ".") for n in nested)
        if isinstance(value, dict) and value and spread:
            flat.update(flatten(value, nested + (name,), prefix=name + "."))
        else:
            flat[name] = value
    return flat


def spec_of(members: Iterable[str]) -> str:
    """The canonical strategy spec of `members` (composition order: membench sorts them by each one's priority)."""
    from strategies import parse_strategy

    members = [m for m in members if m]
    return parse_strategy("+".join(members)).spec() if members else "baseline"


def registered_spec(members: Iterable[str]) -> tuple[str, str]:
    """(the spec, why it cannot be predicted yet): a member whose strategy membench has not registered (tp, cp), or
    members it cannot compose, leave the spec as written and say so, rather than failing as an unknown spec."""
    from strategies import STRATEGIES

    members = [m for m in members if m]
    missing = [m.split(":")[0] for m in members if m.split(":")[0] not in STRATEGIES]
    if missing:
        return "+".join(members), (f"not predicted: the configuration needs {' and '.join(missing)}, which membench "
                                   f"has no strategy for yet ({'+'.join(members)})")
    try:
        return spec_of(members), ""
    except UsageError as error:  # members membench has, but not together (a composition it refuses)
        return "+".join(members), f"not predicted: {error}"


# Packing: how many documents share a packed row is the data's, not the configuration's; the block-causal mask's size
# does not depend on the count. Rows of seq_len tokens are assumed to hold documents of about this many tokens
# (alpaca's samples with a prompt template average about 250), at least two.
PACKED_DOCUMENT_TOKENS = 256


def packed_documents(seq_len: int) -> int:
    """The documents assumed in one packed row of `seq_len` tokens (at least 2)."""
    return max(2, seq_len // PACKED_DOCUMENT_TOKENS)


def hf_workload(model: str, seq_len: int, packed: int = 0, loss: str | None = None, attn: str | None = None,
                task: str | None = None) -> str:
    """`hf:<model>:seq_len=N[:attn=][:task=][:packed=K][:loss=]`, in the order the anchors write them."""
    options = [f"seq_len={seq_len}"]
    options += [f"attn={attn}"] if attn else []
    options += [f"task={task}"] if task else []
    options += [f"packed={packed}"] if packed else []
    options += [f"loss={loss}"] if loss else []
    return ":".join([model, *options])
