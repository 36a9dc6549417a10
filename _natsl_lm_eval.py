"""Makes `lm_eval --model natsl` work with lm-eval releases that read no entry points for models.

lm-eval up to 0.4.13 resolves `--model NAME` only against its own registry, which it fills by
importing `lm_eval.models`. natsl declares its model in the `lm_eval.models` entry-point group (read
by the lm-eval releases that have plugin discovery); for the releases before, the installed
`natsl-lm-eval.pth` runs `install()` below when Python starts. That puts a finder on
`sys.meta_path` which waits for `lm_eval.models`; once that module has run, `natsl` is registered as
a lazy placeholder ("natsl.eval.lm_eval_adapter:NatslLM", what the entry point names) and the
finder is gone. Nothing else is imported at start: natsl loads only when lm-eval is asked for the
`natsl` model, and an interpreter that never imports lm-eval keeps one idle finder.

Standard library only, and outside the natsl package, so that starting Python never imports natsl.
"""

import sys

MODEL = "natsl"
TARGET = "natsl.eval.lm_eval_adapter:NatslLM"  # = [project.entry-points."lm_eval.models"] in pyproject.toml
WATCHED = "lm_eval.models"


def register() -> None:
    """Add `natsl` to lm-eval's model registry as a placeholder (unless a name of that kind is there)."""
    from lm_eval.api.registry import model_registry

    if MODEL not in model_registry:
        model_registry.register(MODEL, target=TARGET)


class _RegisterAfter:
    """The real loader of `lm_eval.models`, which registers natsl once the module has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # leave no trace of this wrapper
        self.loader.exec_module(module)
        try:
            register()
        except Exception as exc:  # never break lm-eval's other models over natsl's registration
            import warnings

            warnings.warn(f"natsl: could not register the `natsl` model with lm-eval: {exc!r}", stacklevel=2)


class _Finder:
    """On sys.meta_path until `lm_eval.models` is imported; finds it with the other finders."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != WATCHED:
            return None
        uninstall()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


def install() -> None:
    """Called by natsl-lm-eval.pth at start (idempotent)."""
    if WATCHED in sys.modules:  # lm-eval already imported (install() called late): register now
        register()
    elif _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


def uninstall() -> None:
    while _Finder in sys.meta_path:
        sys.meta_path.remove(_Finder)
