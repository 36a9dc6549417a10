"""natsl: NAtS-L (Neural Attention Search Linear) hybrid attention, reference and fast.

The public names are imported on first use (module `__getattr__`), so that `import natsl` -- and
with it every `natsl --help` -- does not pay for torch and the models."""

from __future__ import annotations

import importlib

# YEAR.MONTH.DAY.N: the date of CHANGELOG.md's newest heading and the number of entries under it, so
# that every change (one CHANGELOG line each) moves the version; tests/test_version.py checks it, and
# pyproject.toml reads it (docs/development.md, "Versions").
__version__ = "2026.12.7.47"

# public name -> the module that defines it
_LAZY = {
    "Recipe": "natsl.config",
    "ModelConfig": "natsl.config",
    "load_recipe": "natsl.config",
    "build_model": "natsl.models",
    "load_checkpoint": "natsl.checkpoint",
}

__all__ = ["Recipe", "ModelConfig", "load_recipe", "build_model", "load_checkpoint", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'natsl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
