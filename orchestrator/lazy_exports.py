"""Package names imported from their modules on first use (PEP 562), so that a process needing one module
of a package does not import the rest (the model process: orchestrator/engine and orchestrator/api).

Knows nothing of the packages that use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any], homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of a package whose `namespace` (its `globals()`) names in `homes`
    (name -> the module that defines it) are imported on first lookup, then kept in `namespace`.

    Raises (the returned `__getattr__`):
        AttributeError: a name `homes` does not have.
    """

    def package_getattr(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value  # later lookups find it without this function
        return value

    def package_dir() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return package_getattr, package_dir
