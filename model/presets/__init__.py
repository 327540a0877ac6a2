"""Named model configurations shipped as JSON beside this file (official `inference/config.json` format).

`v41-flash` is the released DeepSeek-V4.1-Flash inference config, unchanged; `v41-tiny` is the 12-layer
conformance config of V41_SPEC.md §10.1. Both are copies of shared/conformance/<name>/config.json.
"""

from __future__ import annotations

from importlib import resources

from model.config import ModelConfig

__all__ = ["PRESET_NAMES", "load_preset", "preset_path"]

PRESET_NAMES: tuple[str, ...] = ("v41-flash", "v41-tiny")


def preset_path(name: str) -> str:
    """Filesystem path of a preset's JSON file.

    Raises:
        ValueError: `name` is not one of PRESET_NAMES.
    """
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown model preset {name!r}; known: {list(PRESET_NAMES)}")
    return str(resources.files(__name__).joinpath(f"{name}.json"))


def load_preset(name: str) -> ModelConfig:
    """The preset's config.

    Raises:
        ValueError: `name` is not one of PRESET_NAMES.
    """
    return ModelConfig.from_json(preset_path(name))
