"""NAtS-L on a plain DeltaNet state (`natsl_state: delta`, the authors' `natsl_attn_delta`): the GDN state
without its gate, g = 0.

The layer is natsl.models.natsl_layer.NAtSL with these projections in place of GatedDeltaProjections: the
same q, k, v (conv + SiLU, H heads of K and V, cut into the softmax heads as before), q and k
L2-normalised per head, beta = sigmoid(W_b x); there is no decay projection W_a and no A_log or dt_bias,
and the log decay is 0 everywhere. The state is written by the delta rule
S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T under the same block write mask and commit,
which is `gated_delta_rule` with g = 0 (the GDN ops and kernels of every backend run it unchanged;
a skipped block's Gamma_b = exp(0) = 1 leaves the state as it was). A decode token steps the state
with the GDN token step at g = 0 (`token_step`), not through the fused GDN decode kernel, which
computes g from A_log itself.
"""

from __future__ import annotations

import torch

from natsl.models.gated_deltanet import GatedDeltaProjections
from natsl.reference.precision import up


class DeltaProjections(GatedDeltaProjections):
    """A NAtS-L layer's projections with a DeltaNet state: GatedDeltaProjections without the decay."""

    gate_names = ("b_proj",)
    merge_groups = {"qkvab": ("q_proj", "k_proj", "v_proj", "b_proj")}  # see natsl.models.merged
    decays = False  # no A_log, dt_bias: the state never decays
    fused_decode = False  # decode steps through `token_step` (g = 0)

    def gates(self, b: torch.Tensor):
        """The b projection [B, T, H] -> log decay g = 0 [B, T, H] (fp32) and write strength beta = sigmoid(b)
        (b's dtype), as GDN's gates compute beta."""
        g = torch.zeros(b.shape, dtype=torch.float32, device=b.device)
        return g, torch.sigmoid(up(b)).to(b.dtype)
