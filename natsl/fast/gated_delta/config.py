"""Launch settings of the gated-delta kernels (Hopper defaults).

BV is the width of the V slice one program owns. The two sequential kernels (state_fwd,
state_bwd) get B * H * V / BV programs, so BV trades parallelism against per-step work.
benchmarks/device_gated_delta.py overrides these dicts in place to compare settings in one call.
"""

from __future__ import annotations

import os

# dtype of the chunk intermediates W, U, R, dR_local, dR (the per-chunk state h is always in the
# inputs' dtype; fp32 inputs keep everything fp32):
#   "input" (default): the inputs' dtype, as flash-linear-attention does. On the H200 at the 800M
#       shapes (bf16, T=4096): output 2.9e-3, gradients <= 3.7e-3 relative RMS against an fp32
#       oracle; forward 5.6 ms and forward+backward 17.3 ms at T=128K (2026-11-30).
#   "fp32": fp32 intermediates and tf32 products. R = U - W S is a small difference (the delta
#       rule's prediction error), so this is 1.4x more precise at the 800M shapes (2.0e-3) and 3x
#       on a saturated small-K case (3.5e-3 vs 1.1e-2), but costs 1.3x in the forward and 2x in
#       forward+backward (8.4 ms / 39.1 ms at T=128K).
INTERMEDIATE = "input"

# Forward settings re-swept on the H200 on 2026-11-30 (docs/notes/fast_gated_delta.md): a third
# pipeline stage lets the sequential state kernel prefetch the next chunk's W, U and K tiles while
# it works on the current one (3.98 -> 3.30 ms at T=128K) and trims prepare (1.28 -> 1.17 ms).
# The same for the backward: grad_qk 3.77 -> 2.97 ms, grad_wy 3.34 -> 2.85 ms, local dR 0.51 -> 0.48 ms.
# 32-bit intermediates cap every kernel at two stages (common.launch_options: shared memory).
PREPARE = {"num_warps": 2, "num_stages": 3}
# BV_WIDE (state.state_slice): a 64-wide V slice where B * H * V / 64 programs still cover the SMs.
# At the training shape (B=4, H=6, V=384: 144 programs on 132 SMs) the forward recurrence took 0.296
# against 0.326 ms at BV=32 (288 programs, a second wave), outputs identical; at B=1 (72 programs,
# prefill) BV=32 stays (T=128K: 3.30 ms against 4.77 at 64). H200, 2026-11-30i call 2.
# SPLIT_LAST_ROUND (state.batch_launches): where the wide slices overfill whole rounds of PROGRAMS_PER_SM
# programs per SM (two at the 255-register cap with 4 warps) by part of a round -- B=8: 288 programs,
# 264 at a time -- the leftover batch rows run in a second launch at BV. B=8, T=4096 on the H200
# (2026-12-01b call 6, benchmarks/device_state_split.py): forward 0.435 -> 0.401 ms, backward 0.731 ->
# 0.686 ms, outputs bitwise equal.
# NATSL_STATE_SPLIT=0 turns the split off in both kernels (for side-by-side runs).
SPLIT_LAST_ROUND = os.environ.get("NATSL_STATE_SPLIT", "1") != "0"
STATE_FWD = {"BV": 32, "BV_WIDE": 64, "num_warps": 4, "num_stages": 3, "SPLIT_LAST_ROUND": SPLIT_LAST_ROUND,
             "PROGRAMS_PER_SM": 2}
OUTPUT = {"BV": 64, "num_warps": 4, "num_stages": 2}
LOCAL_DR = {"BV": 64, "num_warps": 4, "num_stages": 3}
# BV_WIDE as in the forward: at the training shapes the 64-wide slices took 0.481 against 0.538 ms
# (B=4, T=4096) and 0.729 against 0.895 ms (B=8), outputs bitwise equal (H200, 2026-11-30j calls 5-6).
# 8 warps with ONE stage (which block_size 128 forces, launch_options) hit an illegal memory access on
# the H200 with Triton 3.6 (BV 16, 32 and 64), so the backward keeps 4 warps.
STATE_BWD = {"BV": 32, "BV_WIDE": 64, "num_warps": 4, "num_stages": 2, "SPLIT_LAST_ROUND": SPLIT_LAST_ROUND,
             "PROGRAMS_PER_SM": 2}
GRAD_QK = {"BV": 32, "num_warps": 4, "num_stages": 3}
# "descriptors": the loop tiles through host-side TMA descriptors (common.token_descriptors). Offline
# (Triton 3.9, sm_90) that cuts the kernel's spill stack 1528 -> 216 B. On the H200 a first single timing
# (2026-12-01, sixteenth session) had it slower (0.211 against 0.191 ms at B=4, T=4096); timed interleaved
# against the pointer tiles (benchmarks/compare_gdn_revisions.py --variants descriptors=true, eighteenth
# session) it was faster: 0.343 against 0.371 ms at B=8 and 0.177 against 0.190 ms at B=4, T=4096, outputs
# bitwise equal (docs/results/2026-12-01h/call3). On.
GRAD_WY = {"num_warps": 4, "num_stages": 3, "descriptors": True}
DECODE = {"BV": 32, "num_warps": 4}
