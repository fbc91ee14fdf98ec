"""Fused verification in Triton: `verify_native` in two kernel launches, logits read about once.

Same contract and terms as `draftsmith.speculative.verify` (accepted, recovered and bonus tokens;
acceptance `u * q < p and q > 0`; residual `max(0, p - q)` sampled by an exponential race, p itself
when the residual is all zero; greedy rows by argmax with the lowest index on ties). Shapes: B rows,
D draft slots, W = D + 1 target positions, V vocabulary.

Passes
1. `_position_stats_kernel`, grid (row tiles, W): one program per (row tile, position j) streams
   logits[b, j, :] once in blocks of BLOCK_V and keeps, per row, either the online softmax max/sum of
   the scaled logits z = x / t (sampled rows) or the raw argmax (greedy rows). It writes three [B, W]
   scratch tensors; positions past a row's draft length are skipped (their logits are never read).
2. `_accept_and_sample_kernel`, grid (row tiles,): per row, the acceptance loop over the D_b draft
   positions (p at the draft token is exp(z_tok - max) / sum from one gathered logit and the stats of
   pass 1, q from one gathered draft prob), then one more stream over the logits at the single
   position n = num_accepted (sampled rows only) that runs the exponential races for p and for the
   residual together, so no second pass is needed to learn whether the residual is all zero. It writes
   the [B, W] tokens (-1 padded), num_accepted and num_emitted.
So logits are read (W + 1) / W times for sampled rows and once for greedy rows, draft probs only at
the D gathered entries and the one row at position n, and nothing of size [B, W, V] is written.

Top-k / top-p (the `filter_logits` semantics)
- Fast path: when no sampled row uses top-k or top-p there is no pre-pass at all.
- Top-k is fused: a pre-pass takes the k-th largest raw logit per (row, position) with `torch.topk`
  (no selection algorithm is cheaper to write in a kernel), and the kernels keep a token when
  `x / t >= kth / t` with IEEE division (`div_rn`), which is bit-for-bit the reference's `x < kth` test
  on scaled logits, because division by t > 0 is monotone so the k-th largest scaled logit is the
  scaled k-th largest raw one.
- Top-p is a separate masking pass: for the sampled top-p rows only, the reference `filter_logits`
  (sort, cumulative sum) runs on that sub-batch and its mask is written as -inf into a copy of the
  logits, which the kernels then read. Fusing it would need a sort or a multi-pass threshold search
  inside the kernel, and reproducing the reference's tie and rounding behaviour there costs more than
  the sort it replaces. Those rows' top-k is part of that mask.

Float semantics. The kernels compute z = x * (1 / t) and exp in fp32 with max subtraction, like
`torch.softmax` but with a different summation order and exp implementation, so p can differ from
the reference's by a few ulps. Greedy outputs depend only on the raw argmax and are identical always;
sampled decisions are identical except when u * q lies within those ulps of p (or two race entries
tie within them), which the tests keep away from.

Random numbers (when accept_u / race_exp are None): Triton's Philox4x32-10 (`tl.philox`) keyed by
the row's 64-bit seed, with the counter

    (c0, c1, c2, c3) = (index, offset & 0xffffffff, offset >> 32, stream)

- stream 0, acceptance: u_j for draft position j is word 0 of counter index j, as
  (bits >> 8) * 2^-24 in [0, 1);
- stream 1, race noise: E_v for vocab id v is word (v mod 4) of counter index v // 4, as
  -log(((bits >> 8) + 0.5) * 2^-24) > 0 (four ids per Philox call).
A row's numbers depend only on its (seed, offset), never on its place in the batch, the batch size or
the block sizes; the runtime passes a fresh offset every round (incrementing by one is enough, each
offset owns 2^32 counters per stream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftsmith.speculative.errors import InvalidInputError
from draftsmith.speculative.sampling import filter_logits
from draftsmith.speculative.verify import VerifyOutput, validate_verify_inputs

ACCEPT_STREAM = 0
RACE_STREAM = 1


# ---------------------------------------------------------------- device helpers


@triton.jit
def _scaled(x, inv_t, t_safe, k_scaled, HAS_TOPK: tl.constexpr):
    """z = x / t for the softmax; -inf outside the top-k set (exact test: x / t >= kth / t)."""
    z = x * inv_t
    if HAS_TOPK:
        z = tl.where(tl.math.div_rn(x, t_safe) >= k_scaled, z, float("-inf"))
    return z


@triton.jit
def _argmax_update(values, start, best, best_idx):
    """Running argmax over blocks along axis 1: [R, BV] block -> [R] best value / index.

    Strictly greater replaces, so an earlier block keeps a tie; inside a block the lowest index wins.
    """
    block_best = tl.max(values, axis=1)  # [R]
    block_idx = start + tl.argmax(values, axis=1, tie_break_left=True)  # [R]
    better = block_best > best
    return tl.where(better, block_best, best), tl.where(better, block_idx, best_idx)


@triton.jit
def _softmax_update(z, m, s):
    """Online max / sum of exp over blocks: [R, BV] block, [R] running max m and sum s."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf prefix: keep s = 0, no NaN
    s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe[:, None]), axis=1)
    return m_new, s


@triton.jit
def _philox_bits(seed, index, offset, stream: tl.constexpr):
    """Four uint32 words of Philox4x32-10 at counter (index, offset lo, offset hi, stream), key seed.

    seed / offset: int64, broadcastable against index (uint32).
    """
    off = offset.to(tl.uint64, bitcast=True)
    zero = tl.zeros_like(index)
    c1 = zero + (off & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + (off >> 32).to(tl.uint32)
    c3 = zero + stream
    return tl.philox(seed, index, c1, c2, c3)


@triton.jit
def _bits_to_uniform(bits):  # uint32 -> float32 in [0, 1), 24 bits
    return (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _bits_to_exponential(bits):  # uint32 -> Exp(1) float32 > 0 (open-interval uniform, never log 0)
    return -tl.log(((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0))


@triton.jit
def _race_noise(seed, offset, start, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """[R, BV] Exp(1) noise for vocab ids start .. start + BV: id v is word v % 4 of counter v // 4."""
    quad = (start // 4 + tl.arange(0, BLOCK_V // 4)).to(tl.uint32)  # [BV / 4]
    index = quad[None, :] + tl.zeros((ROWS, 1), tl.uint32)  # [R, BV / 4]
    w0, w1, w2, w3 = _philox_bits(seed[:, None], index, offset[:, None], RACE_STREAM)  # [R, BV / 4] each
    # join(join(w0, w2), join(w1, w3))[r, c, a, b] = w_{2a+b}, flattened to column 4c + 2a + b.
    words = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [R, BV/4, 2, 2]
    return _bits_to_exponential(tl.reshape(words, (ROWS, BLOCK_V)))


@triton.jit
def _row_setup(rows, B, temperature_ptr, kth_ptr, pos, W, HAS_TOPK: tl.constexpr):
    """Per-row temperature terms and the scaled top-k threshold at position pos ([R] each)."""
    in_batch = rows < B
    t = tl.load(temperature_ptr + rows, mask=in_batch, other=0.0).to(tl.float32)
    t_safe = tl.where(t > 0, t, 1.0)
    k_scaled = tl.full(rows.shape, float("-inf"), tl.float32)
    if HAS_TOPK:
        kth = tl.load(kth_ptr + rows * W + pos, mask=in_batch, other=float("-inf"))
        k_scaled = tl.math.div_rn(kth, t_safe)
    return t, t_safe, 1.0 / t_safe, k_scaled


# ---------------------------------------------------------------- pass 1


@triton.jit
def _position_stats_kernel(
    logits_ptr,  # [B, W, V] fp32 / bf16 / fp16, last dim contiguous
    stride_lb,
    stride_lj,
    draft_lens_ptr,  # [B] int64
    temperature_ptr,  # [B] fp32
    kth_ptr,  # [B, W] fp32 k-th largest raw logit (-inf = off); read only if HAS_TOPK
    row_max_ptr,  # [B, W] fp32 out: max of z (sampled rows)
    row_sum_ptr,  # [B, W] fp32 out: sum of exp(z - max) (sampled rows)
    argmax_ptr,  # [B, W] int32 out: argmax of the raw logits (greedy rows)
    B,
    W,
    V,
    HAS_TOPK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R]
    j = tl.program_id(1)
    in_batch = rows < B
    lens = tl.load(draft_lens_ptr + rows, mask=in_batch, other=-1)
    live = in_batch & (j <= lens)  # position j is used only up to the draft length
    t, t_safe, inv_t, k_scaled = _row_setup(rows, B, temperature_ptr, kth_ptr, j, W, HAS_TOPK)
    greedy = live & (t == 0)
    sampled = live & (t > 0)
    any_greedy = tl.max(greedy.to(tl.int32), axis=0) > 0
    any_sampled = tl.max(sampled.to(tl.int32), axis=0) > 0

    row_base = logits_ptr + rows.to(tl.int64) * stride_lb + j * stride_lj  # [R] pointers
    best = tl.full((ROWS,), float("-inf"), tl.float32)
    best_idx = tl.zeros((ROWS,), tl.int32)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    s = tl.zeros((ROWS,), tl.float32)
    if any_greedy | any_sampled:
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)  # [BV]
            mask = live[:, None] & (cols < V)[None, :]
            x = tl.load(row_base[:, None] + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            if any_greedy:
                best, best_idx = _argmax_update(x, start, best, best_idx)
            if any_sampled:
                z = _scaled(x, inv_t[:, None], t_safe[:, None], k_scaled[:, None], HAS_TOPK)
                m, s = _softmax_update(z, m, s)

    out = rows * W + j
    tl.store(row_max_ptr + out, m, mask=live)
    tl.store(row_sum_ptr + out, s, mask=live)
    tl.store(argmax_ptr + out, best_idx, mask=live)


# ---------------------------------------------------------------- pass 2


@triton.jit
def _accepted_prefix(
    rows, in_batch, lens, t, t_safe, inv_t, seed, offset,
    logits_ptr, stride_lb, stride_lj, draft_tokens_ptr, stride_tb,
    draft_probs_ptr, stride_qb, stride_qj, kth_ptr, accept_u_ptr, stride_ub,
    row_max_ptr, row_sum_ptr, argmax_ptr, D, W,
    ONE_HOT: tl.constexpr, HAS_TOPK: tl.constexpr, EXPLICIT_U: tl.constexpr,
):
    """[R] int32 num_accepted: the acceptance test at j = 0 .. D_b - 1 until the first rejection."""
    n = tl.zeros(rows.shape, tl.int32)
    still = in_batch
    greedy = t == 0
    for j in range(0, D):
        live = still & (j < lens)
        sampled = live & (t > 0)
        tok = tl.load(draft_tokens_ptr + rows * stride_tb + j, mask=live, other=0)  # [R] int64
        target_best = tl.load(argmax_ptr + rows * W + j, mask=live, other=-1)

        # p at the draft token from one gathered logit and pass 1's max / sum.
        x_tok = tl.load(logits_ptr + rows.to(tl.int64) * stride_lb + j * stride_lj + tok,
                        mask=sampled, other=float("-inf")).to(tl.float32)
        k_scaled = tl.full(rows.shape, float("-inf"), tl.float32)
        if HAS_TOPK:
            k_scaled = tl.math.div_rn(tl.load(kth_ptr + rows * W + j, mask=sampled, other=0.0), t_safe)
        z_tok = _scaled(x_tok, inv_t, t_safe, k_scaled, HAS_TOPK)
        m = tl.load(row_max_ptr + rows * W + j, mask=sampled, other=0.0)
        s = tl.load(row_sum_ptr + rows * W + j, mask=sampled, other=1.0)
        p_tok = tl.exp(z_tok - m) / s
        if ONE_HOT:
            q_tok = tl.full(rows.shape, 1.0, tl.float32)
        else:
            q_tok = tl.load(draft_probs_ptr + rows.to(tl.int64) * stride_qb + j * stride_qj + tok,
                            mask=sampled, other=0.0).to(tl.float32)
        if EXPLICIT_U:
            u = tl.load(accept_u_ptr + rows * stride_ub + j, mask=sampled, other=1.0)
        else:
            bits, _, _, _ = _philox_bits(seed, (tl.zeros(rows.shape, tl.int32) + j).to(tl.uint32),
                                         offset, ACCEPT_STREAM)
            u = _bits_to_uniform(bits)

        accept = tl.where(greedy, tok == target_best, (u * q_tok < p_tok) & (q_tok > 0)) & live
        n += accept.to(tl.int32)
        still = accept
    return n


@triton.jit
def _extra_token(
    rows, in_batch, lens, n, t, t_safe, inv_t, seed, offset,
    logits_ptr, stride_lb, stride_lj, draft_tokens_ptr, stride_tb,
    draft_probs_ptr, stride_qb, stride_qj, kth_ptr, race_exp_ptr, stride_eb,
    row_max_ptr, row_sum_ptr, argmax_ptr, W, V,
    ONE_HOT: tl.constexpr, HAS_TOPK: tl.constexpr, EXPLICIT_E: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """[R] int32 recovered / bonus token at position n: argmax for greedy rows, else exponential races."""
    greedy = in_batch & (t == 0)
    sampled = in_batch & (t > 0)
    rejected = sampled & (n < lens)  # recovered token from the residual (else bonus token from p)
    at_n = rows * W + n
    target_best = tl.load(argmax_ptr + at_n, mask=greedy, other=0)

    m = tl.load(row_max_ptr + at_n, mask=sampled, other=0.0)
    s = tl.load(row_sum_ptr + at_n, mask=sampled, other=1.0)
    k_scaled = tl.full((ROWS,), float("-inf"), tl.float32)
    if HAS_TOPK:
        k_scaled = tl.math.div_rn(tl.load(kth_ptr + at_n, mask=sampled, other=0.0), t_safe)
    tok_n = tl.load(draft_tokens_ptr + rows * stride_tb + n, mask=rejected, other=-1)  # [R]
    logit_row = logits_ptr + rows.to(tl.int64) * stride_lb + n.to(tl.int64) * stride_lj  # [R] pointers
    q_row = draft_probs_ptr + rows.to(tl.int64) * stride_qb + n.to(tl.int64) * stride_qj

    # Race values are >= 0, so -1 loses to any real entry.
    best_p = tl.full((ROWS,), -1.0, tl.float32)
    idx_p = tl.zeros((ROWS,), tl.int32)
    best_r = tl.full((ROWS,), -1.0, tl.float32)
    idx_r = tl.zeros((ROWS,), tl.int32)
    any_sampled = tl.max(sampled.to(tl.int32), axis=0) > 0
    any_rejected = tl.max(rejected.to(tl.int32), axis=0) > 0
    if any_sampled:
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)  # [BV]
            in_vocab = (cols < V)[None, :]
            x = tl.load(logit_row[:, None] + cols[None, :], mask=sampled[:, None] & in_vocab,
                        other=float("-inf")).to(tl.float32)  # [R, BV]
            z = _scaled(x, inv_t[:, None], t_safe[:, None], k_scaled[:, None], HAS_TOPK)
            p = tl.exp(z - m[:, None]) / s[:, None]  # [R, BV] target probabilities
            if EXPLICIT_E:
                e = tl.load(race_exp_ptr + rows.to(tl.int64)[:, None] * stride_eb + cols[None, :],
                            mask=sampled[:, None] & in_vocab, other=1.0)
            else:
                e = _race_noise(seed, offset, start, ROWS, BLOCK_V)
            best_p, idx_p = _argmax_update(p / e, start, best_p, idx_p)
            if any_rejected:
                if ONE_HOT:
                    q = tl.where(cols[None, :] == tok_n[:, None], 1.0, 0.0)
                else:
                    q = tl.load(q_row[:, None] + cols[None, :], mask=rejected[:, None] & in_vocab,
                                other=0.0).to(tl.float32)
                residual = tl.maximum(p - q, 0.0)
                best_r, idx_r = _argmax_update(residual / e, start, best_r, idx_r)

    # best_r > 0 iff some residual entry is > 0; an all-zero residual falls back to p.
    sampled_token = tl.where(rejected & (best_r > 0), idx_r, idx_p)
    return tl.where(greedy, target_best, sampled_token)


@triton.jit
def _accept_and_sample_kernel(
    logits_ptr,  # [B, W, V]
    stride_lb,
    stride_lj,
    draft_tokens_ptr,  # [B, D] int64
    stride_tb,
    draft_lens_ptr,  # [B] int64
    draft_probs_ptr,  # [B, D, V] (unused if ONE_HOT)
    stride_qb,
    stride_qj,
    temperature_ptr,  # [B] fp32
    kth_ptr,  # [B, W] fp32 (unused unless HAS_TOPK)
    accept_u_ptr,  # [B, D] fp32 (unused unless EXPLICIT_U)
    stride_ub,
    race_exp_ptr,  # [B, V] fp32 (unused unless EXPLICIT_E)
    stride_eb,
    seeds_ptr,  # [B] int64 (unused when all noise is explicit)
    offsets_ptr,  # [B] int64
    row_max_ptr,  # [B, W] from pass 1
    row_sum_ptr,
    argmax_ptr,
    tokens_ptr,  # [B, W] int64 out
    num_accepted_ptr,  # [B] int64 out
    num_emitted_ptr,  # [B] int64 out
    B,
    D,
    V,
    ONE_HOT: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    EXPLICIT_U: tl.constexpr,
    EXPLICIT_E: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    W = D + 1
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R]
    in_batch = rows < B
    lens = tl.load(draft_lens_ptr + rows, mask=in_batch, other=0)
    t, t_safe, inv_t, _ = _row_setup(rows, B, temperature_ptr, kth_ptr, 0, W, False)
    seed = tl.zeros((ROWS,), tl.int64)
    offset = tl.zeros((ROWS,), tl.int64)
    if not (EXPLICIT_U and EXPLICIT_E):
        seed = tl.load(seeds_ptr + rows, mask=in_batch, other=0)
        offset = tl.load(offsets_ptr + rows, mask=in_batch, other=0)

    n = _accepted_prefix(
        rows, in_batch, lens, t, t_safe, inv_t, seed, offset,
        logits_ptr, stride_lb, stride_lj, draft_tokens_ptr, stride_tb,
        draft_probs_ptr, stride_qb, stride_qj, kth_ptr, accept_u_ptr, stride_ub,
        row_max_ptr, row_sum_ptr, argmax_ptr, D, W,
        ONE_HOT, HAS_TOPK, EXPLICIT_U,
    )
    extra = _extra_token(
        rows, in_batch, lens, n, t, t_safe, inv_t, seed, offset,
        logits_ptr, stride_lb, stride_lj, draft_tokens_ptr, stride_tb,
        draft_probs_ptr, stride_qb, stride_qj, kth_ptr, race_exp_ptr, stride_eb,
        row_max_ptr, row_sum_ptr, argmax_ptr, W, V,
        ONE_HOT, HAS_TOPK, EXPLICIT_E, ROWS, BLOCK_V,
    ).to(tl.int64)

    # Each output column is written once: accepted draft tokens, the extra token at n, then -1.
    for j in range(0, W):
        drafted = tl.load(draft_tokens_ptr + rows * stride_tb + j, mask=in_batch & (j < n), other=-1)
        tl.store(tokens_ptr + rows * W + j, tl.where(j == n, extra, drafted), mask=in_batch)
    tl.store(num_accepted_ptr + rows, n.to(tl.int64), mask=in_batch)
    tl.store(num_emitted_ptr + rows, n.to(tl.int64) + 1, mask=in_batch)


# ---------------------------------------------------------------- host side


def _filter_prepass(
    logits: torch.Tensor,  # [B, W, V]
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits (top-p rows masked), kth [B, W] fp32 or None
    """Top-p mask and top-k thresholds for the sampled rows that use them (nothing on the fast path)."""
    vocab = logits.shape[-1]
    sampled = temperature > 0
    use_p = sampled & (top_p < 1.0)
    use_k = sampled & (top_k > 0) & (top_k < vocab) & ~use_p  # top-p rows get top-k inside their mask
    if not bool((use_p | use_k).any()):
        return logits, None
    kth = None
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, torch.ones_like(top_k))
        top_values = torch.topk(logits, int(k.max()), dim=-1).values  # [B, W, kmax]
        kth = top_values.gather(-1, (k - 1)[:, None, None].expand(-1, logits.shape[1], 1)).squeeze(-1).float()
        kth = torch.where(use_k[:, None], kth, torch.full_like(kth, float("-inf"))).contiguous()
    if bool(use_p.any()):
        rows = use_p.nonzero().squeeze(1)
        filtered = filter_logits(logits[rows], temperature[rows], top_k[rows], top_p[rows])  # [Bp, W, V]
        logits = logits.clone()
        logits[rows] = logits[rows].masked_fill(filtered == float("-inf"), float("-inf"))
    return logits, kth


def _launch_config(batch: int, vocab: int) -> tuple[int, int, int]:  # (ROWS, BLOCK_V, num_warps)
    """One row per program for real vocabularies; several rows per program when V is small.

    The interpreter pays per operation, not per element, so it gets large tiles.
    """
    interpreted = triton.knobs.runtime.interpret
    block_v = min(triton.next_power_of_2(vocab), 1024 if interpreted else 4096)
    block_v = max(block_v, 16)  # the race noise comes four ids per Philox call
    tile = 1 << 16 if interpreted else 4096
    rows = max(1, min(triton.next_power_of_2(batch), tile // block_v))
    return rows, block_v, 8 if rows * block_v >= 4096 else 4


def _check_noise(batch, width, vocab, accept_u, race_exp, seeds, offsets) -> None:
    if accept_u is not None and accept_u.shape != (batch, width - 1):
        raise InvalidInputError(f"accept_u must be [B, D] = [{batch}, {width - 1}], got {tuple(accept_u.shape)}")
    if race_exp is not None and race_exp.shape != (batch, vocab):
        raise InvalidInputError(f"race_exp must be [B, V] = [{batch}, {vocab}], got {tuple(race_exp.shape)}")
    if accept_u is None or race_exp is None:
        for name, t in (("seeds", seeds), ("offsets", offsets)):
            if t is None or t.shape != (batch,):
                raise InvalidInputError(
                    f"verify_fused without accept_u / race_exp draws its own noise and needs {name} as a "
                    f"[B] = [{batch}] int64 tensor"
                )


def verify_fused(
    target_logits: torch.Tensor,  # [B, D + 1, V] float32 / bf16 / fp16, raw logits
    draft_tokens: torch.Tensor,  # [B, D] int64; entries at or past draft_lens are ignored
    draft_lens: torch.Tensor,  # [B] int64 in 0..D
    draft_probs: torch.Tensor | None,  # [B, D, V] processed draft distribution q; None = one-hot
    temperature: torch.Tensor,  # [B] float32; 0 = greedy row
    top_k: torch.Tensor,  # [B] int64; 0 = off
    top_p: torch.Tensor,  # [B] float32; 1 = off
    accept_u: torch.Tensor | None = None,  # [B, D] uniforms; None = Philox from (seeds, offsets)
    race_exp: torch.Tensor | None = None,  # [B, V] Exp(1) noise; None = Philox from (seeds, offsets)
    *,
    seeds: torch.Tensor | None = None,  # [B] int64 per-row Philox key
    offsets: torch.Tensor | None = None,  # [B] int64 per-row counter offset, fresh every round
    validate: bool = True,  # as verify_native's
) -> VerifyOutput:
    """`verify_native` as two Triton kernels; identical outputs for the same explicit noise."""
    if validate:
        validate_verify_inputs(target_logits, draft_tokens, draft_lens, draft_probs)
    batch, width, vocab = target_logits.shape
    _check_noise(batch, width, vocab, accept_u, race_exp, seeds, offsets)
    return _verify_fused_unchecked(target_logits, draft_tokens, draft_lens, draft_probs, temperature,
                                   top_k, top_p, accept_u, race_exp, seeds, offsets)


def _verify_fused_unchecked(target_logits, draft_tokens, draft_lens, draft_probs, temperature, top_k, top_p,
                            accept_u, race_exp, seeds, offsets) -> VerifyOutput:
    """The launches alone (inputs already validated); the benchmark times this as well."""
    batch, width, vocab = target_logits.shape
    device = target_logits.device
    temperature = temperature.to(device=device, dtype=torch.float32).contiguous()
    logits, kth = _filter_prepass(target_logits, temperature, top_k.to(device), top_p.to(device))
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    draft_lens = draft_lens.to(torch.int64).contiguous()
    # With D = 0 nothing is drafted: tokens, q and u are never read (any real pointer will do).
    drafted = width > 1
    draft_tokens = draft_tokens.to(torch.int64).contiguous() if drafted else draft_lens
    one_hot = draft_probs is None or not drafted
    probs = draft_tokens if one_hot else draft_probs.contiguous()
    explicit_u = accept_u is not None or not drafted
    u = accept_u.to(torch.float32).contiguous() if accept_u is not None and drafted else draft_lens
    e = draft_lens if race_exp is None else race_exp.to(torch.float32).contiguous()
    seeds = draft_lens if seeds is None else seeds.to(device=device, dtype=torch.int64).contiguous()
    offsets = draft_lens if offsets is None else offsets.to(device=device, dtype=torch.int64).contiguous()

    row_max = torch.empty(batch, width, dtype=torch.float32, device=device)
    row_sum = torch.empty_like(row_max)
    argmax = torch.empty(batch, width, dtype=torch.int32, device=device)
    tokens = torch.empty(batch, width, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    num_emitted = torch.empty_like(num_accepted)
    kth_arg = row_max if kth is None else kth
    rows, block_v, warps = _launch_config(batch, vocab)
    tiles = triton.cdiv(batch, rows)

    _position_stats_kernel[(tiles, width)](
        logits, logits.stride(0), logits.stride(1), draft_lens, temperature, kth_arg,
        row_max, row_sum, argmax, batch, width, vocab,
        HAS_TOPK=kth is not None, ROWS=rows, BLOCK_V=block_v, num_warps=warps,
    )
    _accept_and_sample_kernel[(tiles,)](
        logits, logits.stride(0), logits.stride(1),
        draft_tokens, draft_tokens.stride(0) if drafted else 0, draft_lens,
        probs, 0 if one_hot else probs.stride(0), 0 if one_hot else probs.stride(1),
        temperature, kth_arg, u, u.stride(0) if u.dim() == 2 else 0,
        e, 0 if race_exp is None else e.stride(0), seeds, offsets,
        row_max, row_sum, argmax, tokens, num_accepted, num_emitted, batch, width - 1, vocab,
        ONE_HOT=one_hot, HAS_TOPK=kth is not None, EXPLICIT_U=explicit_u, EXPLICIT_E=race_exp is not None,
        ROWS=rows, BLOCK_V=block_v, num_warps=warps,
    )
    return VerifyOutput(tokens=tokens, num_emitted=num_emitted, num_accepted=num_accepted)
