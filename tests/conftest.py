"""Shared test setup."""

import os

import torch

# Small ops on a 2-core machine run fastest on one thread (and do not fight parallel jobs).
torch.set_num_threads(1)

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before any
# kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
