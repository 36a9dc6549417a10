"""natsl: NAtS-L (Neural Attention Search Linear) hybrid attention, reference and fast."""

__version__ = "0.1.0"

from natsl.config import Recipe, ModelConfig, load_recipe  # noqa: E402
from natsl.models import build_model  # noqa: E402

__all__ = ["Recipe", "ModelConfig", "load_recipe", "build_model", "__version__"]
from natsl.checkpoint import load_checkpoint  # noqa: E402

__all__.append("load_checkpoint")
