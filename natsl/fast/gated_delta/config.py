"""Launch settings of the gated-delta kernels (Hopper defaults).

BV is the width of the V slice one program owns. The two sequential kernels (state_fwd,
state_bwd) get B * H * V / BV programs, so BV trades parallelism against per-step work.
`python -m benchmarks.ops --op gated_delta --sweep` overrides these dicts in place to compare settings in one call.
"""

from __future__ import annotations

from natsl import switches

# dtype of the chunk intermediates W, U, R, dR_local, dR (the per-chunk state h is always in the
# inputs' dtype; fp32 inputs keep everything fp32):
#   "input" (default): the inputs' dtype, as flash-linear-attention does; within the bf16
#       tolerance at the 800M shapes (docs/kernels/gated_delta.md).
#   "fp32": fp32 intermediates and tf32 products. R = U - W S is a small difference (the delta
#       rule's prediction error), so this is more precise, above all on a saturated small-K case,
#       but the wider tiles make the forward and above all the state backward slower.
INTERMEDIATE = "input"

# Settings from sweeps on the H200 (docs/kernels/gated_delta.md): a third pipeline stage lets the
# sequential state kernel prefetch the next chunk's W, U and K tiles while it works on the current
# one; prepare, grad_qk, grad_wy and local dR gain from it too.
# 32-bit intermediates cap every kernel at two stages (common.launch_options: shared memory).
PREPARE = {"num_warps": 2, "num_stages": 3}
# BV_WIDE (state.state_slice): a 64-wide V slice where B * H * V / 64 programs still cover the SMs.
# At the training shape (B=4, H=6, V=384: 144 programs on 132 SMs) one wave of wide programs beats
# BV=32's second wave (288 programs), outputs identical; at B=1 (72 programs, prefill) BV=32 keeps
# more of the SMs busy.
# SPLIT_LAST_ROUND (state.batch_launches): where the wide slices overfill whole rounds of PROGRAMS_PER_SM
# programs per SM (two at the 255-register cap with 4 warps) by part of a round -- B=8: 288 programs,
# 264 at a time -- the leftover batch rows run in a second launch at BV, so the second round is not
# one mostly empty wave of slow wide programs; outputs bitwise equal.
# The switch state_split (NATSL_STATE_SPLIT=0, natsl.switches) turns the split off in both kernels (for
# side-by-side runs); read here, once, when the launch tables are built.
SPLIT_LAST_ROUND = switches.current().state_split
STATE_FWD = {"BV": 32, "BV_WIDE": 64, "num_warps": 4, "num_stages": 3, "SPLIT_LAST_ROUND": SPLIT_LAST_ROUND,
             "PROGRAMS_PER_SM": 2}
OUTPUT = {"BV": 64, "num_warps": 4, "num_stages": 2}
LOCAL_DR = {"BV": 64, "num_warps": 4, "num_stages": 3}
# BV_WIDE as in the forward (the same rule wins at both training micro-batches), outputs bitwise equal.
# 8 warps with ONE stage (which block_size 128 forces, launch_options) hit an illegal memory access on
# the H200 with Triton 3.6 (BV 16, 32 and 64), so the backward keeps 4 warps.
STATE_BWD = {"BV": 32, "BV_WIDE": 64, "num_warps": 4, "num_stages": 2, "SPLIT_LAST_ROUND": SPLIT_LAST_ROUND,
             "PROGRAMS_PER_SM": 2}
GRAD_QK = {"BV": 32, "num_warps": 4, "num_stages": 3}
# "descriptors": the loop tiles through host-side TMA descriptors (common.token_descriptors). Offline
# (Triton 3.9, sm_90) that cuts the kernel's spill stack about sevenfold, and timed interleaved against the
# pointer tiles (benchmarks/compare_gdn_revisions.py --variants descriptors=true) it is faster, outputs
# bitwise equal. On; tensors a descriptor cannot take keep the pointer tiles.
GRAD_WY = {"num_warps": 4, "num_stages": 3, "descriptors": True}
DECODE = {"BV": 32, "num_warps": 4}
