"""Shared test setup."""

import torch

# Small ops on a 2-core machine run fastest on one thread (and do not fight parallel jobs).
torch.set_num_threads(1)
