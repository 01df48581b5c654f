"""GRPO math as small pure functions on tensors.

Notation: B = sequences in the batch (prompts x G), G = group size, L = completion length (padded),
V = vocabulary. Per-token ratio rho = exp(logp - old_logp); per-token loss
    -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * KL_k3(ref || pi)
aggregated over tokens according to `loss_type` (DeepSeekMath GRPO, BNPO, Dr. GRPO, DAPO).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """(r - group mean) / (std + eps), with the std of the group, of the batch, or none (Dr. GRPO).

    rewards: [B] with groups laid out contiguously (B = num_groups * group_size). Returns [B].
    """
    grouped = rewards.view(-1, group_size)                                # [B/G, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)                 # [B/G, G]
    if scale_rewards == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)      # unbiased std, as TRL
    elif scale_rewards == "batch":
        centred = centred / (rewards.std() + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    return centred.reshape(-1)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B/G] bool: groups whose rewards are all equal (they carry no learning signal)."""
    grouped = rewards.view(-1, group_size)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values).abs() < 1e-8


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


def _head_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of rows: hidden [b, L, H] -> (logp [b, L], entropy [b, L] or empty) via the LM head."""
    logits = F.linear(hidden, weight, bias)                               # [b, L, V]
    logp = token_logprobs(logits, ids, temperature)                       # [b, L]
    if not with_entropy:
        return logp, logp.new_zeros(0)
    with torch.no_grad():
        return logp, token_entropy(logits, temperature)


# Below this many bytes of full fp32 logits ([B, L, V]) the backward pass keeps them rather than
# recomputing each chunk's LM-head matmul (faster; e.g. 16 x 64 x 49k x 4 B = 200 MB).
KEEP_LOGITS_BYTES = 512 * 2**20


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                  temperature: float = 1.0, chunk_rows: int = 4, with_entropy: bool = False,
                  keep_logits_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) from final hidden states, `chunk_rows` sequences at a time.

    Only [chunk_rows, L, V] logits exist at once in the forward pass. With autograd on and full logits
    larger than `keep_logits_bytes`, each chunk is checkpointed: the backward pass recomputes that
    chunk's logits instead of keeping [B, L, V] of them alive.
    hidden: [B, L, H], weight: [V, H], ids: [B, L] -> logp [B, L], entropy [B, L] (detached) or None.
    """
    from torch.utils.checkpoint import checkpoint
    limit = KEEP_LOGITS_BYTES if keep_logits_bytes is None else keep_logits_bytes
    big = hidden.size(0) * hidden.size(1) * weight.size(0) * 4 > limit
    lps, ents = [], []
    for s in range(0, hidden.size(0), chunk_rows):
        args = (hidden[s:s + chunk_rows], weight, bias, ids[s:s + chunk_rows], temperature, with_entropy)
        if big and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _head_chunk(*args)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents).detach() if with_entropy else None)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0). [B, L]."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str,
              max_completion_length: int, num_tokens_in_batch: float | None = None) -> torch.Tensor:
    """Reduce a [B, L] per-token loss to a scalar as each published variant does.

    grpo:    mean over sequences of the per-sequence token mean (DeepSeekMath)
    bnpo:    token mean over this batch
    dr_grpo: token sum / (B * max_completion_length) (constant normaliser, Dr. GRPO)
    dapo:    token sum / number of completion tokens in the whole generation batch (DAPO)
    """
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * max_completion_length)
    if loss_type == "dapo":
        denom = mask.sum() if num_tokens_in_batch is None else torch.as_tensor(num_tokens_in_batch)
        return masked.sum() / denom.clamp(min=1)
    raise ValueError(f"loss_type must be grpo, bnpo, dr_grpo or dapo, not {loss_type!r}")


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, beta: float, epsilon_low: float,
              epsilon_high: float, loss_type: str, max_completion_length: int,
              num_tokens_in_batch: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate + beta * k3 KL. logp/old_logp/ref_logp/mask: [B, L]; advantages: [B].

    Returns the scalar loss and detached statistics (masked token means).
    """
    adv = advantages.unsqueeze(1)                                          # [B, 1]
    ratio = torch.exp(logp - old_logp)                                     # [B, L]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)        # [B, L]
    per_token = -torch.min(ratio * adv, clipped * adv)                     # [B, L]
    kl = None
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs")
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + beta * kl
    loss = aggregate(per_token, mask, loss_type, max_completion_length, num_tokens_in_batch)

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        mean = lambda x: ((x.float() * mask).sum() / n).item()
        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        stats = {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                 "clip_ratio/region_mean": mean(low | high), "kl": mean(kl) if kl is not None else 0.0}
    return loss, stats


def completion_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      completion_len: int) -> torch.Tensor:
    """Logits predicting the last `completion_len` tokens of each row. -> [B, Lc, V].

    Rows are [left-padded prompt | right-padded completion]; position ids follow the attention
    mask so the forward pass sees the same positions as generation did.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)     # [B, T]
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=completion_len + 1, use_cache=False)
    return out.logits[:, :-1, :]                                          # [B, Lc, V]


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
    p_pos = (p_attn.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=decoder.config)
    h_prompt = decoder(input_ids=p_ids, attention_mask=p_attn, position_ids=p_pos, past_key_values=cache,
                       use_cache=True).last_hidden_state                              # [B/G, P, H]
    cache.batch_repeat_interleave(group_size)                                       # KV -> [B, ., P, d]
    c_pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, P:]               # [B, Lc]
    h_comp = decoder(input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=c_pos,
                     past_key_values=cache, use_cache=True).last_hidden_state         # [B, Lc, H]
    h_last = h_prompt[:, -1:, :].repeat_interleave(group_size, dim=0)               # [B, 1, H] predicts token 0
    return torch.cat([h_last, h_comp[:, :-1, :]], dim=1)                             # [B, Lc, H]


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        temperature: float = 1.0, with_entropy: bool = False, chunk_rows: int = 4,
                        group_size: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the last `completion_len` tokens of each row (and their entropy). -> [B, Lc] each.

    Runs the decoder trunk once (each group's shared prompt only once when rows come in groups of
    `group_size` with the same prompt), then the LM head chunk by chunk (`head_logprobs`), so the full
    [B, Lc, V] logits never exist at once. Models without a trunk/head split fall back to full logits.
    """
    ids = input_ids[:, -completion_len:]                                  # [B, Lc]
    decoder, head = _decoder_and_head(model)
    if decoder is None or getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        logits = completion_logits(model, input_ids, attention_mask, completion_len)
        ent = token_entropy(logits.detach(), temperature) if with_entropy else None
        return token_logprobs(logits, ids, temperature), ent
    P = input_ids.size(1) - completion_len
    # Gradient checkpointing turns the KV cache off in training mode, so the shared-prompt path needs it off.
    checkpointing = getattr(decoder, "gradient_checkpointing", False) and decoder.training
    if not checkpointing and _groups_share_prompt(input_ids, attention_mask, P, group_size):
        hidden = _shared_prompt_hidden(decoder, input_ids, attention_mask, completion_len, group_size)
    else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)     # [B, T]
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state                    # [B, T, H]
        hidden = hidden[:, -completion_len - 1:-1, :]                         # [B, Lc, H] predicts ids
    scale = getattr(model.config, "logits_scaling", None) if hasattr(model, "config") else None
    if scale:                                                             # e.g. Granite divides logits
        temperature = temperature * scale
    return head_logprobs(hidden, head.weight, head.bias, ids, temperature, chunk_rows, with_entropy)
