"""Launch settings of the gated-linear kernels (Hopper defaults; the forward state kernel swept on the H200).

The chunk-parallel kernels are the gated-delta package's (output, local dR with the commit term = dV,
grad_qk) and start from its settings; the two sequential state kernels are this package's own. BV is the
width of the V slice one program owns: the state kernels get B * H * V / BV programs. The forward one
may also split each slice's K rows over K_SPLIT programs (the recurrence is independent per K row):
1, 2, 4 fix the split (falling back to the largest that fits K: state.choose_k_split), 0 doubles it
from 1 while B * H * V / BV * split still fits in one wave of SMs (at most state.AUTO_K_SPLIT_MAX).
The forward's BV 64 with the automatic split was the fastest setting at batch 1 (16K, 64K) and 8 x 4K
in the sweep (docs/performance.md, "Gated linear (Mamba2's SSD) op"); `num_stages_split` and
`num_warps_split` are its pipeline depth and warps where the K rows are split (4 stages and 8 warps paid at
batch 1; 4 stages cost at 8 x 4K, where nothing is split).
CUMSUM is the forward's first kernel's (cumsum.py: gc and the fp32 write mask), NB * B * H / BH programs
of BH heads each: every program is short, so a narrow tile spreads the work over more of them.
`python -m benchmarks.ops --op gated_linear --sweep` overrides these dicts in place.
"""

from __future__ import annotations

from natsl.fast.gated_delta import config as _gdn

CUMSUM = {"BH": 16, "num_warps": 2}
STATE_FWD = {"BV": 64, "num_warps": 4, "num_stages": 3, "K_SPLIT": 0, "num_stages_split": 4, "num_warps_split": 8}
STATE_BWD = {"BV": 32, "num_warps": 4, "num_stages": 2}
OUTPUT = dict(_gdn.OUTPUT)
DV = dict(_gdn.LOCAL_DR)  # local_dr with the commit term
GRAD_QK = dict(_gdn.GRAD_QK)
