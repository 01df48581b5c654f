"""The decode step's small operations (`decode_ops.cpp`) and matmul on packed weights (`gemm_ops.cpp`), the
update's logit sweep (`logit_ops.cpp`) and its trunk's elementwise work (`trunk_ops.cpp`), compiled for this
CPU and loaded with ctypes.

Built once per source, compiler and CPU, with the system C++ compiler (`$CXX`, else g++, c++ or
clang++) and `-march=native` (within the CPU cap, `kernels.max_cpu_isa`: `cpu_features`), into
`$GRPO_HOME/kernels/` (the sources compiled side by side, linked to a temporary name, then renamed). No
torch headers are involved, so a build takes a few seconds (about 4 on a 2-vCPU machine). Before first
use every function is checked against the same arithmetic written with torch ops; if the compiler is
missing, the build fails
or a check disagrees, `load()` returns None, says why once on stderr, and the sampler and the update keep
their torch ops.
The config's `kernels.native: false` turns them off.

Tensors passed in must be contiguous CPU tensors of one dtype, float32 or bfloat16.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from grpo_core.kernels import cpu_features, settings

SOURCES = [Path(__file__).parent / name
           for name in ("kernel_common.h", "decode_ops.cpp", "logit_ops.cpp", "trunk_ops.cpp", "gemm_ops.cpp")]
# `#pragma omp simd` loops vectorise (sums marked as reductions may be reordered; nothing else is) and the
# attention and LoRA loops run on OpenMP threads: libgomp.so.1, which resolves to the copy that torch's
# Linux wheels ship and have already loaded, so both share one thread pool (torch.set_num_threads applies
# to both).
FLAGS = ["-O3", "-march=native", "-fPIC", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32],
    "rope_cache": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64],
    "decode_attention": [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
                         _F32],
    "silu_mul": [_PTR, _PTR, _I64, _I64],
    "segment_attention_fwd": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _F32],
    "segment_attention_bwd": [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64,
                              _I64, _I64, _F32],
    "lora_add": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64],
    "decode_layers": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                      _I64, _I64, _I64, _I64, _I64, _I64, _F32, _F32],
    "logit_sweep_fwd": [_PTR, _PTR, _I64, _I64, _F32, _PTR, _PTR, _PTR],
    "logit_sweep_bwd": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _PTR],
    "sample_rows": [_PTR, _PTR, _I64, _I64, _F32, _PTR, _PTR],
    "rms_norm_fwd": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32],
    "rms_norm_bwd": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64],
    "silu_mul_fwd": [_PTR, _PTR, _PTR, _I64],
    "silu_mul_bwd": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64],
    "rope_fwd": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "rope_bwd": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "pack": [_PTR, _PTR, _I64, _I64],
    "packed_linear": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "packed_linear_supported": [],
    "packed_linear_tiles": [],
}


class LoraPack(NamedTuple):
    """A LoRA adapter's factors as `NativeOps.lora_add` reads them (`NativeOps.lora_pack`)."""
    a: torch.Tensor               # A [R, C] packed as a weight of R outputs
    blocks: torch.Tensor          # per 16 output columns, B^T's rows k0 .. k0 + RB - 1, packed
    k0: torch.Tensor              # [ceil(out / 16)] int64
    rank: int                     # R (even)
    block_rank: int               # RB (even; 0 when B is zero)


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded here."""


def _compiler() -> str:
    cxx = cpu_features.find_compiler()
    if cxx is None:
        raise BuildError(cpu_features.NO_COMPILER)
    return cxx


def library_path(cache_dir: Path | None = None) -> Path:
    """Where the build for this source, compiler and CPU lives (built if missing): in `cache_dir`, else
    $GRPO_KERNEL_CACHE, else $GRPO_HOME/kernels. A build is named by what it was built from, so homes may share one."""
    from grpo_core.io import grpo_home
    cxx, features = _compiler(), cpu_features.detect()
    flags = [*FLAGS, *features.compiler_flags()]            # within the CPU cap, if set
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    sources = [src.read_text() for src in SOURCES]
    key = hashlib.sha256("\0".join([*sources, cxx, version, " ".join(flags), *sorted(features.flags)]).encode())
    out_dir = Path(cache_dir or os.environ.get("GRPO_KERNEL_CACHE") or grpo_home() / "kernels")
    lib = out_dir / f"native_ops-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as work:
        # one compiler per source, side by side, then one link into a temporary name that is renamed
        units = [src for src in SOURCES if src.suffix == ".cpp"]
        objects = [Path(work) / f"{src.stem}.o" for src in units]
        jobs = [subprocess.Popen([cxx, *flags, "-c", "-o", str(obj), str(src)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for src, obj in zip(units, objects)]
        errors = [job.communicate()[1] for job in jobs]
        tmp = Path(work) / "lib.so"
        for job, err in zip(jobs, errors):
            if job.returncode:
                raise BuildError(f"{cxx} failed: {err.strip()[-2000:]}")
        done = subprocess.run([cxx, *flags, "-shared", "-o", str(tmp), *map(str, objects)], capture_output=True,
                              text=True)
        if done.returncode:
            raise BuildError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_FLAGS = ("packed_linear_supported", "packed_linear_tiles")       # the functions that answer yes (1) or no (0)


class NativeOps:
    """The compiled functions, called on torch tensors (see the .cpp sources for each one's contract)."""

    def __init__(self, lib: ctypes.CDLL):
        self._fns = {}
        for name, args in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = args, ctypes.c_int if name in _FLAGS else None
                self._fns[name, dtype] = fn
        self._packed_numel = lib.packed_numel
        self._packed_numel.argtypes, self._packed_numel.restype = [_I64, _I64], _I64

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += y (in place, when y is given); out = rms_norm(x) * weight. x, y, out: [b, C]."""
        self._fns["add_rms_norm", x.dtype](x.data_ptr(), _ptr(y), weight.data_ptr(), out.data_ptr(),
                                           x.size(0), x.size(1), eps)
        return out

    @staticmethod
    def _slots(cache: torch.Tensor, b: int, slots: torch.Tensor | None) -> int | None:
        """The pointer of the cache rows that b rows use: `slots` [b] int64, or None for rows 0 .. b-1."""
        if slots is None:
            if b != cache.size(1):
                raise ValueError(f"{b} rows for a cache of {cache.size(1)} rows: pass their slots")
            return None
        if slots.dtype != torch.int64 or not slots.is_contiguous() or len(slots) != b:
            raise ValueError(f"slots must be {b} contiguous int64 cache rows")
        return slots.data_ptr()

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                   q_out: torch.Tensor, cache: torch.Tensor, n_q: int, t: int,
                   slots: torch.Tensor | None = None) -> torch.Tensor:
        """Rotary q -> q_out [b, H d]; rotary k and v -> cache [2, B, Hkv, T, d] at slot t of row slots[r]
        (row r when slots is None; keys transposed: each head's block viewed as [d, T]). qkv: [b, (H + 2 Hkv)
        d], pos: [b] int64."""
        _, B, n_kv, T, d = cache.shape
        b = qkv.size(0)
        self._fns["rope_cache", qkv.dtype](qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(),
                                           q_out.data_ptr(), cache.data_ptr(), self._slots(cache, b, slots), B, b,
                                           n_q, n_kv, d, T, t)
        return q_out

    def decode_attention(self, q: torch.Tensor, cache: torch.Tensor, valid: torch.Tensor, n: int, scale: float,
                         out: torch.Tensor, slots: torch.Tensor | None = None, prefix: torch.Tensor | None = None,
                         split: int = 0) -> torch.Tensor:
        """out [b, H d] = attention of q [b, H d] over the first n slots of cache [2, B, Hkv, T, d] (keys
        transposed, as `rope_cache` writes them) where valid [B, >= n] (bool) holds, row slots[r] of both for
        row r (row r when slots is None); with `prefix` [b], row r reads the slots before `split` from cache
        row prefix[r] instead (a shared prompt, kept once)."""
        _, B, n_kv, T, d = cache.shape
        b = q.size(0)
        rep = q.size(1) // (n_kv * d)
        self._fns["decode_attention", q.dtype](q.data_ptr(), cache.data_ptr(), valid.data_ptr(), valid.stride(0),
                                               self._slots(cache, b, slots),
                                               None if prefix is None else self._slots(cache, b, prefix), split, B,
                                               out.data_ptr(), b, n_kv, rep, d, T, n, scale)
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [b, I] = silu(gate) * up of gate_up [b, 2 I]."""
        self._fns["silu_mul", gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), out.size(0), out.size(1))
        return out

    def lora_pack(self, a: torch.Tensor, b: torch.Tensor) -> LoraPack:
        """A [R, C] and B [out, R] (its scale folded in; a stacked group's A stacked and B block-diagonal) ->
        `lora_add`'s factors, in their dtype: A packed as a weight of R outputs, and B by blocks of 16 output
        columns, each the rank rows k0 .. k0 + RB - 1 of B^T that hold all of its nonzeros (RB the widest such
        run, even), packed as a weight of 16 outputs and RB inputs. An odd R gets a zero rank row."""
        if a.dtype != b.dtype or a.size(0) != b.size(1):
            raise ValueError(f"LoRA factors A {tuple(a.shape)} {a.dtype} and B {tuple(b.shape)} {b.dtype} do not match")
        if a.size(0) % 2:
            a, b = torch.cat([a, a.new_zeros(1, a.size(1))]), torch.cat([b, b.new_zeros(b.size(0), 1)], 1)
        (out, R), nb = b.shape, (b.size(0) + 15) // 16
        per = torch.cat([b, b.new_zeros(nb * 16 - out, R)]).view(nb, 16, R)
        used, k = (per != 0).any(1), torch.arange(R)                                      # [nb, R]
        lo, hi = torch.where(used, k, R).amin(1), torch.where(used, k + 1, 0).amax(1)     # [nb]
        rb = int((hi - lo).clamp(min=0).max()) if nb else 0
        rb += rb % 2
        k0 = lo.clamp(max=R - rb).contiguous()
        rows = per.gather(2, (k0[:, None] + torch.arange(rb))[:, None, :].expand(nb, 16, rb))   # [nb, 16, RB]
        packed_a = self.pack(a, a.new_empty(self.packed_numel(R, a.size(1))))
        packed_b = self.pack(rows.reshape(nb * 16, rb), b.new_empty(self.packed_numel(nb * 16, rb)))
        return LoraPack(packed_a, packed_b, k0, R, rb)

    def lora_add(self, x: torch.Tensor, lora: LoraPack, y: torch.Tensor) -> torch.Tensor:
        """y [b, out] += (x [b, C] A^T) B^T on `lora_pack`'s factors (x, y and the factors of one dtype; the
        product x A^T rounded to it, as the update's is). Needs `packed_linear_supported`."""
        self._fns["lora_add", x.dtype](x.data_ptr(), lora.a.data_ptr(), lora.blocks.data_ptr(), lora.k0.data_ptr(),
                                       y.data_ptr(), x.size(0), x.size(1), lora.rank, lora.block_rank, y.size(1))
        return y

    def decode_layers(self, table: torch.Tensor, x: torch.Tensor, h: torch.Tensor, cache: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, t: int,
                      scale: float, eps: float, n_q: int, slots: torch.Tensor | None = None,
                      prefix: torch.Tensor | None = None, split: int = 0) -> torch.Tensor:
        """Every decoder layer of one decode step in one call, each as the per-operation calls compute it
        (packed linears with their LoRA terms, `rope_cache`, `decode_attention`, `silu_mul`,
        `add_rms_norm`). table [L, 34] int64: per layer its linears' pointers (see decode_ops.cpp);
        x [b, C] the residual stream (updated in place); h [b, C] layer 0's normed input, on return the
        final norm's output; cache [L, 2, B, Hkv, T, d]; the token goes to slot t. Returns h."""
        L, _, B, n_kv, T, d = cache.shape
        b = x.size(0)
        self._fns["decode_layers", x.dtype](table.data_ptr(), L, x.data_ptr(), h.data_ptr(), cache.data_ptr(),
                                            cache[0].numel(), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(),
                                            valid.data_ptr(), valid.stride(0), self._slots(cache[0], b, slots),
                                            None if prefix is None else self._slots(cache[0], b, prefix), split, B,
                                            b, x.size(1), n_q, n_kv, d, T, t, scale, eps)
        return h

    def segment_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_start: torch.Tensor,
                          prompt_ok: torch.Tensor, seg: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the update's packed group rows (see decode_ops.cpp): q [N, H, d], k, v [N, Hkv, d];
        group g's row is tokens row_start[g] .. row_start[g + 1] - 1 (int64 [n + 1]), its first P slots the
        prompt, prompt_ok [n, P] (bool) the real ones; seg [N] int64 where each token's answer starts in its
        row (-1: a prompt token). -> (out [N, H, d], lse [N, H] float32)."""
        out, lse = torch.empty_like(q), torch.empty(q.size(0), q.size(1))
        self._fns["segment_attention_fwd", q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                    lse.data_ptr(), row_start.data_ptr(), row_start.numel() - 1,
                                                    prompt_ok.size(1), prompt_ok.data_ptr(), seg.data_ptr(), q.size(1),
                                                    k.size(1), q.size(2), scale)
        return out, lse

    def segment_attention_backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                   grad: torch.Tensor, lse: torch.Tensor, row_start: torch.Tensor,
                                   prompt_ok: torch.Tensor, seg: torch.Tensor, scale: float):
        """(dq, dk, dv) of `segment_attention` for the output gradient grad [N, H, d]."""
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fns["segment_attention_bwd", q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                    grad.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                                                    dv.data_ptr(), row_start.data_ptr(), row_start.numel() - 1,
                                                    prompt_ok.size(1), prompt_ok.data_ptr(), seg.data_ptr(), q.size(1),
                                                    k.size(1), q.size(2), scale)
        return dq, dk, dv

    def logit_sweep(self, logits: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
        """logits [n, V], ids [n] int64 -> float32 (logp [n], lse [n], entropy [n] or None) of softmax(logits / T)."""
        n, V = logits.shape
        if n and not 0 <= int(ids.min()) <= int(ids.max()) < V:
            raise IndexError(f"token ids must lie in [0, {V}) for logits of {V} columns")
        logp, lse = torch.empty(n), torch.empty(n)
        ent = torch.empty(n) if with_entropy else None
        self._fns["logit_sweep_fwd", logits.dtype](logits.data_ptr(), ids.data_ptr(), n, V, 1.0 / temperature,
                                                   logp.data_ptr(), lse.data_ptr(), _ptr(ent))
        return logp, lse, ent

    def logit_sweep_backward(self, logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor,
                             temperature: float) -> torch.Tensor:
        """d(sum grad_logp * logp) / d logits = grad_logp (onehot(ids) - softmax(logits / T)) / T, [n, V] in
        the logits' dtype; lse [n] from `logit_sweep`, grad_logp [n] float32."""
        grad = torch.empty_like(logits)
        self._fns["logit_sweep_bwd", logits.dtype](logits.data_ptr(), ids.data_ptr(), lse.data_ptr(),
                                                   grad_logp.data_ptr(), logits.size(0), logits.size(1),
                                                   1.0 / temperature, grad.data_ptr())
        return grad

    def sample_rows(self, logits: torch.Tensor, u: torch.Tensor,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One draw per row of softmax(logits [n, V] / T) by inverse CDF at u [n] (float64 in [0, 1)) ->
        (index [n] int64, its log-prob [n] float32)."""
        n, V = logits.shape
        logits, u = logits.contiguous(), u.to(torch.float64).contiguous()
        idx, logp = torch.empty(n, dtype=torch.int64), torch.empty(n)
        self._fns["sample_rows", logits.dtype](logits.data_ptr(), u.data_ptr(), n, V, 1.0 / temperature,
                                               idx.data_ptr(), logp.data_ptr())
        return idx, logp

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, C] -> (weight * round(x / rms(x)) [N, C], 1 / rms(x) [N] float32)."""
        y, rstd = torch.empty_like(x), torch.empty(x.size(0))
        self._fns["rms_norm_fwd", x.dtype](x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), x.size(0),
                                           x.size(1), eps)
        return y, rstd

    def rms_norm_backward(self, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                          grad: torch.Tensor) -> torch.Tensor:
        """The input gradient [N, C] of `rms_norm` (the weight frozen) for the output gradient grad [N, C]."""
        dx = torch.empty_like(x)
        self._fns["rms_norm_bwd", x.dtype](x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), grad.data_ptr(),
                                           dx.data_ptr(), x.size(0), x.size(1))
        return dx

    def gated_silu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """round(silu(gate)) * up, elementwise."""
        out = torch.empty_like(gate)
        self._fns["silu_mul_fwd", gate.dtype](gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
        return out

    def gated_silu_backward(self, gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor):
        """(d gate, d up) of `gated_silu` for the output gradient grad."""
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        self._fns["silu_mul_bwd", gate.dtype](gate.data_ptr(), up.data_ptr(), grad.data_ptr(), dgate.data_ptr(),
                                              dup.data_ptr(), gate.numel())
        return dgate, dup

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
        """Llama's rotary embedding x cos + rotate_half(x) sin of x [N, H, d] with cos, sin [N, d]; `backward`:
        its transpose, the input gradient for an output gradient x."""
        y = torch.empty_like(x)
        self._fns["rope_bwd" if backward else "rope_fwd", x.dtype](x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                                                   y.data_ptr(), *x.shape)
        return y

    def packed_linear_supported(self, dtype: torch.dtype) -> bool:
        """Whether `packed_linear` runs for this dtype on this CPU (AVX-512; for bf16 AVX512-BF16)."""
        return dtype in _SUFFIX and bool(self._fns["packed_linear_supported", dtype]())

    def packed_linear_tiles(self, dtype: torch.dtype) -> bool:
        """Whether `packed_linear` multiplies on AMX tiles here (bf16 on a CPU with AMX, built for it, the tile
        state granted by Linux) where the inputs come in whole tiles (a multiple of 32)."""
        return dtype in _SUFFIX and bool(self._fns["packed_linear_tiles", dtype]())

    def packed_numel(self, out_features: int, in_features: int) -> int:
        return self._packed_numel(out_features, in_features)

    def pack(self, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """weight [N, K] -> out (flat, `packed_numel(N, K)` elements): the column-block layout of `packed_linear`."""
        N, K = weight.shape
        if out.numel() != self.packed_numel(N, K) or weight.dtype != out.dtype or (weight.dtype == torch.bfloat16
                                                                                   and K % 2):
            raise ValueError(f"cannot pack a {tuple(weight.shape)} {weight.dtype} weight into {out.numel()} "
                             f"{out.dtype} (needs {self.packed_numel(N, K)} of its dtype; bf16: an even width)")
        weight = weight.contiguous()             # kept alive through the call (a temporary's pointer is not)
        self._fns["pack", weight.dtype](weight.data_ptr(), out.data_ptr(), N, K)
        return out

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
        """x [..., K] @ W^T + bias -> [..., N], W packed by `pack`."""
        x2 = x.reshape(-1, x.size(-1)).contiguous()
        y = x2.new_empty(x2.size(0), out_features)
        self._fns["packed_linear", x.dtype](x2.data_ptr(), packed.data_ptr(), _ptr(bias), y.data_ptr(), x2.size(0),
                                            out_features, x2.size(1))
        return y.view(*x.shape[:-1], out_features)


def _reference_check(ops: NativeOps) -> None:
    """Each function against the same arithmetic in torch ops, in both dtypes; raises BuildError."""
    g = torch.Generator().manual_seed(0)
    b, H, Hkv, d, T, C, n = 3, 4, 2, 64, 24, 12, 19         # d 64: the attention's vector path, n: 16 keys + 3
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        def rand(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        def same(name, got, want, slack=1.0):          # slack: for long sums, whose order differs more
            if not torch.allclose(got.float(), want.float(), atol=tol * slack, rtol=tol * slack):
                raise BuildError(f"{name} ({dtype}) disagrees with torch by {(got.float() - want.float()).abs().max()}")

        x, y, w = rand(b, C), rand(b, C), rand(C)
        want_x = x + y
        got = ops.add_rms_norm(x, y, w, torch.empty_like(x), 1e-5)
        same("add_rms_norm", x, want_x)
        same("add_rms_norm", got, F.rms_norm(want_x.float(), (C,), w.float(), 1e-5))
        qkv, cos, sin, pos = rand(b, (H + 2 * Hkv) * d), rand(9, d), rand(9, d), torch.tensor([0, 4, 8])
        cache = torch.zeros(2, b, Hkv, T, d, dtype=dtype)
        q = ops.rope_cache(qkv, cos, sin, pos, torch.empty(b, H * d, dtype=dtype), cache, H, 2)
        rot = (qkv[:, :(H + Hkv) * d].view(b, H + Hkv, d).float() * cos[pos, None].float()
               + qkv[:, :(H + Hkv) * d].view(b, H + Hkv, d).float().roll(d // 2, -1) * sin[pos, None].float())
        same("rope_cache", q.view(b, H, d), rot[:, :H])
        same("rope_cache", cache[0].view(b, Hkv, d, T)[..., 2], rot[:, H:])
        same("rope_cache", cache[1, :, :, 2], qkv[:, (H + Hkv) * d:].view(b, Hkv, d))
        cache.copy_(rand(2, b, Hkv, T, d))
        valid = torch.rand(b, T, generator=g) > 0.3
        valid[:, n - 1] = True
        got = ops.decode_attention(q, cache, valid, n, 0.3, torch.empty_like(q))
        want = F.scaled_dot_product_attention(
            q.view(b, Hkv, H // Hkv, d).float(), cache[0].view(b, Hkv, d, T)[..., :n].transpose(2, 3).float(),
            cache[1, :, :, :n].float(),
            attn_mask=valid[:, None, None, :n], scale=0.3)
        same("decode_attention", got, want.reshape(b, H * d))
        gate_up = rand(b, 2 * C)
        got = ops.silu_mul(gate_up, torch.empty(b, C, dtype=dtype))
        same("silu_mul", got, F.silu(gate_up[:, :C].float()) * gate_up[:, C:].float())
        logits, ids, grad_logp = rand(b, 2 * C) * 4, torch.tensor([0, 5, 2 * C - 1]), torch.randn(b, generator=g)
        z = logits.float() / 0.7
        logp, lse, ent = ops.logit_sweep(logits, ids, 0.7, True)
        same("logit_sweep", logp, z.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1))
        same("logit_sweep", ent, -(z.softmax(-1) * z.log_softmax(-1)).sum(-1))
        onehot = F.one_hot(ids, z.size(-1)).float()
        same("logit_sweep_backward", ops.logit_sweep_backward(logits, ids, lse, grad_logp, 0.7),
             (onehot - z.softmax(-1)) * grad_logp[:, None] / 0.7)
        u = torch.rand(b, generator=g, dtype=torch.float64)
        drawn, logp = ops.sample_rows(x, u, 0.7)
        cdf = (x.float() / 0.7).softmax(-1).double().cumsum(-1)
        same("sample_rows", drawn, torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0])
        same("sample_rows", logp, (x.float() / 0.7).log_softmax(-1).gather(-1, drawn[:, None])[:, 0])
        _check_trunk_ops(ops, rand, same)
        if ops.packed_linear_supported(dtype):
            _check_packed_linear(ops, dtype, rand, same, C)


def _check_packed_linear(ops: NativeOps, dtype: torch.dtype, rand, same, C: int) -> None:
    """The matmul on packed weights and the LoRA term on packed factors against torch."""
    # one row block, a full one, a full one and a part; 64 inputs: AMX's tiles (bf16, 32 inputs a tile);
    # 8224: inputs taken in chunks
    for rows, K in ((1, 2 * C), (16, 2 * C), (21, 2 * C), (21, 64), (3, 64), (37, 8224)):
        w, bias, x = rand(37, K), rand(37), (rand(rows, K).float() * 8 / K ** 0.5).to(dtype)   # sums ~ 1
        packed = ops.pack(w, torch.empty(ops.packed_numel(37, K), dtype=dtype))
        same("packed_linear", ops.packed_linear(x, packed, bias, 37),
             x.float() @ w.float().T + bias.float(), slack=max(1.0, (K / 64) ** 0.5))
    x, A, B, y = rand(21, 2 * C), rand(3, 2 * C), rand(5, 3), rand(21, 5)
    want = y.float() + (x.float() @ A.float().T).to(dtype).float() @ B.float().T
    same("lora_add", ops.lora_add(x, ops.lora_pack(A, B), y), want)


def _check_trunk_ops(ops: NativeOps, rand, same) -> None:
    """The trunk's ops against autograd through the same arithmetic in torch ops."""
    N, H, d, C = 3, 2, 8, 12
    x, w, g = rand(N, C).float().requires_grad_(), rand(C), rand(N, C)
    want = F.rms_norm(x, (C,), w.float(), 1e-5)
    y, rstd = ops.rms_norm(x.detach().to(w.dtype), w, 1e-5)
    same("rms_norm", y, want)
    want.backward(g.float())
    same("rms_norm_backward", ops.rms_norm_backward(x.detach().to(w.dtype), w, rstd, g), x.grad)
    gate, up = rand(N, C).float().requires_grad_(), rand(N, C).float().requires_grad_()
    want = F.silu(gate) * up
    same("gated_silu", ops.gated_silu(gate.detach().to(w.dtype), up.detach().to(w.dtype)), want)
    want.backward(g.float())
    dgate, dup = ops.gated_silu_backward(gate.detach().to(w.dtype), up.detach().to(w.dtype), g)
    same("gated_silu_backward", dgate, gate.grad)
    same("gated_silu_backward", dup, up.grad)
    q, cos, sin, gq = rand(N, H, d).float().requires_grad_(), rand(N, d), rand(N, d), rand(N, H, d)
    want = q * cos[:, None].float() + torch.cat([-q[..., d // 2:], q[..., :d // 2]], -1) * sin[:, None].float()
    same("rope", ops.rope(q.detach().to(w.dtype), cos, sin), want)
    want.backward(gq.float())
    same("rope backward", ops.rope(gq, cos, sin, backward=True), q.grad)


def ops_for(t: torch.Tensor) -> NativeOps | None:
    """The checked kernels where they apply to this tensor (float32 or bfloat16 on the CPU), else None."""
    if t.device.type != "cpu" or t.dtype not in _SUFFIX:
        return None
    return load()


@settings.forget_when("native", "max_cpu_isa")
@functools.cache
def load() -> NativeOps | None:
    """The checked kernels for this machine (within the CPU cap), or None: turned off (`kernels.native:
    false`), or unavailable (and why, once, on stderr)."""
    if not settings.current().native:
        return None
    try:
        ops = NativeOps(ctypes.CDLL(str(library_path())))
        # checked on a thread of its own: the check uses autograd, and the caller's thread may be inside an
        # autograd context (e.g. a checkpoint's saved-tensor hooks, which are per thread)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(_reference_check, ops).result()
        return ops
    except (BuildError, OSError) as e:
        print(f"grpo: native kernels not used ({e}); sampling and the update keep their torch ops", file=sys.stderr)
        return None
