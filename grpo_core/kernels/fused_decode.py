"""A sampling forward for Llama-family decoders built for memory bandwidth: a snapshot of the weights,
fused per layer (q|k|v in one matrix, gate|up in another), in one buffer on 2 MiB pages.

A decode step of a small model at a few dozen rows reads every weight once and does little arithmetic
per byte, so it runs at the speed memory delivers the weights. On virtual machines that speed depends on
the page size: with 4 KiB pages every few KiB of weight is a TLB miss with a two-level page walk, and
decode-shaped matmuls read their weights markedly slower than on 2 MiB pages (`bench/floor.py` measures
both; the figures are in docs/speed.md). Fusing halves the number of matmuls
per layer (7 -> 4) and the other per-token work is a handful of tensor ops per layer (fused RMSNorm,
rotary tables computed once per batch, one KV-cache write).

Which linear kernel reads the weights fastest here (plain rows on huge pages, oneDNN's packed layout, or
the compiled matmul's column blocks) is decided once per process by a short probe that streams synthetic
weights of the model's shapes through each kernel this CPU can run (`kernel_probes.linear_kernel`; `cpu_features`
says which can, and a kernel left out says why once), not by CPU vendor.

The fused base weights are built once and kept while the base does not change (under LoRA it never
does); each rollout takes only the adapter. In fp32 it is merged into a copy of the groups it touches
(W + B A, one addmm per group per rollout); in bf16 a merge would round a young adapter's small delta
away, so there its factors stay separate, stacked per group, and are rounded to bf16 as the update's
low-rank products round them (`lora_linear`), so sampler and update compute the same term.

A finished row leaves the step at once: the native step runs only the live rows, each addressing its own
row of the KV cache, which is never copied for it (on a CPU where 16 rows already make the matmuls bound
by arithmetic, a finished row's work is not free). A prompt that a group of rows shares stays in the cache
once: the native attention reads its slots from that row for every row of the group, which then finds
them in cache. The torch step runs every cache row (the prompt copied to each), and compacts the cache
when at most half are live. Same interface as `lean_decode.LeanDecoder`.

Shapes: b rows, n new tokens, T cache slots, H query heads, Hkv key/value heads (H = Hkv * rep), d head
dim, C hidden size, I MLP width, L layers.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo_core.kernels import native
from grpo_core.kernels.cpu_linear import onednn_linear, onednn_pack
from grpo_core.kernels.kernel_probes import linear_kernel, native_update_gemm, update_reason
from grpo_core.kernels.lean_decode import LeanDecoder, causal_pad_mask, chunk_mask, chunk_positions, positions
from grpo_core.kernels.lora_linear import Unsupported, lora_parts, reads_packed, set_packed
from grpo_core.kernels.pages import hugepage_empty

# -- the snapshot --------------------------------------------------------------------------------------------

def _linear_parts(module) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(base weight [out, in], bias, [(A [r, in], B*scale [out, r]) per active LoRA adapter]) of a linear,
    plain or wrapped by a PEFT LoRA layer (a merged or disabled adapter contributes no factors)."""
    base, factors = lora_parts(module)
    return base.weight, base.bias, [(A, B * scale) for A, B, scale in factors]


def _layer_parts(lean: LeanDecoder) -> list[list[list]]:
    """`_linear_parts` of every linear, per layer and per fused group (`GROUPS`); raises Unsupported."""
    return [[[_linear_parts(getattr(getattr(layer, block), name)) for name in names] for block, names in GROUPS]
            for layer in lean.layers]


@dataclass
class FusedLinear:
    weight: torch.Tensor                 # [out, in] in the snapshot buffer, oneDNN-packed, or in column blocks
    bias: torch.Tensor | None            # [out]
    lora_a: torch.Tensor | None          # [R, in] fp32, every adapter's A stacked
    lora_b: torch.Tensor | None          # [out, R] fp32, block-diagonal, scale folded in
    kernel: str = "plain"                # which matmul reads `weight` (linear_kernel)
    gemm: "native.NativeOps | None" = None   # for kernel "native"
    out_features: int = 0
    _lora_pack: "native.LoraPack | None" = None

    def lora_pack(self, ops: "native.NativeOps", dtype: torch.dtype) -> "native.LoraPack":
        """The factors as the compiled `lora_add` reads them, in the activations' dtype (packed on first use)."""
        if self._lora_pack is None:
            self._lora_pack = ops.lora_pack(self.lora_a.to(dtype), self.lora_b.to(dtype))
        return self._lora_pack

    def __call__(self, x: torch.Tensor, ops: "native.NativeOps | None" = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; `ops` adds the adapter's term in one compiled call."""
        if self.kernel == "native":
            y = self.gemm.packed_linear(x, self.weight, self.bias, self.out_features)
        elif self.kernel == "onednn":
            y = onednn_linear(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.lora_a is None:
            return y
        if ops is not None and ops.packed_linear_supported(x.dtype):
            ops.lora_add(x.reshape(-1, x.size(-1)), self.lora_pack(ops, x.dtype), y.view(-1, y.size(-1)))
        else:                          # as the update rounds it: x A^T to x's dtype, then the sum once
            u = F.linear(x.to(self.lora_a.dtype), self.lora_a).to(x.dtype)               # [..., R]
            y += F.linear(u.to(self.lora_b.dtype), self.lora_b)
        return y


def _factors(parts) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The LoRA factors of linears whose outputs are stacked: A [R, in] (every A stacked) and a
    block-diagonal B [sum out, R], fp32; (None, None) without an adapter."""
    ranks = [sum(A.size(0) for A, _ in factors) for _, _, factors in parts]
    if not sum(ranks):
        return None, None
    A = torch.cat([A.float() for _, _, factors in parts for A, _ in factors])
    B = torch.zeros(sum(w.size(0) for w, _, _ in parts), sum(ranks))
    row = col = 0
    for w, _, factors in parts:
        for _, Bi in factors:
            B[row:row + w.size(0), col:col + Bi.size(1)] = Bi.float()
            col += Bi.size(1)
        row += w.size(0)
    return A, B


def _bias(parts) -> torch.Tensor | None:
    if all(b is None for _, b, _ in parts):
        return None
    return torch.cat([b if b is not None else w.new_zeros(w.size(0)) for w, b, _ in parts])


@dataclass
class FusedLayer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: FusedLinear
    o: FusedLinear
    gate_up: FusedLinear
    down: FusedLinear


GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
          ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


@dataclass
class _FusedBase:
    """The base weights of every group, fused, in one huge-page buffer (or oneDNN-packed); kept across
    rollouts while the base weights stay the same tensors at the same version (always, under LoRA)."""
    key: tuple
    weights: list[list[tuple[torch.Tensor, torch.Tensor | None]]]    # per layer, per group: (weight, bias)
    head: tuple[torch.Tensor, torch.Tensor | None]
    kernel: str
    rates: dict


_BASES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fused_base(lean: LeanDecoder, parts: list[list[list]], head_parts: list, rows: int,
                any_kernel: bool = False) -> _FusedBase:
    """The fused base weights for the kernel the probe picks at `rows` rows (built, or kept from before while
    the weights are the same); `any_kernel`: the one kept from before whatever its kernel, if still valid."""
    dtype = lean.embed.weight.dtype
    # the same tensors with the same data (`module.to(dtype)` keeps the parameter, not its data) and version
    weights = tuple((id(w), w.data_ptr(), w.dtype, w._version) for layer in parts for group in layer
                    for w, _, _ in group) + tuple((id(w), w.data_ptr(), w.dtype, w._version) for w, _, _ in head_parts)
    cached = _BASES.get(lean.embed)
    if any_kernel and cached is not None and cached.key[:-1] == weights:
        return cached
    shapes = tuple((sum(w.size(0) for w, _, _ in g), g[0][0].size(1)) for g in parts[0])
    kernel, rates = linear_kernel(dtype, rows, shapes)
    key = weights + (kernel,)
    if cached is not None and cached.key == key:
        return cached
    gemm = native.load() if kernel == "native" else None
    groups = [group for layer in parts for group in layer] + [head_parts]
    numel = sum(_placed_numel(kernel, gemm, group) for group in groups)
    flat = hugepage_empty(numel, dtype) if kernel != "onednn" else None
    off = 0

    def place(group) -> tuple[torch.Tensor, torch.Tensor | None]:
        nonlocal off
        weights = [w for w, _, _ in group]                                       # stacked: [out, in]
        if kernel == "onednn":
            return onednn_pack(torch.cat(weights).to(dtype), rows), _bias(group)
        view = flat[off:off + _placed_numel(kernel, gemm, group)]
        off += view.numel()
        if kernel == "native":
            return gemm.pack(torch.cat(weights).to(dtype), view), _bias(group)
        return torch.cat(weights, out=view.view(-1, weights[0].size(1))), _bias(group)   # plain: stacked in place

    base = _FusedBase(key, [[place(g) for g in layer] for layer in parts], place(head_parts), kernel, rates)
    _BASES[lean.embed] = base
    return base


def _placed_numel(kernel: str, gemm, group) -> int:
    """Elements a group's fused weight takes in the snapshot buffer (column blocks are padded to 16)."""
    out, inp = sum(w.size(0) for w, _, _ in group), group[0][0].size(1)
    return gemm.packed_numel(out, inp) if kernel == "native" else out * inp


# -- the update's forward on the same weights -----------------------------------------------------------------

def _base_groups(lean: LeanDecoder) -> list[list[torch.nn.Linear]]:
    """The base linears of every layer's fused groups (`GROUPS`), then the LM head's; raises Unsupported."""
    modules = [[lora_parts(getattr(getattr(layer, block), name))[0] for name in names]
               for layer in lean.layers for block, names in GROUPS]
    return modules + [[lora_parts(lean.head)[0]]]


def _layer_shapes(groups: list[list[torch.nn.Linear]]) -> tuple[tuple[int, int], ...]:
    """[out, in] of one layer's base linears (the first len(GROUPS) groups), what the update probe times."""
    return tuple(tuple(m.weight.shape) for g in groups[:len(GROUPS)] for m in g)


def update_linears(model) -> str:
    """What the update's frozen base linears multiplied with in their last forward, for the run's records: the
    compiled matmul on the sampler's packed weights ("native"), oneDNN's packed fp32 weights ("onednn",
    `cpu_linear`) or torch's matmul, how many of the base linears, and what decided it (the probe's median
    seconds per candidate, or the `kernels.update_linear` setting). The kernels round bf16 differently, so two
    runs that took different ones diverge after their first update."""
    from grpo_core.kernels.cpu_linear import PackedLinear
    lean = LeanDecoder.of(model)
    try:
        bases_by_group = _base_groups(lean) if lean is not None else []
    except Unsupported:
        bases_by_group = []
    bases = [m for g in bases_by_group for m in g]
    if not bases:
        return "torch (no Llama-family decoder the packed paths read)"
    native_n = sum(reads_packed(m) for m in bases)
    onednn_n = sum(isinstance(m, PackedLinear) for m in bases)
    kernel, n = ("native", native_n) if native_n else ("onednn", onednn_n) if onednn_n else ("torch", len(bases))
    why = update_reason(lean.embed.weight.dtype, _layer_shapes(bases_by_group))
    return f"{kernel} ({n} of {len(bases)} base linears{'; ' + why if why else ''})"


def use_packed_linears(model) -> int:
    """Let the base linears of a Llama-family model's layers and LM head multiply on the sampler's packed
    weights in their forward (`lora_linear.set_packed`: views into the fused base buffer, no copy), where the
    base is frozen bf16 (LoRA), the compiled matmul beats torch's at the update's row counts here
    (`native_update_gemm`) and the fused base reads it; else they keep (or go back to) torch's. A linear of
    a stacked group whose weight does not start on a 16-column block keeps torch's. -> how many linears read
    packed weights."""
    lean = LeanDecoder.of(model)
    if lean is None or lean.embed.weight.device.type != "cpu":
        return 0
    dtype = lean.embed.weight.dtype
    try:
        groups = _base_groups(lean)
    except Unsupported:
        return 0
    everything = [m for g in groups for m in g]
    # bf16 only (in fp32 the update's frozen weights are oneDNN-packed already, as fast here); a trained base
    # (full fine-tuning) changes every step, so its packs would be rebuilt every update
    use = dtype == torch.bfloat16 and all(m.weight.dtype == dtype and not m.weight.requires_grad for m in everything) \
        and native_update_gemm(dtype, _layer_shapes(groups))
    base = None
    if use:
        with torch.no_grad():            # the sampler's base as it is (its probe ran at the rows it decodes)
            base = _fused_base(lean, _layer_parts(lean), [_linear_parts(lean.head)], 16, any_kernel=True)
    if base is None or base.kernel != "native":
        for m in everything:
            set_packed(m, None, None)
        return 0
    ops, n = native.load(), 0
    packs = [wb for layer in base.weights for wb in layer] + [base.head]
    for group, (packed, _) in zip(groups, packs):
        row = 0                                  # the group is packed as one stacked [sum out, in] weight
        for m in group:
            start = row * m.in_features
            if row % 16 == 0:                    # starts a column block: its blocks are a slice of the group's
                set_packed(m, packed[start:start + ops.packed_numel(m.out_features, m.in_features)], ops)
                n += 1
            else:
                set_packed(m, None, None)
            row += m.out_features
    return n


class FusedDecoder:
    """prefill(ids, attention_mask, max_new) -> last logits [b, V]; select(rows); step(tokens) -> logits."""

    def __init__(self, lean: LeanDecoder, layers: list[FusedLayer], head: FusedLinear, eps: float, width: int,
                 kernel: str, rates: dict):
        self.lean, self.layers, self.head, self.eps, self.width = lean, layers, head, eps, width
        self.embed, self.rotary = lean.embed, lean.rotary
        self.d, self.n_kv, self.rep, self.scale = lean.d, lean.n_kv, lean.rep, lean.scale
        self.n_q = self.n_kv * self.rep
        self.kernel, self.rates = kernel, rates
        norms = [w for layer in layers for w in (layer.ln1, layer.ln2)] + [lean.norm.weight]
        dtype = self.embed.weight.dtype
        native_ok = dtype in (torch.float32, torch.bfloat16) and all(
            w.dtype == dtype and w.is_contiguous() for w in norms)
        self.ops = native.load() if native_ok else None      # the step's small ops compiled for this CPU
        self.next_norms = [layer.ln1 for layer in layers[1:]] + [lean.norm.weight]   # the RMSNorm after each layer
        self.table = self._layer_table()

    def _layer_table(self) -> torch.Tensor | None:
        """For `NativeOps.decode_layers`: per layer, each linear's (packed weight, bias, LoRA A, LoRA B's blocks and
        their first rank rows, rank, block rank, out features) as pointers and sizes, then its post-attention
        norm and the norm after it. None unless every linear reads the compiled matmul's packed weights (the
        tensors stay alive in self.layers)."""
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if self.ops is None or any(lin.kernel != "native" for lin in linears):
            return None
        dtype = self.embed.weight.dtype

        def fields(lin: FusedLinear) -> list[int]:
            if lin.lora_a is None:
                return [lin.weight.data_ptr(), native._ptr(lin.bias) or 0, 0, 0, 0, 0, 0, lin.out_features]
            lora = lin.lora_pack(self.ops, dtype)
            return [lin.weight.data_ptr(), native._ptr(lin.bias) or 0, lora.a.data_ptr(), lora.blocks.data_ptr(),
                    lora.k0.data_ptr(), lora.rank, lora.block_rank, lin.out_features]

        rows = [[f for lin in (layer.qkv, layer.o, layer.gate_up, layer.down) for f in fields(lin)]
                + [layer.ln2.data_ptr(), next_norm.data_ptr()]
                for layer, next_norm in zip(self.layers, self.next_norms)]
        return torch.tensor(rows, dtype=torch.int64)

    @property
    def path(self) -> str:
        dtype = str(self.embed.weight.dtype).removeprefix("torch.")
        rates = ", ".join(f"{k} {v:.1f} GB/s" for k, v in self.rates.items())
        ops = "native" if self.ops else "torch"
        kernel = self.kernel
        if kernel == "native" and self.layers[0].qkv.gemm.packed_linear_tiles(self.embed.weight.dtype):
            kernel = "native (AMX tiles)"
        return f"fused {dtype} decode, {kernel} linears (probe: {rates}), {ops} step ops"

    @classmethod
    @torch.no_grad()
    def snapshot(cls, model, rows: int = 16) -> "FusedDecoder | None":
        """The model's current weights (adapter included); None where only the lean forward applies."""
        lean = LeanDecoder.of(model)
        if lean is None:
            return None
        cfg = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
        if getattr(cfg, "hidden_act", "silu") != "silu" or lean.embed.weight.device.type != "cpu":
            return None
        try:
            parts, head_parts = _layer_parts(lean), [_linear_parts(lean.head)]
        except Unsupported:
            return None
        base = _fused_base(lean, parts, head_parts, rows)
        kernel = base.kernel
        gemm = native.load() if kernel == "native" else None
        # fp32 in the huge-page buffer: the adapter is merged into a copy of the groups it touches (one addmm
        # each per rollout, instead of two extra matmuls per group per token)
        merge = kernel != "onednn" and base.head[0].dtype == torch.float32
        every = [(wb, g) for layer_wb, layer_g in zip(base.weights, parts) for wb, g in zip(layer_wb, layer_g)]
        adapted = [wb for wb, g in every + [(base.head, head_parts)] if merge and any(f for _, _, f in g)]
        scratch = hugepage_empty(sum(w.numel() for w, _ in adapted), torch.float32) if adapted else None
        off = 0

        def linear(weight_bias, group) -> FusedLinear:
            nonlocal off
            A, B = _factors(group)
            weight, bias = weight_bias
            out = sum(w.size(0) for w, _, _ in group)
            if A is None or not merge:          # rounded to the weights' dtype, as the update rounds them
                dtype = lean.embed.weight.dtype
                return FusedLinear(weight, bias, *(None if f is None else f.to(dtype).float() for f in (A, B)), kernel,
                                   gemm, out)
            merged = scratch[off:off + weight.numel()]
            off += weight.numel()
            if kernel == "native":                 # W + B A in rows, then into column blocks
                plain = torch.addmm(torch.cat([w for w, _, _ in group]), B, A)
                return FusedLinear(gemm.pack(plain, merged), bias, None, None, kernel, gemm, out)
            return FusedLinear(torch.addmm(weight, B, A, out=merged.view_as(weight)), bias, None, None)

        layers = [FusedLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                             *[linear(wb, g) for wb, g in zip(weights, groups)])
                  for layer, weights, groups in zip(lean.layers, base.weights, parts)]
        eps = lean.layers[0].input_layernorm.variance_epsilon
        width = parts[0][2][0][0].size(0)
        return cls(lean, layers, linear(base.head, head_parts), eps, width, base.kernel, base.rates)

    # -- the forward ------------------------------------------------------------------------------------------

    def _rope_tables(self, n_pos: int, dtype: torch.dtype) -> None:
        """cos and sign-folded sin [P, d] of every position the batch can reach (x*cos + roll(x)*sin_signed
        is Llama's x*cos + rotate_half(x)*sin)."""
        probe = torch.zeros(1, 1, self.d, dtype=dtype)
        cos, sin = self.rotary(probe, torch.arange(n_pos)[None])                          # [1, P, d]
        half = self.d // 2
        self.cos = cos[0].contiguous()
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    def _layer(self, i: int, layer: FusedLayer, x: torch.Tensor, cos, sin, mask, t0: int) -> torch.Tensor:
        b, n, C = x.shape
        H, Hkv, d = self.n_q, self.n_kv, self.d
        qkv = layer.qkv(F.rms_norm(x, (C,), layer.ln1, self.eps), self.ops)             # [b, n, (H+2Hkv)d]
        qk = qkv[..., :(H + Hkv) * d].view(b, n, H + Hkv, d)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)                            # rotary on q and k
        cache = self.kv[i]                                                                 # [2, b, Hkv, T, d]
        keys_t = cache[0].view(b, Hkv, d, -1)                                              # [b, Hkv, d, T]
        keys_t[..., t0:t0 + n] = qk[:, :, H:].permute(0, 2, 3, 1)
        cache[1, :, :, t0:t0 + n] = qkv[..., (H + Hkv) * d:].view(b, n, Hkv, d).transpose(1, 2)
        keys, values = keys_t[..., :t0 + n].transpose(2, 3), cache[1, :, :, :t0 + n]       # [b, Hkv, t, d]
        if n == 1:               # the query heads sharing a KV head become its queries: [b, Hkv, rep, d]
            q = qk[:, 0, :H].reshape(b, Hkv, self.rep, d)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        else:
            q = qk[:, :, :H].transpose(1, 2)                                               # [b, H, n, d]
            o = F.scaled_dot_product_attention(q, keys.repeat_interleave(self.rep, 1),
                                               values.repeat_interleave(self.rep, 1), attn_mask=mask, scale=self.scale)
            o = o.transpose(1, 2)                                                          # [b, n, H, d]
        x = x + layer.o(o.reshape(b, n, H * d), self.ops)
        gate, up = layer.gate_up(F.rms_norm(x, (C,), layer.ln2, self.eps), self.ops).split(self.width, -1)
        return x + layer.down(F.silu(gate) * up, self.ops)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                                                                # [b, n, C]
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]                   # [b, n, 1, d]
        t0 = self.length
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, cos, sin, mask, t0)
        self.length = t0 + ids.size(1)
        return self.head(F.rms_norm(x[:, -1], (x.size(-1),), self.lean.norm.weight, self.eps), self.ops)   # [b, V]

    def _native_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per live row [b] -> logits [b, V], row r at cache row self.live[r]; every layer in one
        compiled call where all linears read packed weights (`decode_layers`), else the work between a layer's
        linears in compiled calls (native.NativeOps): add + RMSNorm, rotary + KV write, attention, SiLU gate,
        the adapter's low-rank terms."""
        ops, eps, t, slots = self.ops, self.eps, self.length, self.live
        pos = self.next_pos[slots]                                                         # [b]
        x = self.embed(tokens)                                                             # [b, C] residual
        h = torch.empty_like(x)                                                            # [b, C] normed
        ops.add_rms_norm(x, None, self.layers[0].ln1, h, eps)
        if self.table is not None:
            ops.decode_layers(self.table, x, h, self.kv, self.cos, self.sin, pos, self.valid, t, self.scale, eps,
                              self.n_q, slots, self.prefix, self.split)
        else:
            q = x.new_empty(x.size(0), self.n_q * self.d)                                  # [b, H d]
            o, act = torch.empty_like(q), x.new_empty(x.size(0), self.width)
            for i, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms)):
                ops.rope_cache(layer.qkv(h, ops), self.cos, self.sin, pos, q, self.kv[i], self.n_q, t, slots)
                ops.decode_attention(q, self.kv[i], self.valid, t + 1, self.scale, o, slots, self.prefix, self.split)
                ops.add_rms_norm(x, layer.o(o, ops), layer.ln2, h, eps)
                ops.add_rms_norm(x, layer.down(ops.silu_mul(layer.gate_up(h, ops), act), ops), next_norm, h, eps)
        self.length = t + 1
        return self.head(h, ops)                                                           # [b, V]

    def _new_cache(self, b: int, T: int) -> torch.Tensor:
        """[L, 2, b, Hkv, T, d]: per layer the keys, each head's [T, d] block holding them transposed
        ([d, T], as the compiled attention reads them), then the values."""
        L = len(self.layers)
        flat = hugepage_empty(L * 2 * b * self.n_kv * T * self.d, self.embed.weight.dtype)
        return flat.view(L, 2, b, self.n_kv, T, self.d)

    def prefill(self, ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        b, T = ids.shape
        self.T = T + max_new_tokens
        self.kv = self._new_cache(b, self.T)
        self.valid = torch.zeros(b, self.T, dtype=torch.bool)
        self.valid[:, :T] = attention_mask.bool()
        pos = positions(attention_mask)                                                    # [b, T]
        self._rope_tables(int(pos.max()) + max_new_tokens + 2, self.embed.weight.dtype)
        self.next_pos, self.length = pos[:, -1] + 1, 0
        self.live = torch.arange(b)                  # the physical cache row of each row the caller sees
        self.prefix, self.split = None, 0            # (native step) its shared prompt's row, and that prompt's end
        return self._forward(ids, pos, causal_pad_mask(attention_mask))

    def select(self, rows: torch.Tensor) -> None:
        """Keep the caller's `rows` (indices may repeat: a prompt shared by a group). For the native step a
        repeated prompt stays in the cache once and each row gets a cache row of its own for its new tokens;
        the torch step copies the prompt to each row. Otherwise rows are copied out of the cache only for the
        torch step (which runs every cache row), when at most half stay live."""
        live = self.live[rows]
        prefix = None if self.prefix is None else self.prefix[rows]
        repeats = len(live) > len(self.live) or live.unique().numel() < len(live)
        if repeats and self.ops is not None and self.prefix is None:
            U, n = self.kv.size(2), len(live)
            kv = self._new_cache(U + n, self.T)
            kv[:, :, :U] = self.kv
            self.kv, self.valid = kv, torch.cat([self.valid, self.valid[live]])
            self.next_pos = torch.cat([self.next_pos, self.next_pos[live]])
            self.live, self.prefix, self.split = U + torch.arange(n), live, self.length
        elif repeats or (self.ops is None and 2 * len(live) <= self.kv.size(2)):
            self._copy_rows(live, prefix)
        else:
            self.live, self.prefix = live, prefix

    def _copy_rows(self, live: torch.Tensor, prefix: torch.Tensor | None) -> None:
        """A cache of these rows alone, each whole (its shared prompt's slots copied in)."""
        L, n, s, d = len(self.layers), len(live), self.split, self.d
        kv = self._new_cache(n, self.T)
        torch.index_select(self.kv, 2, live, out=kv)
        if prefix is not None and s:
            shared = self.kv.index_select(2, prefix)                                       # [L, 2, n, Hkv, T, d]
            kv[:, 0].view(L, n, self.n_kv, d, -1)[..., :s] = shared[:, 0].view(L, n, self.n_kv, d, -1)[..., :s]
            kv[:, 1, :, :, :s] = shared[:, 1, :, :, :s]
        self.kv, self.valid, self.next_pos = kv, self.valid[live], self.next_pos[live]
        self.live, self.prefix, self.split = torch.arange(n), None, 0

    def step(self, tokens: torch.Tensor, idle: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [live rows] -> next-token logits [live rows, V]. Rows where idle [live rows] (bool) holds only
        pass: their token leaves no trace in the cache and their logits mean nothing."""
        t = self.length
        self.reserve(1)
        self.valid[:, t] = True
        if self.ops is not None:
            logits = self._native_step(tokens)
        else:                                        # every cache row, then the live ones
            b = self.kv.size(2)
            full = tokens if b == len(self.live) else torch.zeros(b, dtype=tokens.dtype).index_copy_(0, self.live,
                                                                                                      tokens)
            logits = self._forward(full[:, None], self.next_pos[:, None], self.valid[:, None, None, :t + 1])
            logits = logits if b == len(self.live) else logits[self.live]
        self.next_pos = self.next_pos + 1
        if idle is not None:
            parked = self.live[idle]
            self.valid[parked, t] = False
            self.next_pos[parked] -= 1
        return logits

    def extend(self, chunk: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Feed each row the tokens of chunk [live rows, n] where active holds (right-aligned), continuing its
        cache -> logits after its last token [live rows, V] (see LeanDecoder.extend). Runs the torch forward
        over whole rows: a shared prompt is first copied into each row's cache."""
        if self.prefix is not None or len(self.live) != self.kv.size(2) or not bool(
                (self.live == torch.arange(len(self.live))).all()):
            self._copy_rows(self.live, self.prefix)
        t0, n = self.length, chunk.size(1)
        self.reserve(n)
        self.valid[:, t0:t0 + n] = active
        pos = chunk_positions(self.next_pos, active)                                       # [b, n]
        logits = self._forward(chunk, pos, chunk_mask(self.valid[:, :t0 + n], n))
        self.next_pos = self.next_pos + active.sum(1)
        return logits

    def reserve(self, n: int) -> None:
        """Room for n more slots in the cache (it grows by at least half), and in the rotary tables: a position
        advances at most once per slot, so they reach as far as the slots."""
        if self.length + n <= self.T:
            return
        T, grown = self.T, max(self.length + n, self.T + self.T // 2)
        self._rope_tables(grown + 2, self.embed.weight.dtype)
        L, _, b, Hkv, _, d = self.kv.shape
        kv = self._new_cache(b, grown)
        kv[:, 0].view(L, b, Hkv, d, grown)[..., :T] = self.kv[:, 0].view(L, b, Hkv, d, T)     # keys: [d, T] blocks
        kv[:, 1, :, :, :T] = self.kv[:, 1]
        self.kv, self.T = kv, grown
        self.valid = torch.cat([self.valid, self.valid.new_zeros(b, grown - T)], 1)
