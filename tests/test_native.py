"""The compiled ops (grpo_core/kernels/native.py): each decode-step op and the update's logit sweep equals
the same arithmetic in torch ops at the default model's shapes, in fp32 and bf16, with masked keys and rows
at different positions, rows that address cache rows of their own (slots), and
a prompt shared from one cache row; the sampler's draw;
the build is cached per source and CPU and written atomically; a failed build names the compiler's
error; without a compiler loading says why, and sampling keeps torch ops (as with kernels.native: false)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from grpo_core.kernels import cpu_features, native
from tests.conftest import needs_cpu, skip_unless_cpu, use_kernels

ROOT = Path(__file__).resolve().parents[1]
needs_compiler = needs_cpu("native_ops")                # CI installs g++

# SmolLM2-135M: hidden 576, 9 query heads over 3 key/value heads of 64, MLP 1536
b, H, Hkv, d, C, I, T = 5, 9, 3, 64, 576, 1536, 40


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, terms: int = 1024) -> None:
    """Equal to an ulp or two of the stored result; in fp32 the rounding of a sum grows with its `terms`
    (a 10k-long dot product summed in another order than torch's differs by ~5e-5 on values of ~17)."""
    tol = 1e-5 * max(1.0, terms / 1024) if dtype == torch.float32 else 1 / 64
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()


def _lora_term(x, A, B, dtype):
    """(x A^T) B^T as the update computes it: the factors and x A^T rounded to the dtype."""
    return (x.float() @ A.to(dtype).float().T).to(dtype).float() @ B.to(dtype).float().T


def _check_lora_add(ops, x, rand, dtype):
    g = torch.Generator().manual_seed(1)
    A, B, out = torch.randn(48, C, generator=g) * 0.1, torch.randn(960, 48, generator=g) * 0.1, rand(x.size(0), 960)
    lora = ops.lora_pack(A.to(dtype), B.to(dtype))
    assert (lora.rank, lora.block_rank) == (48, 48) and lora.k0.tolist() == [0] * 60
    _close(ops.lora_add(x, lora, out.clone()), out.float() + _lora_term(x, A, B, dtype), dtype)
    # a stacked q|k|v group's block-diagonal B (outputs 40 | 24 | 22, ranks 16 each; blocks straddle two
    # adapters, the last is partial): each 16-column block keeps only the rank rows it uses
    B = torch.block_diag(*(torch.randn(n, 16, generator=g) * 0.1 for n in (40, 24, 22))).to(dtype)
    A, out = (torch.randn(48, C, generator=g) * 0.1).to(dtype), rand(x.size(0), 86)
    lora = ops.lora_pack(A, B)
    assert lora.block_rank == 32 and lora.k0.tolist() == [0, 0, 0, 16, 16, 16]
    assert lora.blocks.numel() == 6 * 16 * 32
    _close(ops.lora_add(x, lora, out.clone()), out.float() + _lora_term(x, A, B, dtype), dtype)
    # the blocks: each output column's 32 rank rows from its block's k0, laid out as `pack` lays out a weight
    rows = torch.stack([B[n, lora.k0[n // 16]:lora.k0[n // 16] + 32] for n in range(86)])
    assert torch.equal(lora.blocks, ops.pack(rows, rows.new_empty(ops.packed_numel(86, 32))))
    # an odd rank gets a zero rank row; a rank past 16 and an output past 16 have partial blocks
    A, B, out = rand(5, C, std=0.1), rand(37, 5, std=0.1), rand(x.size(0), 37)
    lora = ops.lora_pack(A, B)
    assert (lora.rank, lora.block_rank) == (6, 6)
    _close(ops.lora_add(x, lora, out.clone()), out.float() + _lora_term(x, A, B, dtype), dtype)
    A, B, out = rand(40, C, std=0.1), rand(37, 40, std=0.1), rand(x.size(0), 37)
    _close(ops.lora_add(x, ops.lora_pack(A, B), out.clone()), out.float() + _lora_term(x, A, B, dtype), dtype)
    zero = ops.lora_pack(A, torch.zeros_like(B))                        # a fresh adapter: nothing to add
    assert zero.block_rank == 0 and torch.equal(ops.lora_add(x, zero, out.clone()), out)
    with pytest.raises(ValueError, match="do not match"):
        ops.lora_pack(A, B[:, :8])


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_op_equals_torch_at_the_models_shapes(dtype):
    ops = native.load()
    assert ops is not None
    g = torch.Generator().manual_seed(0)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    x, y, w = rand(b, C), rand(b, C), rand(C)
    want_x = x + y
    normed = ops.add_rms_norm(x, y, w, torch.empty_like(x), 1e-5)
    _close(x, want_x, dtype)
    _close(normed, F.rms_norm(want_x.float(), (C,), w.float(), 1e-5), dtype)
    _close(ops.add_rms_norm(x, None, w, torch.empty_like(x), 1e-5), F.rms_norm(x.float(), (C,), w.float(), 1e-5),
           dtype)

    qkv, pos, t = rand(b, (H + 2 * Hkv) * d), torch.tensor([0, 3, 17, 30, 31]), 33
    angles = torch.arange(64)[:, None] * (1e4 ** (-torch.arange(d // 2) / (d // 2)))[None]   # [P, d/2]
    cos, sin = angles.cos().repeat(1, 2).to(dtype), angles.sin().repeat(1, 2).to(dtype)
    signed = torch.cat([-sin[:, :d // 2], sin[:, d // 2:]], -1)
    cache = rand(2, b, Hkv, T, d)
    q = ops.rope_cache(qkv, cos, signed, pos, torch.empty(b, H * d, dtype=dtype), cache, H, t)
    heads = qkv[:, :(H + Hkv) * d].view(b, H + Hkv, d).float()
    half = torch.cat([-heads[..., d // 2:], heads[..., :d // 2]], -1)          # Llama's rotate_half
    rotated = heads * cos[pos, None].float() + half * sin[pos, None].float()
    _close(q.view(b, H, d), rotated[:, :H], dtype)
    _close(cache[0].view(b, Hkv, d, T)[..., t], rotated[:, H:], dtype)       # keys transposed: [d, T] per head
    assert torch.equal(cache[1, :, :, t], qkv[:, (H + Hkv) * d:].view(b, Hkv, d))

    valid = torch.rand(b, T, generator=g) > 0.4
    valid[:, t] = True
    attn = ops.decode_attention(q, cache, valid, t + 1, 0.125, torch.empty_like(q))
    keys = cache[0].view(b, Hkv, d, T)[..., :t + 1].transpose(2, 3)
    want = F.scaled_dot_product_attention(q.view(b, Hkv, H // Hkv, d).float(), keys.float(),
                                          cache[1, :, :, :t + 1].float(), attn_mask=valid[:, None, None, :t + 1],
                                          scale=0.125)
    _close(attn, want.reshape(b, H * d), dtype)

    if ops.packed_linear_supported(dtype):
        _check_lora_add(ops, x, rand, dtype)

    gate_up = rand(b, 2 * I)
    _close(ops.silu_mul(gate_up, torch.empty(b, I, dtype=dtype)), F.silu(gate_up[:, :I].float()) * gate_up[:, I:].float(),
           dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_address_their_own_cache_rows_through_slots(dtype):
    """A step of fewer rows than the cache holds: row r writes and reads cache row slots[r]; the others
    are untouched. Same results as the rows gathered into a cache of their own."""
    ops = native.load()
    g = torch.Generator().manual_seed(1)
    B, t, slots = 7, 21, torch.tensor([6, 1, 4])
    qkv = torch.randn(len(slots), (H + 2 * Hkv) * d, generator=g).to(dtype)
    cos, sin = (torch.randn(32, d, generator=g).to(dtype) for _ in range(2))
    pos = torch.tensor([3, 20, 9])
    cache, valid = torch.randn(2, B, Hkv, T, d, generator=g).to(dtype), torch.rand(B, T, generator=g) > 0.3
    valid[:, t] = True
    own_cache, own_valid = cache[:, slots].clone(), valid[slots].clone()
    before = cache.clone()
    q = ops.rope_cache(qkv, cos, sin, pos, torch.empty(3, H * d, dtype=dtype), cache, H, t, slots)
    own_q = ops.rope_cache(qkv, cos, sin, pos, torch.empty(3, H * d, dtype=dtype), own_cache, H, t)
    assert torch.equal(q, own_q) and torch.equal(cache[:, slots], own_cache)
    others = [r for r in range(B) if r not in slots.tolist()]
    assert torch.equal(cache[:, others], before[:, others])
    out = ops.decode_attention(q, cache, valid, t + 1, 0.125, torch.empty_like(q), slots)
    assert torch.equal(out, ops.decode_attention(q, own_cache, own_valid, t + 1, 0.125, torch.empty_like(q)))
    with pytest.raises(ValueError, match="slots"):
        ops.decode_attention(q, cache, valid, t + 1, 0.125, torch.empty_like(q))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [16, 19])
def test_a_shared_prompt_is_read_from_its_own_cache_row(dtype, split):
    """Rows whose slots before `split` live in a prompt row (prefix) attend as if the prompt were copied
    into their own rows; the split on a 16-key block boundary and inside one."""
    ops = native.load()
    g = torch.Generator().manual_seed(2)
    B, n = 6, 33
    q = torch.randn(4, H * d, generator=g).to(dtype)
    cache, valid = torch.randn(2, B, Hkv, T, d, generator=g).to(dtype), torch.rand(B, T, generator=g) > 0.2
    slots, prefix = torch.tensor([2, 3, 4, 5]), torch.tensor([0, 0, 1, 0])
    whole = cache.clone()                                        # each row with its prompt copied in
    for r, p in zip(slots.tolist(), prefix.tolist()):
        whole[0, r].view(Hkv, d, T)[..., :split] = cache[0, p].view(Hkv, d, T)[..., :split]
        whole[1, r, :, :split] = cache[1, p, :, :split]
    got = ops.decode_attention(q, cache, valid, n, 0.125, torch.empty_like(q), slots, prefix, split)
    want = ops.decode_attention(q, whole, valid, n, 0.125, torch.empty_like(q), slots)
    assert torch.equal(got, want)
    keys = whole[0].view(B, Hkv, d, T)[slots, ..., :n].transpose(2, 3)
    ref = F.scaled_dot_product_attention(q.view(4, Hkv, H // Hkv, d).float(), keys.float(),
                                         whole[1, slots, :, :n].float(), attn_mask=valid[slots, None, None, :n],
                                         scale=0.125)
    _close(got, ref.reshape(4, H * d), dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_draw_is_the_inverse_cdf_of_the_softmax_at_the_vocabulary_size(dtype):
    """sample_rows at u picks what `rollout.draw` picks with the same uniform (its two-level inverse CDF of
    softmax(logits / T)), and its log-prob."""
    from grpo_core.rollout.samplers import draw
    ops = native.load()
    logits = (torch.randn(16, 49152, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    u = torch.rand(16, 1, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    drawn, logp = ops.sample_rows(logits, u[:, 0], 0.8)
    probs = (logits.float() / 0.8).softmax(-1)
    assert torch.equal(drawn, draw(probs, torch.Generator().manual_seed(7)))     # draw takes the same u first
    assert torch.allclose(logp, probs.log().gather(-1, drawn[:, None])[:, 0], atol=1e-4)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_torch_at_the_models_shapes(dtype):
    """The decode matmul on column-block-packed weights: the fused q|k|v, the MLP's down projection and a width
    that is no multiple of 16, at 16 rows (the register-blocked case), fewer and more, with and without bias;
    and an inner dimension taken in chunks (an LM head's input gradient: ten whole chunks and a part, the
    bias added once). On AMX (bf16, inputs a multiple of 32) most take the tiles: also an update's rows (two
    row blocks a unit, the last one short), a chunked inner dimension of whole tiles and 3 rows."""
    skip_unless_cpu("compiled_matmul", dtype)
    ops = native.load()
    assert ops.packed_linear_supported(dtype)
    g = torch.Generator().manual_seed(3)
    for (out, inp), rows, bias in (((960, 576), 16, False), ((576, 1536), 16, True), ((37, 576), 5, True),
                                   ((960, 576), 40, True), ((40, 8 * 1024 + 2 * 1024 + 70), 19, True),
                                   ((576, 1536), 701, True), ((40, 10 * 1024 + 96), 37, False), ((192, 576), 3, False)):
        w = (torch.randn(out, inp, generator=g) * 0.05).to(dtype)
        x = torch.randn(rows, inp, generator=g).to(dtype)
        b = torch.randn(out, generator=g).to(dtype) if bias else None
        packed = ops.pack(w, torch.empty(ops.packed_numel(out, inp), dtype=dtype))
        got = ops.packed_linear(x, packed, b, out)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.shape == (rows, out) and got.dtype == dtype
        _close(got, want, dtype, terms=inp)
    with pytest.raises(ValueError, match="cannot pack"):
        ops.pack(w, torch.empty(3, dtype=dtype))


@needs_compiler
def test_the_tiles_run_only_where_the_cpu_and_its_cap_have_amx():
    """bf16 multiplies on AMX tiles only on a CPU with AMX, never in fp32, and a cap below AMX builds the tile
    path out (the vector blocks then run the same packed weights)."""
    ops = native.load()
    assert not ops.packed_linear_tiles(torch.float32)
    if not cpu_features.detect().amx:
        assert not ops.packed_linear_tiles(torch.bfloat16)
        return
    use_kernels(max_cpu_isa="avx512_bf16")
    capped = native.load()
    assert capped is not None and not capped.packed_linear_tiles(torch.bfloat16)
    assert capped.packed_linear_supported(torch.bfloat16)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logit_sweep_equals_torch_at_the_vocabulary_size(dtype, temperature):
    """Log-prob, entropy and the gradient of the picked log-probs, over SmolLM2's 49152 logits; rows of
    ordinary and of very peaked logits, the picked token first, last and in between."""
    ops = native.load()
    g = torch.Generator().manual_seed(1)
    V = 49152
    logits = (torch.randn(6, V, generator=g) * torch.tensor([1.0, 3.0, 8.0, 30.0, 1.0, 3.0])[:, None]).to(dtype)
    ids = torch.tensor([0, V - 1, 17, 4096, 31000, 49000])
    grad_logp = torch.randn(6, generator=g)
    z = (logits.float() / temperature).requires_grad_()
    want = z.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    want.backward(grad_logp)
    logp, lse, ent = ops.logit_sweep(logits, ids, temperature, with_entropy=True)
    assert torch.allclose(logp, want.detach(), atol=2e-5, rtol=1e-5), (logp - want).abs().max()
    assert torch.allclose(lse, z.logsumexp(-1).detach(), atol=2e-5, rtol=1e-6)
    entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1).detach()
    assert torch.allclose(ent, entropy, atol=2e-4, rtol=1e-5), (ent - entropy).abs().max()
    grad = ops.logit_sweep_backward(logits, ids, lse, grad_logp, temperature)
    assert grad.dtype == dtype and grad.shape == logits.shape
    _close(grad, z.grad / temperature, dtype)
    with pytest.raises(IndexError, match=r"\[0, 49152\)"):
        ops.logit_sweep(logits, torch.tensor([0, 1, 2, 3, 4, V]), temperature, with_entropy=False)


@needs_compiler
def test_the_build_is_cached_and_written_atomically(tmp_path, monkeypatch):
    first = native.library_path(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.library_path(tmp_path) == first and first.stat().st_mtime_ns == stamp    # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]                          # no temporary left
    # $GRPO_KERNEL_CACHE (tests/conftest.py sets one per session) holds the build for every $GRPO_HOME
    monkeypatch.setenv("GRPO_KERNEL_CACHE", str(tmp_path))
    for home in ("a", "b"):
        monkeypatch.setenv("GRPO_HOME", str(tmp_path / f"home-{home}"))
        assert native.library_path() == first and first.stat().st_mtime_ns == stamp
        assert not (tmp_path / f"home-{home}").exists()


def test_a_failed_build_names_the_compilers_error(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "broken-cxx"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'fatal: no space left' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(native.BuildError, match="fatal: no space left"):
        native.library_path(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []                                     # nothing half-written


def _load_in_subprocess(tmp_path, **env) -> subprocess.CompletedProcess:
    code = "from grpo_core.kernels import native; print(native.load() is None)"
    environ = {k: v for k, v in os.environ.items() if k != "CXX"}
    environ.update(GRPO_HOME=str(tmp_path), PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=ROOT,
                          timeout=120)


def test_without_a_compiler_loading_says_why_and_returns_none(tmp_path):
    empty = tmp_path / "empty-path"
    empty.mkdir()
    done = _load_in_subprocess(tmp_path, PATH=str(empty))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert "no C++ compiler found" in done.stderr and "torch ops" in done.stderr


def test_the_config_can_turn_them_off(capfd):
    """kernels.native: false: no library loaded, nothing said; back on, the checked kernels come back."""
    from grpo_core.config import KernelsConfig
    from grpo_core.kernels import settings
    before = settings.apply(KernelsConfig(native=False))
    assert native.load() is None and capfd.readouterr().err == ""
    settings.apply(before)
    assert (native.load() is None) == (cpu_features.find_compiler() is None)
