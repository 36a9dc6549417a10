"""Incremental inference of the NAtS-L layer (docs/spec.md section 4), beside its cache
(natsl/models/cache.py holds the layout; docs/inference.md the walk-through).

`NAtSL.forward(x, cache=NAtSLCache)` lands in `CachedNAtSL.forward_cached`: a call with many tokens
(prefill) runs the ops block-aligned from the cached states, a call with one token per sequence
(decode) steps the state and attends over the compacted softmax memory; when a block completes, the
router decides on its mean and the state and memory are committed. Both leave the cache as the other
would. The methods are a mixin of the layer (natsl/models/natsl_layer.py): they read its parameters
(`proj`, `router`, the norms) and its shared pieces (`softmax_views`, `mix`, `route_override`).
"""

from __future__ import annotations

import functools

import torch

from natsl import ops
from natsl.models import overlap
from natsl.models.cache import real_tokens
from natsl.models.merged import product_and_last
from natsl.models.rope import decode_frequencies
from natsl.ops import kernel_set
from natsl.ops.block_end import decode_slots
from natsl.ops.cached import attend_cached, commit_state, masked_attention, read_state
from natsl.reference.router import budget_keep, route_means


class CachedNAtSL:
    """The cached prefill and decode paths of `natsl.models.natsl_layer.NAtSL`."""

    def decide_routes(self, block_sums: torch.Tensor, count: int, block_index: torch.Tensor, cache=None):
        """Sums of x over complete blocks [B, N, d], their token count and absolute indices [B|1, N]
        (consecutive per row) -> keep, write [B, N, H] (0/1): the router on the block mean (with the
        layer's keep bias, if any) by `natsl.reference.router.route_means`, the rule of every path; the
        mean is the fp32 sum cast to the router's dtype, then divided (the full forward's `block_mean`
        sums in x's dtype).

        With `router_keep_budget` the route is `budget_keep` over the blocks before them, read from
        `cache` (a NAtSLCache: the gaps in `keep_gaps`, the kept count in `kept_len`, which the caller
        moves after this), and their gaps are recorded there at their block index. The decode block
        end routes every row, also rows in mid-block: such a row records into its own block's slot,
        which its block end overwrites, and no route reads a slot at or after its own block."""
        xbar = block_sums.to(self.router.weight.dtype) / count
        budget = None
        if self.config.router_keep_budget is not None:
            budget = functools.partial(self._budget_route, block_index=block_index, cache=cache)
        keep = route_means(xbar, self.router.weight, self.num_heads, self.router_keep_bias,
                           override=self.route_override, block_index=block_index.expand(xbar.shape[0], -1),
                           budget=budget)[0].to(xbar.dtype)
        return keep, 1 - keep

    def _budget_route(self, gaps: torch.Tensor, block_index: torch.Tensor, cache) -> torch.Tensor:
        """`decide_routes`' keep budget: gaps [B, N, H] -> keep [B, N, H] by `budget_keep` after the
        earlier blocks of `cache`, whose `keep_gaps` then record these gaps at their block index."""
        c = self.config
        hard = budget_keep(gaps, c.router_keep_budget, block_index[:, 0], cache.keep_gaps,
                           cache.kept_len // c.block_size, c.router_keep_budget_sink)
        slots = block_index.expand(gaps.shape[0], -1)[:, None, :].expand(-1, gaps.shape[2], -1)
        cache.keep_gaps.scatter_(2, slots, gaps.transpose(1, 2))
        return hard

    def forward_cached(self, x: torch.Tensor, cache) -> torch.Tensor:
        """Tokens that follow those in `cache` (a NAtSLCache): decode when positions.start is None;
        every step on the call's kernel set (natsl.ops.kernel_set)."""
        kernels = kernel_set.pick(self.backend, x.device, cache.state_run.dtype)
        projected, gate = product_and_last(self, "qkvabg", x)  # one product where merged (natsl.models.merged)
        if cache.positions.start is None:
            q, k, v, *raw_gates = self.proj.decode_conv(x, cache.conv, kernels, projected)  # tails shifted in place
            o_la, o_nla = self._decode(x, q, k, v, cache, raw_gates, kernels)
        else:
            q, k, v, g, beta, tails = self.proj(x, cache.conv, kernels, positions=cache.positions, projected=projected)
            cache.store_conv(tails)
            o_la, o_nla = self._prefill(x, q, k, v, g, beta, cache, cache.positions.start, kernels)
        o_la = self.proj.skip(o_la, v.view(o_la.shape))
        return self.mix(o_la, o_nla, q, x, gate)

    def _decode(self, x, q, k, v, cache, raw_gates, kernels):
        """One token per sequence, each at its own position; no host reads (CUDA-graph safe).
        `raw_gates`: the gate projections of the token."""
        c = self.config
        C = c.block_size
        pos = cache.positions.pos  # [B]: this token's position

        # GDN branch: step the running state; without intra-block output read the committed one.
        if c.intra_block_output != "softmax" and self.proj.fused_decode:
            # As a GDN or Mamba2 layer's decode: L2 norms, the gates and the step (one kernel on the fused
            # set), the state in place.
            o_run, g_token = self.proj.decode_step(q, k, v, raw_gates, cache.state_run, kernels)
            o_la = o_run[:, None]
        else:
            g, beta = self.proj.gates(*raw_gates)
            ql, kl, vl = self.proj.split_heads(q, k, v, kernels)
            o_run, run = self.proj.token_step(cache.state_run, ql[:, 0], kl[:, 0], vl[:, 0], g[:, 0], beta[:, 0])
            cache.state_run.copy_(run)
            g_token = g[:, 0]
            if c.intra_block_output != "softmax":
                o_la = o_run[:, None]
            else:
                cache.decay_sum.add_(g_token)  # read now: the committed state decayed to this token
                g_token = None
                o_la = (cache.decay_sum.exp()[:, None, :, None]
                        * read_state(cache.state_start, ql, scale=self.proj.scale)).to(x.dtype)

        # Softmax branch: the token's K/V go after its group's kept blocks and its block's earlier tokens.
        # "gdn" intra-block output: the own block is GDN-only, the query reads the kept blocks alone
        slots, visible = decode_slots(cache.kept_len, pos, self.groups, C, c.intra_block_output != "gdn")
        # the q/k norms, RoPE and the K/V write: one kernel on the fused set (as softmax_views, then write_kv)
        qs, ks, vs = self.softmax_heads_of(q, k, v)
        inv_freq = decode_frequencies(c.softmax_k_dim, c.rope_theta, x.device) if c.natsl_rope else None
        qs = kernels.rope_write_kv(qs[:, 0], ks[:, 0], vs[:, 0], pos, inv_freq, cache.k_mem, cache.v_mem, slots,
                                   (self.q_norm, self.k_norm))[:, None]
        n = cache.positions.natsl_read
        o_nla = attend_cached(qs, cache.k_mem[:, :, :n], cache.v_mem[:, :, :n], visible, backend=self.backend)

        # Block end (where the token's offset is C-1): route on the block mean, commit the state, keep
        # or drop the KV; first the token's decay joins its block's sum (unless read above).
        kernels.close_block(cache, x[:, 0], pos, self.router.weight, self.route_override, self.decide_routes, C,
                            c.decay_skipped_blocks, g_token, router_bias=self.router_keep_bias)
        return o_la, o_nla

    def _prefill(self, x, q, k, v, g, beta, cache, start: int, kernels):
        """T tokens for sequences that all stand at `start`, in up to three block-aligned pieces:
        `head` finishes the block in progress, `full` whole blocks, `tail` starts the next one."""
        c = self.config
        C = c.block_size
        B, T = x.shape[:2]
        n = start % C
        head = min(T, C - n) if n else 0
        full = (T - head) // C
        tail = T - head - full * C
        if cache.positions.partial_last and tail == 0 and full:
            # a padded call (CausalLM.prefill_padded) whose last block ends in pads: that block is
            # the prompt's unfinished one, run as a tail (its pads have zero gates: drop_pad_gates)
            full, tail = full - 1, C
        closes_head = n > 0 and n + head == C

        # Routes of the blocks this call completes (relative block 0 is the one holding token 0).
        acc = cache.x_sum.dtype
        sums = []
        if closes_head:
            sums.append((cache.x_sum + x[:, :head].sum(1, dtype=acc))[:, None])
        if full:
            # sum(dtype=) reads x once; x.to(acc) first wrote an fp32 copy (0.8 GB at 128K)
            sums.append(x[:, head:head + full * C].view(B, full, C, -1).sum(2, dtype=acc))
        completed = int(closes_head) + full
        keep = write = None
        if completed:
            index = torch.arange(start // C, start // C + completed, device=x.device)[None]
            keep, write = self.decide_routes(torch.cat(sums, 1), C, index, cache)

        # GDN branch, on a second stream beside the softmax branch for long calls (inference/overlap.py).
        side = overlap.side_stream(x, T)
        with overlap.running_on(side):
            o_la, s_start, s_run, decay = self._prefill_gdn(x, q, k, v, g, beta, cache, head, full, tail,
                                                            closes_head, write, kernels)

        # Softmax branch: attention first (it reads the cached block), then the KV goes into the memory.
        qs, ks, vs = self.softmax_views(q, k, v, start=start, kernels=kernels)
        if start == 0:
            nb = -(-T // C)
            keep_all = torch.ones(B, nb, self.num_heads, dtype=x.dtype, device=x.device)
            if keep is not None:
                keep_all[:, :completed] = keep
            o_nla = ops.routed_attention(qs, ks, vs, keep_all, block_size=C, backend=self.backend,
                                         intra_block=c.intra_block_output != "gdn")
        else:
            o_nla = self._attend_after_prefix(qs, ks, vs, cache, n, keep)
        self._store_kv(ks, vs, cache, n, keep, kernels)
        overlap.join(side, x.device)

        # Commit the new states and the router's running sum of the unfinished block (pads left out).
        cache.state_start.copy_(s_start)
        cache.state_run.copy_(s_run)
        cache.decay_sum.copy_(decay)
        real = real_tokens(cache.positions, T, x.device)
        if real is not None:
            x = x.masked_fill(~real, 0)
        if completed == 0:
            cache.x_sum.add_(x.sum(1, dtype=acc))
        else:
            cache.x_sum.copy_(x[:, T - tail:].sum(1, dtype=acc))
        return o_la, o_nla

    def _prefill_gdn(self, x, q, k, v, g, beta, cache, head: int, full: int, tail: int, closes_head: bool, write,
                     kernels):
        """The GDN branch of `_prefill` over its head / full / tail pieces: (o_la, the committed
        state, the running state, the running decay sum), the cache itself untouched."""
        c = self.config
        C = c.block_size
        T = x.shape[1]
        ql, kl, vl = self.proj.split_heads(q, k, v, kernels)
        intra = c.intra_block_output != "softmax"
        rule = dict(block_size=C, decay_skipped_blocks=c.decay_skipped_blocks, backend=self.backend,
                    output_final_state=True)
        s_start, s_run, decay = cache.state_start, cache.state_run, cache.decay_sum
        outs = []
        if head:
            piece = slice(0, head)
            o, s_run = self.proj.rule(ql[:, piece], kl[:, piece], vl[:, piece], g[:, piece], beta[:, piece],
                                      initial_state=s_run, **rule)
            cumulative = decay[:, None] + g[:, piece].to(decay.dtype).cumsum(1)
            decay = cumulative[:, -1]
            if not intra:  # the committed state, decayed to each token's position
                o = (cumulative.exp()[..., None] * read_state(s_start, ql[:, piece], scale=self.proj.scale)).to(x.dtype)
            outs.append(o)
            if closes_head:
                s_start = commit_state(s_start, s_run, decay, write[:, 0], c.decay_skipped_blocks, backend=self.backend)
                s_run, decay = s_start, torch.zeros_like(decay)
        if full:
            piece = slice(head, head + full * C)
            o, s_start = self.proj.rule(ql[:, piece], kl[:, piece], vl[:, piece], g[:, piece], beta[:, piece],
                                        write[:, int(closes_head):], initial_state=s_start, intra_block=intra, **rule)
            s_run = s_start
            outs.append(o)
        if tail:
            piece = slice(T - tail, T)
            o, s_run = self.proj.rule(ql[:, piece], kl[:, piece], vl[:, piece], g[:, piece], beta[:, piece],
                                      initial_state=s_start, intra_block=intra, **rule)
            decay = decay + g[:, piece].to(decay.dtype).sum(1)
            outs.append(o)
        o_la = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # a lone piece is not copied
        return o_la, s_start, s_run, decay

    def _keep_per_head(self, keep, B, device):
        """keep [B, completed, H] or None -> bool [B, completed + 1, heads]; the extra last row is
        False and stands for the unfinished block (so indexing by relative block is always safe)."""
        if keep is None:
            keep = torch.zeros(B, 0, self.num_heads, device=device)
        heads = keep.repeat_interleave(self.groups, dim=2) > 0.5
        return torch.cat([heads, heads.new_zeros(B, 1, heads.shape[2])], dim=1)

    def _attend_after_prefix(self, qs, ks, vs, cache, n: int, keep, chunk: int = 1024):
        """Softmax branch of a prefill that continues a cache: the new queries see the kept memory,
        the cached tokens of the block in progress and the new keys, as routed_attention would."""
        C = self.config.block_size
        intra = self.config.intra_block_output != "gdn"
        B, T = qs.shape[:2]
        device = qs.device
        kept0 = cache.kept_len.repeat_interleave(self.groups, dim=1)[..., None, None]  # [B, heads, 1, 1]
        prefix = int(cache.kept_len.max()) + n
        keys = torch.cat([cache.k_mem[:, :, :prefix], ks.transpose(1, 2)], dim=2)
        values = torch.cat([cache.v_mem[:, :, :prefix], vs.transpose(1, 2)], dim=2)
        keep_heads = self._keep_per_head(keep, B, device)  # [B, completed + 1, heads]
        rel = (n + torch.arange(T, device=device)) // C  # relative block of each new token
        key_kept = keep_heads[:, rel].permute(0, 2, 1)[:, :, None, :]  # [B, heads, 1, T]
        slots = torch.arange(prefix, device=device)
        committed = slots < kept0  # kept blocks: earlier than every new token
        cached_block = (slots >= kept0) & (slots < kept0 + n)  # the block in progress (relative block 0)
        block0_kept = keep_heads[:, 0][:, :, None, None]  # [B, heads, 1, 1]
        outputs = []
        for t0 in range(0, T, chunk):
            t = torch.arange(t0, min(T, t0 + chunk), device=device)
            a = rel[t][:, None]  # [tq, 1]
            sees_block0 = ((a == 0) & intra) | ((a > 0) & block0_kept)  # [B, heads, tq, 1]
            prefix_mask = committed | (cached_block & sees_block0)
            same_block = (rel[None, :] == a) & (torch.arange(T, device=device)[None, :] <= t[:, None]) & intra
            new_mask = same_block | ((rel[None, :] < a) & key_kept)
            mask = torch.cat([prefix_mask.expand(B, -1, len(t), -1), new_mask.expand(B, keys.shape[1], -1, -1)], -1)
            outputs.append(masked_attention(qs[:, t0:t0 + len(t)], keys, values, mask))
        return torch.cat(outputs, dim=1)

    def _store_kv(self, ks, vs, cache, n: int, keep, kernels) -> None:
        """Write the new tokens' K/V into the compacted memory: tokens of kept blocks and of the
        unfinished block, each at its group's kept length + C * (kept blocks before it) + offset
        (the kernel set's `store_blocks`)."""
        C = self.config.block_size
        B = ks.shape[0]
        device = ks.device
        keep_heads = self._keep_per_head(keep, B, device)  # [B, completed + 1, heads]
        completed = keep_heads.shape[1] - 1
        # Exclusive count, scanned along the last dim (an outer-dim scan over 2K blocks is slow on CUDA)
        kept = keep_heads.long().transpose(1, 2)
        kept_before = (kept.cumsum(-1) - kept).transpose(1, 2)
        kept0 = cache.kept_len.repeat_interleave(self.groups, dim=1)  # [B, heads]
        blocks = torch.arange(completed + 1, device=device)
        valid_blocks = keep_heads | (blocks >= completed)[None, :, None]  # kept, or the unfinished block
        kernels.store_blocks(ks, cache.k_mem, valid_blocks, kept_before, kept0, n, C)
        kernels.store_blocks(vs, cache.v_mem, valid_blocks, kept_before, kept0, n, C)
        if keep is not None:
            cache.kept_len.add_(C * (keep > 0.5).long().sum(1))
