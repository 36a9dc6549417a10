"""Shared test setup."""

import os

import pytest
import torch

# Small ops on a 2-core machine run fastest on one thread (and do not fight parallel jobs). Every
# pytest-xdist worker imports this file, so the setting holds in each worker process.
torch.set_num_threads(1)

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before any
# kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Triton 3.6's interpreter turns a one-element numpy array into an index with int(), which numpy 2.4
    made an error (Triton 3.7 fixed it): every interpreted kernel test would fail, so say why once."""
    if not torch.cuda.is_available():
        try:
            import numpy
            import triton
        except ImportError:
            return
        older = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7)
        if older and tuple(int(part) for part in numpy.__version__.split(".")[:2]) >= (2, 4):
            raise pytest.UsageError(f"Triton {triton.__version__}'s CPU interpreter fails with numpy "
                                    f"{numpy.__version__}: pip install 'numpy<2.4' or 'triton>=3.7'")


@pytest.fixture(scope="session")
def natsl_cache_dir(tmp_path_factory):
    """A private cache for the embedded corpus (NATSL_CACHE_DIR), shared by every test of the run: under
    pytest-xdist the folder above the workers' own temporary folders, so the corpus is built once for all
    of them (natsl.data.builtin locks the folder while one process builds it)."""
    base = tmp_path_factory.getbasetemp()
    return str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "natsl-cache")


@pytest.fixture
def use_switches():
    """`use_switches(name=value, ...)` sets speed switches (natsl.switches.override) until the test ends;
    calls stack, the last one on top."""
    import contextlib

    from natsl import switches

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(switches.override(**changes))


@pytest.fixture(autouse=True)
def fresh_twins():
    """natsl.ops.twin remembers the functions it loads; forget them after each test, so that a test that
    patched a kernel module's function cannot leave its stand-in remembered for the tests after it."""
    yield
    import sys

    ops = sys.modules.get("natsl.ops")
    if ops is not None:
        ops._LOADED.clear()
