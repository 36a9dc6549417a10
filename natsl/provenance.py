"""What produced a result: versions, the source revision, every speed switch (natsl.switches) and the
environment variables that change how natsl runs.

Benchmarks store `provenance()` next to their figures, so that a number in docs/performance.md can be
traced to the code and settings that made it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from natsl import switches

# Variables that change how natsl runs but are not its speed switches (natsl/switches.py says why):
# recorded where set, beside every speed switch. The last four say how a process compiled and shared the
# GPU (a sweep's workers set OMP_NUM_THREADS=1 and, under --mps, the daemon's pipe; natsl.fast pins the ptxas).
ENVIRONMENT = ("NATSL_BACKEND", "NATSL_PEAK_FLOPS", "NATSL_CHECK_OPS", "NATSL_GPU_BLOCK_SIZES", "TRITON_INTERPRET", "TORCH_COMPILE_DISABLE",
               "TORCHINDUCTOR_COMPILE_THREADS", "OMP_NUM_THREADS", "CUDA_MPS_PIPE_DIRECTORY", "TRITON_PTXAS_PATH")
# NATSL_ variables that change neither speed nor numerics (where files go; the crash tests' hook).
NOT_SWITCHES = ("NATSL_CACHE_DIR", "NATSL_DEBUG_DIR", "NATSL_FAULT")

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


def source_hash(root: Path | None = None) -> str:
    """sha256 (first 16 hex digits) of the natsl package's Python sources: their paths and bytes.

    Names the code that ran where the git revision cannot: a working tree copied to a GPU machine
    may carry a .git older than its files (results would then record a commit older than the code). `python -c "from natsl.provenance import source_hash; print(source_hash())"`
    at a local commit gives the value to match."""
    package = root or Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def provenance() -> dict:
    import torch

    from natsl import __version__

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"natsl": __version__, "git": git_revision(), "source_sha256": source_hash(), "torch": torch.__version__,
            "triton": triton_version,
            "switches": switches.as_dict(),
            "environment": {name: os.environ[name] for name in ENVIRONMENT if name in os.environ}}
