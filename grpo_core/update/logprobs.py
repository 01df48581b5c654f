"""Per-token log-probs (and entropy) of sampled completions under a model, as cheaply as possible.

Rows are [left-padded prompt | right-padded completion]. `completion_logprobs` is the entry point; the
rest is how it avoids work: each group of G answers shares one prompt pass (packed into one row, or a
repeated KV cache), the LM head runs only on real completion tokens in chunks, and log-prob, entropy
and their backward take one sweep over the logits. On a CPU the packed rows' attention and (where a probe
finds it faster) the frozen base weights' matmuls run as compiled kernels (`kernels/decode_ops.cpp`,
`kernels/gemm_ops.cpp`). V = vocabulary, H = hidden size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_core.kernels import native
from grpo_core.kernels.cpu_features import note_declined
from grpo_core.kernels.fused_decode import use_packed_linears
from grpo_core.kernels.lean_decode import LeanDecoder, causal_pad_mask, positions, sliding_window
from grpo_core.kernels.lora_linear import linear
from grpo_core.model.policy import fp32_head_logits


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[ids] = logit[id]/T - logsumexp(logits/T), never the full log-softmax.

    logits: [B, L, V], ids: [B, L] -> [B, L] (fp32)
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)            # [B, L]
    return picked - torch.logsumexp(logits, dim=-1)                      # [B, L]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position. [B, L, V] -> [B, L]."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


class _PickedLogprob(torch.autograd.Function):
    """token_logprobs and token_entropy in one sweep over the logits, with the softmax kept for a
    one-pass backward: d logp / d logits = (onehot(id) - softmax) / T. The entropy is differentiated
    only when `entropy_grad` (an entropy bonus in the loss): d H / d z_j = -p_j (log p_j + H), z = logits / T,
    which keeps log p as well. logits: [n, V] fp32, ids: [n] -> logp [n], entropy [n] (zeros unless asked for)."""

    @staticmethod
    def forward(ctx, logits, ids, temperature: float, with_entropy: bool, entropy_grad: bool = False):
        z = logits / temperature if temperature != 1.0 else logits               # [n, V]
        m = z.amax(-1, keepdim=True)                                             # [n, 1]
        e = (z - m).exp_()                                                       # [n, V] unnormalised probs
        total = e.sum(-1, keepdim=True)                                          # [n, 1]
        lse = (m + total.log()).squeeze(-1)                                      # [n]
        logp = z.gather(-1, ids[:, None]).squeeze(-1) - lse                      # [n]
        # H = lse - sum(p * z)
        ent = lse - torch.linalg.vecdot(e, z) / total.squeeze(-1) if with_entropy else torch.zeros_like(lse)
        ctx.entropy_grad = entropy_grad and with_entropy
        if ctx.needs_input_grad[0]:
            probs = e.div_(total)                                                # softmax, in place
            if ctx.entropy_grad:
                ctx.save_for_backward(probs, ids, z - lse[:, None], ent)         # + log-softmax [n, V]
            else:
                ctx.save_for_backward(probs, ids)
            ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        saved = ctx.saved_tensors                                                # unpack once (checkpointing)
        probs, ids = saved[:2]
        grad = probs.mul(-grad_logp[:, None])                                    # [n, V]
        grad.scatter_add_(-1, ids[:, None], grad_logp[:, None])
        if ctx.entropy_grad and grad_ent is not None:
            log_probs, ent = saved[2:]
            grad.sub_(probs * (log_probs + ent[:, None]) * grad_ent[:, None])    # -p (log p + H) dH
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad, None, None, None, None


class _SweptLogprob(torch.autograd.Function):
    """_PickedLogprob through the compiled logit sweep (`native.NativeOps.logit_sweep`): the logits stay in
    their own dtype, and only each row's log-sum-exp is kept for the backward, which recomputes the softmax
    as it writes the gradient. No entropy gradient. logits: [n, V] float32 or bfloat16, ids: [n] int64."""

    @staticmethod
    def forward(ctx, logits, ids, temperature: float, with_entropy: bool, ops):
        logp, lse, ent = ops.logit_sweep(logits, ids, temperature, with_entropy)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logits, ids, lse)
            ctx.temperature, ctx.ops = temperature, ops
        return logp, ent if with_entropy else torch.zeros_like(lse)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, ids, lse = ctx.saved_tensors
        grad = ctx.ops.logit_sweep_backward(logits, ids, lse, grad_logp.float().contiguous(), ctx.temperature)
        return grad, None, None, None, None


# the compiled logit sweep and segment attention, where they apply (tests switch either off here)
_sweep_ops = native.ops_for
_native_attention_ops = native.ops_for


def _head_chunk(hidden: torch.Tensor, head: torch.nn.Module, ids: torch.Tensor, temperature: float,
                with_entropy: bool, entropy_grad: bool = False, fp32_head: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: hidden [n, ..., H] -> (logp [n, ...], entropy [n, ...] or empty) via the LM head (in float32
    with `fp32_head`; a head already in float32 takes its usual path)."""
    if fp32_head and not hidden.dtype == head.weight.dtype == torch.float32:
        logits = fp32_head_logits(head, hidden)                           # [n, ..., V] float32
    else:
        logits = linear(head, hidden)                                     # [n, ..., V]
    logits = logits.reshape(-1, logits.size(-1))
    ops = None if entropy_grad else _sweep_ops(logits)
    if ops is not None:
        logp, ent = _SweptLogprob.apply(logits.contiguous(), ids.reshape(-1).long().contiguous(), temperature,
                                        with_entropy, ops)
    else:
        logp, ent = _PickedLogprob.apply(logits.float(), ids.reshape(-1), temperature, with_entropy, entropy_grad)
    if not with_entropy:
        return logp.view(ids.shape), logp.new_zeros(0)
    return logp.view(ids.shape), (ent if entropy_grad else ent.detach()).view(ids.shape)


# Below this many bytes of full fp32 logits ([B, L, V]) the backward pass keeps them rather than
# recomputing each chunk's LM-head matmul (faster; e.g. 16 x 64 x 49k x 4 B = 200 MB).
KEEP_LOGITS_BYTES = 512 * 2**20


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, ids: torch.Tensor, temperature: float = 1.0,
                  chunk: int = 256, with_entropy: bool = False, keep_logits_bytes: int | None = None,
                  entropy_grad: bool = False, fp32_head: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) from final hidden states, `chunk` entries of dim 0 at a time.

    Only a chunk's logits exist at once in the forward pass. With autograd on and full logits larger
    than `keep_logits_bytes`, each chunk is checkpointed: the backward pass recomputes that chunk's
    logits instead of keeping all of them alive.
    hidden: [N, ..., H], head: the LM head (weight [V, H]), ids: [N, ...] -> logp [N, ...], entropy
    [N, ...] (detached unless `entropy_grad`) or None. `fp32_head`: the head's matmul in float32
    (`fp32_head_logits`; cast_lm_head_to_fp32).
    """
    from torch.utils.checkpoint import checkpoint
    limit = KEEP_LOGITS_BYTES if keep_logits_bytes is None else keep_logits_bytes
    big = hidden.numel() // hidden.size(-1) * head.weight.size(0) * 4 > limit
    lps, ents = [], []
    for s in range(0, max(hidden.size(0), 1), chunk):          # once at least: no tokens give empty tensors
        args = (hidden[s:s + chunk], head, ids[s:s + chunk], temperature, with_entropy, entropy_grad, fp32_head)
        if big and torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad):
            lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _head_chunk(*args)
        lps.append(lp)
        ents.append(ent)
    if not with_entropy:
        return torch.cat(lps), None
    return torch.cat(lps), (torch.cat(ents) if entropy_grad else torch.cat(ents).detach())


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      completion_len: int) -> torch.Tensor:
    """Logits predicting the last `completion_len` tokens of each row. -> [B, Lc, V].

    Rows are [left-padded prompt | right-padded completion]; position ids follow the attention
    mask so the forward pass sees the same positions as generation did.
    """
    return _completion_forward(model, input_ids, attention_mask, completion_len).logits[:, :-1, :]   # [B, Lc, V]


def _completion_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int, **kwargs):
    position_ids = positions(attention_mask)     # [B, T]
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 logits_to_keep=completion_len + 1, use_cache=False, **kwargs)


def router_loss_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                         temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A Mixture-of-Experts model's log-probs and entropy of the last `completion_len` tokens of each row ([B, Lc]
    each, as `completion_logprobs`) and its router's load-balancing loss (a scalar), from one forward of the
    model's own with its router logits: the loss over every real token of the rows, prompts included, as
    TRL computes it."""
    out = _completion_forward(model, input_ids, attention_mask, completion_len, output_router_logits=True)
    logp, ent = _full_logits_logprobs(out.logits[:, :-1, :], input_ids[:, -completion_len:], attention_mask,
                                      temperature, with_entropy, entropy_grad)
    return logp, ent, out.aux_loss


def _full_logits_logprobs(logits: torch.Tensor, ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                          with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `ids` [B, Lc] under `logits` [B, Lc, V] (and the entropy), 0 at padding."""
    pad = attention_mask[:, -ids.size(1):] == 0                          # [B, Lc]
    ent = token_entropy(logits if entropy_grad else logits.detach(), temperature) if with_entropy else None
    return token_logprobs(logits, ids, temperature).masked_fill(pad, 0.0), \
        (ent.masked_fill(pad, 0.0) if ent is not None else None)


def _decoder_and_head(model):
    """(decoder trunk, LM head) of a causal LM, through a PEFT wrapper; (None, None) if not split that way."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_dec = getattr(base, "get_decoder", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = get_dec() if callable(get_dec) else None
    if decoder is None or not isinstance(head, torch.nn.Linear):
        return None, None
    return decoder, head


def _groups_share_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                         group_size: int) -> bool:
    """Do rows come in contiguous groups of `group_size` with identical (padded) prompts?"""
    B = input_ids.size(0)
    if group_size <= 1 or B % group_size or prompt_len < 1:
        return False
    p = input_ids[:, :prompt_len].view(B // group_size, group_size, prompt_len)
    a = attention_mask[:, :prompt_len].view(B // group_size, group_size, prompt_len)
    return bool((p == p[:, :1]).all() and (a == a[:, :1]).all())


def _shared_prompt_hidden(decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                          group_size: int) -> torch.Tensor:
    """Hidden states that predict the completion tokens, running each group's prompt once.

    The prompt of each group goes through the trunk once ([B/G, P]); its KV cache is repeated to the G
    rows (repeat_interleave is differentiable, so LoRA on k/v still gets the prompt's gradient), then
    the completions run on top of it ([B, Lc]). Same result as the full [B, P + Lc] pass, at about
    Lc / (P + Lc) of the cost when answers are short. -> [B, Lc, H]
    """
    from transformers import DynamicCache
    B, T = input_ids.shape
    P = T - completion_len
    first = torch.arange(0, B, group_size, device=input_ids.device)
    p_ids, p_attn = input_ids[first, :P], attention_mask[first, :P]                  # [B/G, P]
    p_pos = positions(p_attn)
    cache = DynamicCache(config=decoder.config)
    h_prompt = decoder(input_ids=p_ids, attention_mask=p_attn, position_ids=p_pos, past_key_values=cache,
                       use_cache=True).last_hidden_state                              # [B/G, P, H]
    cache.batch_repeat_interleave(group_size)                                       # KV -> [B, ., P, d]
    c_pos = positions(attention_mask)[:, P:]               # [B, Lc]
    h_comp = decoder(input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=c_pos,
                     past_key_values=cache, use_cache=True).last_hidden_state         # [B, Lc, H]
    h_last = h_prompt[:, -1:, :].repeat_interleave(group_size, dim=0)               # [B, 1, H] predicts token 0
    return torch.cat([h_last, h_comp[:, :-1, :]], dim=1)                             # [B, Lc, H]


def _layer_costs(config) -> tuple[float, float] | None:
    """(FLOPs per token of one decoder layer's matmuls, FLOPs per query-key pair of its attention)."""
    try:
        h, i = config.hidden_size, config.intermediate_size
        kv = h * config.num_key_value_heads // config.num_attention_heads
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
    return 2.0 * (2 * h * h + 2 * h * kv + 3 * h * i), 4.0 * h


def _group_layout(attention_mask: torch.Tensor, completion_len: int, group_size: int, flat: bool = False):
    """Where each completion goes when each group is packed into one row [prompt | c1 | ... | cG]:
    real-token mask [B, Lc], lengths [B], segment starts [B] (offsets within the group's row), each group
    row's offset in the flat sequence of rows [n], and that sequence's length. Rows are padded to the
    longest (S each, n * S in all), or, when `flat`, laid end to end at their own lengths (no padding)."""
    B, T = attention_mask.shape
    P, n = T - completion_len, B // group_size
    c_real = attention_mask[:, P:].bool()                                        # [B, Lc]
    lengths = c_real.sum(-1)                                                     # [B]
    per_group = lengths.view(n, group_size)
    starts = (P + per_group.cumsum(-1) - per_group).view(-1)                     # [B]
    row_len = P + per_group.sum(-1)                                              # [n]
    if flat:
        return c_real, lengths, starts, row_len.cumsum(0) - row_len, int(row_len.sum())
    S = int(row_len.max())
    return c_real, lengths, starts, torch.arange(n, device=attention_mask.device) * S, n * S


def _packed_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int, group_size: int,
                   dtype: torch.dtype | None, flat: bool = False):
    """Each group as one row [prompt | completion 1 | ... | completion G], completions unpadded.

    Rows are [left-padded prompt | right-padded completion] in contiguous groups that share the prompt.
    A completion token sees the real prompt tokens and the earlier tokens of its own completion, at the
    positions generation used (prompt length + t). Returns ids and position_ids [n, S] (rows padded to
    the longest) or, when `flat`, [1, total] (the group rows end to end, no padding; no mask then); an
    additive mask [n, 1, S, S] of `dtype` (0 = may attend; None when dtype is None); and for each real
    completion token (row-major over [B, Lc]) the flat index of the position whose hidden state predicts it.
    """
    B = input_ids.size(0)
    P, G, n, dev = input_ids.size(1) - completion_len, group_size, B // group_size, input_ids.device
    c_real, lengths, starts, row_start, total = _group_layout(attention_mask, completion_len, G, flat)
    rows, t = c_real.nonzero(as_tuple=True)                                      # [N] real tokens
    group = rows // G
    dest = row_start[group] + starts[rows] + t                                   # [N] flat packed index
    prompt = (row_start[:, None] + torch.arange(P, device=dev)).view(-1)         # [n * P] flat prompt slots
    p_attn = attention_mask[::G, :P].bool()                                      # [n, P]
    ids = input_ids.new_zeros(total)
    ids[dest] = input_ids[rows, P + t]
    ids[prompt] = input_ids[::G, :P].reshape(-1)
    pos = torch.zeros(total, dtype=torch.long, device=dev)
    pos[dest] = p_attn.sum(-1)[group] + t
    pos[prompt] = positions(p_attn).reshape(-1)
    src = torch.where(t == 0, row_start[group] + P - 1, dest - 1)                 # [N] predicts each token
    S = total if flat else total // n
    ids, pos = ids.view(-1, S), pos.view(-1, S)
    if dtype is None or flat:
        return ids, pos, None, src
    # segment of each position: 0 prompt, j + 1 completion j, and a distinct value per tail pad
    seg = (G + 1 + torch.arange(S, device=dev)).repeat(n)                          # [n * S]
    seg[dest] = rows % G + 1
    seg = seg.view(n, S)
    seg[:, :P] = 0
    idx = torch.arange(S, device=dev)
    causal = idx[None, :] <= idx[:, None]                                        # [S, S] key <= query
    key_prompt = torch.zeros(n, S, dtype=torch.bool, device=dev)
    key_prompt[:, :P] = p_attn
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)          # [n, S, S] own completion
    allowed = causal & (key_prompt[:, None, :] | same) | torch.eye(S, dtype=torch.bool, device=dev)
    mask = torch.zeros(n, 1, S, S, dtype=dtype, device=dev).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return ids, pos, mask, src


def _attention_bias(allowed: torch.Tensor, kv_heads: int, rep: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a key mask for `_masked_attention`: allowed [b, 1, L, T] bool -> [b * Hkv,
    rep * L, T] of `dtype`, 0 where a key may be attended and -inf elsewhere (built once, read by every layer)."""
    b, _, L, T = allowed.shape
    bias = torch.zeros(b, kv_heads, rep, L, T, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed[:, :, None], float("-inf")).view(b * kv_heads, rep * L, T)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                      scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale over the allowed keys) v: q [b, H, L, d], k, v [b, Hkv, T, d] (query head h
    reads key/value head h // (H / Hkv)), allowed [b, 1, L, T] bool -> [b, H, L, d]. On the CPU written
    out, because the fused SDPA backward is slower there at the update's sizes (1.25x in fp32, 1.5x in
    bf16): the query heads sharing a key/value head become one matrix of queries (keys and values are
    never repeated), the mask is added as `bias` (`_attention_bias`, built here unless given) in the
    score matmul, and the softmax runs in fp32."""
    b, H, L, d = q.shape
    Hkv, T = k.size(1), k.size(2)
    rep = H // Hkv
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              attn_mask=allowed, scale=scale)
    if bias is None:
        bias = _attention_bias(allowed, Hkv, rep, q.dtype)
    scores = torch.baddbmm(bias, q.reshape(b * Hkv, rep * L, d), k.reshape(b * Hkv, T, d).transpose(1, 2),
                           alpha=scale)                                          # [b Hkv, rep L, T]
    probs = scores.float().softmax(-1).to(v.dtype)
    return torch.bmm(probs, v.reshape(b * Hkv, T, d)).view(b, H, L, d)


@dataclass
class _QueryBlocks:
    """Some completions' tokens as query blocks [b, Lm], each padded to the longest of them, for attention
    against their prompt plus their own tokens ([P + Lm] keys)."""
    group: torch.Tensor          # [b] each completion's group
    index: torch.Tensor          # [b * Lm] flat packed position of each block slot (clamped past the end)
    mask: torch.Tensor           # [b, 1, Lm, P + Lm] bool: the keys each slot may attend
    dest: torch.Tensor           # [N] flat packed position of each real token
    keep: torch.Tensor           # [N] its slot in [b * Lm]


def _query_blocks(rows: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, row_start: torch.Tensor,
                  group: torch.Tensor, p_attn: torch.Tensor, total: int) -> _QueryBlocks:
    """The query blocks of the completions `rows` in the flat packed sequence (`_group_layout(flat=True)`)."""
    lengths, group = lengths[rows], group[rows]
    b, P = len(rows), p_attn.size(1)
    t = torch.arange(max(int(lengths.max()), 1), device=rows.device)
    in_seg = t[None, :] < lengths[:, None]                                       # [b, Lm]
    index = (row_start[group, None] + starts[rows, None] + t).clamp(max=total - 1).view(-1)
    own = (t[:, None] >= t[None, :])[None] & in_seg[:, None, :]                  # [b, Lm, Lm]
    mask = torch.cat([p_attn[group][:, None, :].expand(b, len(t), P), own], -1)[:, None]
    real = in_seg.view(-1)
    return _QueryBlocks(group, index, mask, index[real], real.nonzero().squeeze(-1))


def _length_split(lengths: torch.Tensor, prompt_len: int, min_saving: float = 0.2) -> list[torch.Tensor]:
    """Completions (row indices) in one block, or in two by length where that cuts the attention's padded
    work (rows x Lm x (P + Lm) per block) by at least `min_saving` (a second block costs a few more ops)."""
    order = lengths.argsort()
    ls = lengths[order].tolist()

    def work(part):
        longest = max(max(part), 1)
        return len(part) * longest * (prompt_len + longest)

    whole = work(ls)
    best, cut = min((work(ls[:i]) + work(ls[i:]), i) for i in range(1, len(ls))) if len(ls) > 1 else (whole, 0)
    return [order[:cut], order[cut:]] if best <= (1 - min_saving) * whole else [order]


class _NativeSegmentAttention(torch.autograd.Function):
    """The attention of `_segment_attention` as one compiled call each way (`native.NativeOps.segment_attention`:
    only the allowed pairs, float32 softmax, the backward recomputing it from the saved log-sum-exp).
    q [N, H, d], k, v [N, Hkv, d] -> [N, H, d]; layout: (row_start, prompt_ok, seg)."""

    @staticmethod
    def forward(ctx, q, k, v, layout, scale: float, ops):
        out, lse = ops.segment_attention(q, k, v, *layout, scale)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.layout, ctx.scale, ctx.ops = layout, scale, ops
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ops.segment_attention_backward(q, k, v, out, grad.contiguous(), lse, *ctx.layout, ctx.scale)
        return dq, dk, dv, None, None, None


def _segment_attention(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int, group_size: int):
    """Attention for the group rows of `_packed_groups(..., flat=True)`, end to end in one sequence, that
    computes only the pairs its mask allows: each prompt attends to itself, and each completion to its
    prompt plus its own earlier tokens. On the CPU with the compiled kernels, one call each way
    (`_NativeSegmentAttention`; faster than the torch ops, docs/speed.md); otherwise as torch ops, gathered as [B, Lmax] query blocks against
    [P + Lmax] keys (in two blocks by length when that saves work, `_length_split`).
    Returns attend(q [1, H, total, d], k, v [1, Hkv, total, d], scale) -> [1, H, total, d]."""
    B = input_ids.size(0)
    P, G, n, dev = input_ids.size(1) - completion_len, group_size, B // group_size, input_ids.device
    _, lengths, starts, row_start, total = _group_layout(attention_mask, completion_len, G, flat=True)
    p_attn = attention_mask[::G, :P].bool()                                      # [n, P]
    rows, t = attention_mask[:, P:].bool().nonzero(as_tuple=True)               # real answer tokens
    seg = torch.full((total,), -1, dtype=torch.long, device=dev)                # where each token's answer starts
    seg[row_start[rows // G] + starts[rows] + t] = starts[rows]
    layout = (torch.cat([row_start, row_start.new_tensor([total])]), p_attn.contiguous(), seg)
    biases = {}                                   # dtype -> additive masks (prompt, then each block), built once

    @functools.cache
    def written_out():
        """The torch ops' gathers and masks: the prompts' slots, their mask, the answers' query blocks."""
        group = torch.arange(B, device=dev) // G
        prompt_idx = (row_start[:, None] + torch.arange(P, device=dev)).view(-1)  # [n * P]
        blocks = [_query_blocks(rows, lengths, starts, row_start, group, p_attn, total)
                  for rows in _length_split(lengths, P)]
        return prompt_idx, causal_pad_mask(p_attn), blocks                      # mask [n, 1, P, P]

    def attend(q, k, v, scale):
        ops = _native_attention_ops(q)
        if ops is not None:                       # token-major [N, h, d]: the trunk's q, k, v are views of that
            q, k, v = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
            return _NativeSegmentAttention.apply(q, k, v, layout, scale, ops).transpose(0, 1)[None]
        prompt_idx, prompt_mask, blocks = written_out()
        H, d = q.size(1), q.size(-1)
        if q.dtype not in biases:                 # (only the CPU's written-out attention reads them)
            Hkv = k.size(1)
            biases[q.dtype] = [_attention_bias(m, Hkv, H // Hkv, q.dtype) if q.device.type == "cpu" else None
                               for m in [prompt_mask] + [blk.mask for blk in blocks]]
        prompt_bias, *block_bias = biases[q.dtype]

        def gather(x, index, rows):   # [1, h, total, d] -> [rows, h, len, d]; index_select: backward is index_add
            return x[0].transpose(0, 1).index_select(0, index).view(rows, -1, x.size(1), d).transpose(1, 2)

        kp, vp = gather(k, prompt_idx, n), gather(v, prompt_idx, n)             # [n, Hkv, P, d]
        o_prompt = _masked_attention(gather(q, prompt_idx, n), kp, vp, prompt_mask, scale, prompt_bias)  # [n, H, P, d]
        out = q.new_zeros(total, H, d).index_copy(0, prompt_idx, o_prompt.transpose(1, 2).reshape(n * P, H, d))
        for blk, bias in zip(blocks, block_bias):
            b = len(blk.group)
            ks = torch.cat([kp.index_select(0, blk.group), gather(k, blk.index, b)], 2)   # [b, Hkv, P + Lm, d]
            vs = torch.cat([vp.index_select(0, blk.group), gather(v, blk.index, b)], 2)
            o_seg = _masked_attention(gather(q, blk.index, b), ks, vs, blk.mask, scale, bias)   # [b, H, Lm, d]
            out = out.index_copy(0, blk.dest, o_seg.transpose(1, 2).reshape(-1, H, d).index_select(0, blk.keep))
        return out.transpose(0, 1)[None]                                         # [1, H, total, d]

    return attend


PACKED_MASK_BYTES = 256 * 2**20       # the packed layout's [n, 1, S, S] mask may not grow beyond this


def _pack_is_cheaper(config, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                     group_size: int) -> bool:
    """Estimated matmul + attention FLOPs: packed group rows vs shared prompt + padded completions."""
    costs = _layer_costs(config)
    if costs is None or getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False                                     # e.g. flash-attention kernels ignore custom masks
    if sliding_window(config):
        note_declined("packed log-prob rows", f"{config.model_type} attends within a sliding window, which a "
                                              "block mask of our own would replace")
        return False
    per_token, per_pair = costs
    B, T = input_ids.shape
    P, n = T - completion_len, B // group_size
    S = _group_layout(attention_mask, completion_len, group_size)[4] // n
    if n * S * S * 4 > PACKED_MASK_BYTES:
        return False
    packed = n * S * per_token + n * S * S * per_pair
    padded = (n * P + B * completion_len) * per_token + (n * P * P + B * completion_len * T) * per_pair
    return packed < padded


def logprob_path(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                 group_size: int = 1) -> str:
    """How `completion_logprobs` runs this batch: "packed-lean" (groups packed into one row each, lean
    trunk), "packed-mask" (packed, block mask), "shared-kv" (each prompt once, its KV cache repeated),
    "rows" (every row in full) or "full-logits" (no trunk/head split)."""
    decoder, _ = _decoder_and_head(model)
    if decoder is None or getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        return "full-logits"
    P = input_ids.shape[1] - completion_len
    shared = _groups_share_prompt(input_ids, attention_mask, P, group_size)
    # Gradient checkpointing turns the KV cache off in training mode, so the repeated-KV path needs it off.
    checkpointing = getattr(decoder, "gradient_checkpointing", False) and decoder.training
    # Llama-family models take the lean trunk, whose attention computes only the allowed pairs: packing
    # then never costs more than repeating the prompt's KV cache. Others pay S x S per packed row.
    if shared and not checkpointing and LeanDecoder.of(model) is not None:
        return "packed-lean"
    if shared and _pack_is_cheaper(decoder.config, input_ids, attention_mask, completion_len, group_size):
        return "packed-mask"
    return "shared-kv" if shared and not checkpointing else "rows"


def _rows(hidden: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """hidden [.., H] flattened to token rows, the rows `src` picks -> [N, H]. A group's completions all read
    their prompt's last token, so `src` repeats rows: index_select's backward adds the repeats in order,
    where `[src]` backs into an index_put whose parallel CPU kernel adds them in whatever order its
    threads finish (bits that change from run to run)."""
    return hidden.reshape(-1, hidden.size(-1)).index_select(0, src)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        temperature: float = 1.0, with_entropy: bool = False, chunk_rows: int = 4,
                        group_size: int = 1, entropy_grad: bool = False,
                        fp32_head: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the last `completion_len` tokens of each row (and their entropy). -> [B, Lc] each.

    Rows are [left-padded prompt | right-padded completion]; padding positions get 0. When rows come
    in groups of `group_size` sharing a prompt, each group's prompt runs once: each group is packed into
    one row of unpadded completions (`_packed_groups`; Llama-family models through the lean trunk with
    `_segment_attention`, others through a block mask when that costs fewer FLOPs), or else the
    prompt's KV cache is repeated to the rows. The LM head then runs only on real completion tokens,
    `chunk_rows * completion_len` at a time (`head_logprobs`). Models without a trunk/head split fall
    back to full logits. The entropy is detached unless `entropy_grad` (an entropy bonus in the loss).
    `fp32_head` (cast_lm_head_to_fp32): the LM head's matmul in float32 (on the full-logits path the model's
    own head module runs, in float32 where `grpo_core.model.policy` set that up).
    """
    ids = input_ids[:, -completion_len:]                                  # [B, Lc]
    decoder, head = _decoder_and_head(model)
    if decoder is None or getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        logits = completion_logits(model, input_ids, attention_mask, completion_len)
        return _full_logits_logprobs(logits, ids, attention_mask, temperature, with_entropy, entropy_grad)
    B, T = input_ids.shape
    P = T - completion_len
    rows, cols = attention_mask[:, P:].bool().nonzero(as_tuple=True)          # [N] real completion tokens
    path = logprob_path(model, input_ids, attention_mask, completion_len, group_size)
    if path == "packed-lean":
        use_packed_linears(model)                 # the forward's matmuls on the sampler's packed weights, if faster
        p_ids, p_pos, _, src = _packed_groups(input_ids, attention_mask, completion_len, group_size, None, flat=True)
        attend = _segment_attention(input_ids, attention_mask, completion_len, group_size)
        hidden = LeanDecoder.of(model).trunk(p_ids, p_pos, attend)             # [1, total, H]
        hidden = _rows(hidden, src)                                            # [N, H]
    elif path == "packed-mask":
        p_ids, p_pos, p_mask, src = _packed_groups(input_ids, attention_mask, completion_len, group_size,
                                                   head.weight.dtype)
        hidden = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos,
                         use_cache=False).last_hidden_state                    # [n, S, H]
        hidden = _rows(hidden, src)                                            # [N, H]
    elif path == "shared-kv":
        hidden = _shared_prompt_hidden(decoder, input_ids, attention_mask, completion_len, group_size)[rows, cols]
    else:
        position_ids = positions(attention_mask)     # [B, T]
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state                    # [B, T, H]
        hidden = hidden[:, P - 1:-1, :][rows, cols]                           # [N, H] predicts ids
    scale = getattr(model.config, "logits_scaling", None) if hasattr(model, "config") else None
    if scale:                                                             # e.g. Granite divides logits
        temperature = temperature * scale
    lp, ent = head_logprobs(hidden, head, ids[rows, cols], temperature, chunk_rows * completion_len, with_entropy,
                            entropy_grad=entropy_grad, fp32_head=fp32_head)
    logp = lp.new_zeros(B, completion_len).index_put((rows, cols), lp)       # [B, Lc]
    entropy = ent.new_zeros(B, completion_len).index_put((rows, cols), ent) if with_entropy else None
    return logp, entropy
