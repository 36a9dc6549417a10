"""natsl: NAtS-L (Neural Attention Search Linear) hybrid attention, reference and fast.

The public names are imported on first use (PEP 562), so that `import natsl` -- and the command
line, whose start-up imports it -- does not pay for torch before it needs it (the CLI installs its
Ctrl-C handling first: natsl.cli.app).
"""

__version__ = "0.1.0"

_LAZY = {"Recipe": "natsl.config", "ModelConfig": "natsl.config", "load_recipe": "natsl.config",
         "build_model": "natsl.models", "load_checkpoint": "natsl.checkpoint"}

__all__ = ["Recipe", "ModelConfig", "load_recipe", "build_model", "__version__", "load_checkpoint"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'natsl' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
