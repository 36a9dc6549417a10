"""What produced a result: versions, the source revision and the switches that change speed or numerics.

Benchmarks store `provenance()` next to their figures, so that a table in docs/benchmarks.md can be
traced to the code and settings that made it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# Environment switches read by natsl (and the two that change how Triton runs).
SWITCHES = ("NATSL_BACKEND", "NATSL_COMPILE_POINTWISE", "NATSL_POINTWISE_DYNAMIC", "NATSL_FUSED_INFERENCE",
            "NATSL_DECODE_ATTENTION", "NATSL_DECODE_GEMV", "NATSL_DECODE_PDL", "TRITON_INTERPRET", "TORCH_COMPILE_DISABLE")


def git_revision(root: Path | None = None) -> str | None:
    """The checked-out commit of the natsl source tree (with "+dirty" for local changes), or None."""
    root = root or Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def provenance() -> dict:
    import torch

    from natsl import __version__

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"natsl": __version__, "git": git_revision(), "torch": torch.__version__, "triton": triton_version,
            "switches": {name: os.environ[name] for name in SWITCHES if name in os.environ}}
