"""Launch settings of the gated-linear kernels (Hopper defaults, not yet swept on this op).

The chunk-parallel kernels are the gated-delta package's (output, local dR = intra-chunk dV, grad_qk)
and start from its settings; the two sequential state kernels are this package's own. BV is the
width of the V slice one program owns: the state kernels get B * H * V / BV programs. The forward one
may also split each slice's K rows over K_SPLIT programs (the recurrence is independent per K row):
1, 2, 4 fix the split (falling back to the largest that fits K: state.choose_k_split), 0 doubles it
from 1 while B * H * V / BV * split is below the SM count (at most state.AUTO_K_SPLIT_MAX).
`python -m benchmarks.ops --op gated_linear --sweep` overrides these dicts in place.
"""

from __future__ import annotations

from natsl.fast.gated_delta import config as _gdn

STATE_FWD = {"BV": 32, "num_warps": 4, "num_stages": 3, "K_SPLIT": 0}
STATE_BWD = {"BV": 32, "num_warps": 4, "num_stages": 2}
OUTPUT = dict(_gdn.OUTPUT)
LOCAL_DV = dict(_gdn.LOCAL_DR)
GRAD_QK = dict(_gdn.GRAD_QK)
