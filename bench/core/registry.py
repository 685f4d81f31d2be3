"""A name -> class registry filled by a decorator (the timm pattern), and the discovery of a package's plug-in
modules, which fill it when imported; a duplicate name is an error."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import Generic, Iterator, TypeVar

from bench.core.errors import choices_error

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to registered classes; `kind` names the thing in error messages ("strategy", "workload")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, cls: T) -> T:
        """Class decorator: registers `cls` under `cls.name`; raises if that name is taken."""
        name = getattr(cls, "name", None)
        if not name:
            raise ValueError(f"{cls!r} has no `name` to register it under")
        if name in self._items:
            raise ValueError(f"duplicate {self.kind} name {name!r}: already registered by {self._items[name]!r}")
        self._items[name] = cls
        return cls

    def get(self, name: str) -> T:
        """The class registered as `name`, or a UsageError listing the valid names."""
        try:
            return self._items[name]
        except KeyError:
            raise choices_error(self.kind, name, self.names()) from None

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def unregister(self, name: str) -> None:
        """Removes `name` (for tests that register throw-away classes)."""
        self._items.pop(name, None)


# The subpackage of a plug-in package (strategies/, workloads/) that holds the plug-ins' framework and helpers, so that
# the package's folder lists plug-ins only; discovery leaves it out (the package's __init__ imports what it needs).
FRAMEWORK = "framework"


def import_modules_of(package: str) -> list[str]:
    """Imports every plug-in module of the package named `package` (each module file and subpackage in the folders of
    its `__path__`, in name order; those named `_private` and its `framework` subpackage left out) and returns their
    names: importing a plug-in module registers what it defines, so a new module in the folder needs no list to be
    added to."""
    found = pkgutil.iter_modules(sys.modules[package].__path__, prefix=f"{package}.")
    names = sorted(info.name for info in found
                   if not info.name.rpartition(".")[2].startswith("_") and info.name != f"{package}.{FRAMEWORK}")
    for name in names:
        importlib.import_module(name)
    return names
