"""A lean sampling forward for Llama-family decoders (Llama, SmolLM2, Qwen2).

It calls the model's own modules and weights (embedding, norms, projections, rotary embedding, MLP, LM
head) directly, with a preallocated KV cache and one boolean key mask, and skips what transformers does
around them on every call (mask building, cache classes, kwargs plumbing, output objects). On a CPU
that machinery costs about as much as the matmuls of a one-token step of a 135M model. The RMSNorms,
SiLU gate and rotary embedding run as compiled autograd functions where they load (`trunk_ops`), and
LoRA linears as one autograd function (`lora_linear`); the same forward is the update's trunk.

Shapes: b rows, T cache length, H query heads, Hkv key/value heads (H = Hkv * rep), d head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_core.kernels.cpu_features import note_declined
from grpo_core.kernels.lora_linear import linear
from grpo_core.kernels.trunk_ops import gated_silu, rms_norm, rope

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def _unsupported(base) -> str | None:
    """Why the lean forward would not reproduce this (unwrapped) model, or None."""
    cfg = getattr(base, "config", None)
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"written for {', '.join(SUPPORTED_MODEL_TYPES)} only"
    for attr, what in (("use_sliding_window", "sliding-window attention"),
                       ("final_logit_softcapping", "logit soft-capping"), ("logits_scaling", "scaled logits"),
                       ("attention_dropout", "attention dropout")):             # we apply no attention dropout
        if getattr(cfg, attr, None):
            return what
    inner = getattr(base, "model", None)
    if not hasattr(base, "lm_head") or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm",
                                                                           "rotary_emb")):
        return "its modules are not laid out as Llama's"
    return None


def sliding_window(config) -> int | None:
    """The sliding window some layer of the model attends within (Mistral, Qwen2 with use_sliding_window, Gemma 3's
    sliding layers), or None."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None) or None


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Rotary positions of left-padded rows: 0 at each row's first real token. [b, T] -> [b, T]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def causal_pad_mask(valid: torch.Tensor) -> torch.Tensor:
    """Bool attention mask [b, 1, T, T] for left-padded rows valid [b, T]: causal over real keys; a
    pad query sees itself (never an empty row, which would give NaN)."""
    T = valid.size(-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()
    return ((causal & valid[:, None, :].bool()) | torch.eye(T, dtype=torch.bool, device=valid.device))[:, None]


@dataclass
class KVState:
    keys: list[torch.Tensor]        # per layer [b, Hkv, Tmax, d]
    values: list[torch.Tensor]
    valid: torch.Tensor             # [b, Tmax] bool: key may be attended (left padding is not)
    next_pos: torch.Tensor          # [b] rotary position of the next token
    length: int                     # cache slots filled (same for every row)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices may repeat: a shared prompt's cache copied to its group)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.valid, self.next_pos = self.valid[rows], self.next_pos[rows]


class LeanDecoder:
    """For sampling: prefill(ids, attention_mask, max_new) -> last logits; select(rows) keeps rows of
    the cache; step(tokens) -> next logits. For the update: trunk(ids, pos, attend) -> hidden states,
    differentiable, with the caller's attention."""

    def __init__(self, base):
        inner = base.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.head = base.lm_head
        attn = self.layers[0].self_attn
        self.d = attn.head_dim
        self.n_kv = base.config.num_key_value_heads
        self.rep = base.config.num_attention_heads // self.n_kv
        self.scale = attn.scaling
        self.silu = getattr(base.config, "hidden_act", None) == "silu"

    @classmethod
    def of(cls, model) -> "LeanDecoder | None":
        """The lean decoder for `model` (plain or PEFT-wrapped), or None when its architecture is not one
        this forward reproduces exactly (said once, with the reason: the model's own forward runs it)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if reason := _unsupported(base):
            kind = getattr(getattr(base, "config", None), "model_type", type(base).__name__)
            note_declined("lean and fused decoders", f"{kind}: {reason}; the model's own forward runs it")
            return None
        return cls(base)

    def _block(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """One decoder layer; attend(q [b, H, n, d], k, v [b, Hkv, n, d]) -> [b, H, n, d]. cos/sin: [b, n, d]."""
        attn = layer.self_attn
        b, n, _ = x.shape
        h = rms_norm(layer.input_layernorm, x)
        q = rope(linear(attn.q_proj, h).view(b, n, -1, self.d), cos, sin)                 # [b, H, n, d]
        k = rope(linear(attn.k_proj, h).view(b, n, -1, self.d), cos, sin)                 # [b, Hkv, n, d]
        v = linear(attn.v_proj, h).view(b, n, -1, self.d).transpose(1, 2)
        o = attend(q, k, v)                                                               # [b, H, n, d]
        x = x + linear(attn.o_proj, o.transpose(1, 2).reshape(b, n, -1))
        mlp, h = layer.mlp, rms_norm(layer.post_attention_layernorm, x)
        gate, up = linear(mlp.gate_proj, h), linear(mlp.up_proj, h)
        return x + linear(mlp.down_proj, gated_silu(gate, up) if self.silu else mlp.act_fn(gate) * up)

    def _cached_attention(self, i: int, state: KVState, mask: torch.Tensor, t0: int):
        """Attention that appends k/v to layer i's cache at slot t0 and attends over the filled slots."""
        def attend(q, k, v):
            b, _, n, _ = q.shape
            state.keys[i][:, :, t0:t0 + n] = k
            state.values[i][:, :, t0:t0 + n] = v
            keys, values = state.keys[i][:, :, :t0 + n], state.values[i][:, :, :t0 + n]  # [b, Hkv, T, d]
            if n == 1:
                # One query per head: the query heads sharing a KV head become that head's queries, so the
                # KV cache is never repeated. [b, Hkv, rep, d]
                o = F.scaled_dot_product_attention(q.reshape(b, self.n_kv, self.rep, self.d), keys, values,
                                                   attn_mask=mask, scale=self.scale)
                return o.reshape(b, self.n_kv * self.rep, 1, self.d)
            return F.scaled_dot_product_attention(q, keys.repeat_interleave(self.rep, 1),
                                                  values.repeat_interleave(self.rep, 1), attn_mask=mask, scale=self.scale)
        return attend

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, state: KVState, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                                                               # [b, n, C]
        cos, sin = self.rotary(x, pos)                                                    # [b, n, d]
        t0 = state.length
        for i, layer in enumerate(self.layers):
            x = self._block(layer, x, cos, sin, self._cached_attention(i, state, mask, t0))
        state.length = t0 + ids.size(1)
        return self.head(rms_norm(self.norm, x[:, -1]))                                   # [b, V]

    def trunk(self, ids: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        """Final hidden states [b, n, C] of ids [b, n] at positions pos [b, n], without a cache, with
        `attend(q [b, H, n, d], k, v [b, Hkv, n, d], scale) -> [b, H, n, d]` as the attention (e.g. one
        that knows which tokens may see which). Differentiable: the update's forward."""
        x = self.embed(ids)
        cos, sin = self.rotary(x, pos)
        for layer in self.layers:
            x = self._block(layer, x, cos, sin, lambda q, k, v: attend(q, k, v, self.scale))
        return rms_norm(self.norm, x)

    def prefill(self, ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Left-padded prompts ids/attention_mask [b, T] -> logits of the last position [b, V]; the KV
        cache (room for max_new_tokens more) is kept for `step`."""
        b, T = ids.shape
        Tmax = T + max_new_tokens
        dtype = self.embed.weight.dtype
        new = lambda: torch.zeros(b, self.n_kv, Tmax, self.d, dtype=dtype, device=ids.device)  # noqa: E731
        self.state = KVState([new() for _ in self.layers], [new() for _ in self.layers],
                             torch.zeros(b, Tmax, dtype=torch.bool, device=ids.device),
                             torch.zeros(b, dtype=torch.long, device=ids.device), 0)
        return self._prefill_into(self.state, ids, attention_mask)

    def _prefill_into(self, state: KVState, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Encode left-padded prompts ids/attention_mask [b, T] into an empty cache `state` (its first T slots) ->
        logits of the last position [b, V]."""
        state.valid[:, :ids.size(1)] = attention_mask.bool()
        pos = positions(attention_mask)                                                   # [b, T]
        state.next_pos[:] = pos[:, -1] + 1
        return self._forward(ids, pos, state, causal_pad_mask(attention_mask))

    def select(self, rows: torch.Tensor) -> None:
        self.state.select(rows)

    def step(self, tokens: torch.Tensor, idle: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b] at the next positions -> next-token logits [b, V]. Rows where idle [b] (bool) holds only
        pass: their token leaves no trace in the cache and their logits mean nothing."""
        state = self.state
        t = state.length
        self.reserve(1)
        state.valid[:, t] = True
        logits = self._forward(tokens[:, None], state.next_pos[:, None], state, state.valid[:, None, None, :t + 1])
        state.next_pos = state.next_pos + 1
        if idle is not None:
            state.valid[idle, t] = False
            state.next_pos = state.next_pos - idle.long()
        return logits

    def extend(self, chunk: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Feed each row the tokens of chunk [b, n] where active [b, n] holds (right-aligned: a row's tokens end
        the chunk), continuing its cache -> logits after its last token [b, V] (meaningless for a row with
        none). Later turns of a conversation go in this way, without re-encoding what came before."""
        state = self.state
        t0, n = state.length, chunk.size(1)
        self.reserve(n)
        state.valid[:, t0:t0 + n] = active
        pos = chunk_positions(state.next_pos, active)                                     # [b, n]
        logits = self._forward(chunk, pos, state, chunk_mask(state.valid[:, :t0 + n], n))
        state.next_pos = state.next_pos + active.sum(1)
        return logits

    def reserve(self, n: int) -> None:
        """Room in the cache for n more slots (it grows by at least half)."""
        state = self.state
        Tmax = state.valid.size(1)
        if state.length + n <= Tmax:
            return
        grown = max(state.length + n, Tmax + Tmax // 2)
        wider = lambda x: torch.cat([x, x.new_zeros(*x.shape[:2], grown - Tmax, *x.shape[3:])], 2)  # noqa: E731
        state.keys, state.values = [wider(k) for k in state.keys], [wider(v) for v in state.values]
        state.valid = torch.cat([state.valid, state.valid.new_zeros(state.valid.size(0), grown - Tmax)], 1)


def chunk_positions(next_pos: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Rotary positions [b, n] of a chunk's active tokens, continuing from next_pos [b] (the others: clamped
    copies, never read)."""
    return (next_pos[:, None] + active.long().cumsum(1) - 1).clamp(min=0)


def chunk_mask(valid: torch.Tensor, n: int) -> torch.Tensor:
    """Bool attention mask [b, 1, n, T] of a chunk filling the last n of T slots, valid [b, T]: each query sees
    the valid keys up to itself, and itself (an inactive query: never an empty row)."""
    T = valid.size(1)
    causal = torch.ones(n, T, dtype=torch.bool, device=valid.device).tril(T - n)            # [n, T]
    own = torch.zeros(n, T, dtype=torch.bool, device=valid.device)
    own[:, T - n:] = torch.eye(n, dtype=torch.bool, device=valid.device)
    return ((causal & valid[:, None, :]) | own)[:, None]
