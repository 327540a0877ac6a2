"""orchestrator.lazy_exports: names resolve from their modules on first lookup and are kept; an unknown
name is an AttributeError naming it; dir() lists the package's names before any was looked up."""

from __future__ import annotations

import types

import pytest

from orchestrator.lazy_exports import lazy_exports


def test_names_resolve_on_first_lookup_and_are_kept() -> None:
    package = types.ModuleType("fake_lazy_package")
    package.__all__ = ["dumps"]
    package.__getattr__, package.__dir__ = lazy_exports(vars(package), {"dumps": "json"})
    assert "dumps" not in vars(package)
    assert "dumps" in dir(package)
    import json

    assert package.dumps is json.dumps
    assert vars(package)["dumps"] is json.dumps  # kept: the next lookup does not call __getattr__
    with pytest.raises(AttributeError, match="fake_lazy_package.*'loads'"):
        package.loads  # noqa: B018 - the lookup is the test
