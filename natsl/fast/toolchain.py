"""Which ptxas assembles natsl's Triton kernels: PyTorch's, the one Inductor uses for its own kernels.

Triton assembles a kernel's PTX with the ptxas that TRITON_PTXAS_PATH names, else with the one it
bundles. Inductor points that variable at PyTorch's bundled ptxas (torch/bin/ptxas), but only in the
process that compiles its kernels: the training process itself with TORCHINDUCTOR_COMPILE_THREADS=1, its
pool of compile workers otherwise. Left alone, the same natsl kernel was therefore assembled by one ptxas
or the other depending on how Inductor compiled, and on the H200 (Triton 3.6) the d=64 recall models'
gated-delta backward gave non-finite gradients with one and finite ones with the other (docs/recall.md,
"Width 64"). Pinning the variable when natsl.fast is imported makes every natsl kernel come from one
ptxas in every process. A TRITON_PTXAS_PATH set by the user is kept: set it to Triton's bundled ptxas
(triton/backends/nvidia/bin/ptxas) to use that one instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping, Optional

PTXAS_ENV = "TRITON_PTXAS_PATH"


def torch_ptxas() -> Optional[str]:
    """PyTorch's bundled ptxas (CUDA wheels ship one), or None."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "bin" / "ptxas"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def pin_ptxas(environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Point TRITON_PTXAS_PATH at PyTorch's ptxas unless it is set already; the ptxas in force (None:
    Triton's own, where PyTorch ships none, as on CPU wheels)."""
    environ = os.environ if environ is None else environ
    if not environ.get(PTXAS_ENV):
        path = torch_ptxas()
        if path is not None:
            environ[PTXAS_ENV] = path
    return environ.get(PTXAS_ENV) or None
