"""What this CPU, this torch build and this machine's compiler can run: asked in one place by the fast
paths (to pick or decline a kernel) and by the tests (to skip one this machine cannot run).

`detect()` reads the CPU's flags (/proc/cpuinfo; torch's cpuinfo where there is none), asks torch whether
oneDNN packs fp32 and bf16 weights here, and looks for a C++ compiler. `plan(features, dtype)` is a pure
function of those features: which kernel each fast path would take and why, so the decision for an AVX2
CPU, an AVX-512 one, one with AVX512-BF16 or one with AMX is tested on any machine (tests/test_cpu_features.py).

The config's `kernels.max_cpu_isa` (avx2 | avx512 | avx512_bf16 | amx) caps the features seen, and the
compiled kernels are built for the cap: a bigger machine takes the paths of a smaller one. `$GRPO_MAX_CPU_ISA`
caps them too, for the tests (the lower cap wins); with `ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2`
torch's own kernels and oneDNN do the same (`make test-avx2`).
"""
from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from grpo_core.kernels import settings

ISA_LEVELS = settings.ISA_LEVELS          # avx2, avx512, avx512_bf16, amx
# the flags each cap hides (every flag that starts with one of these)
_HIDDEN = {"avx2": ("avx512", "amx", "avx_ne_convert", "avx_vnni"),
           "avx512": ("avx512_bf16", "avx512_fp16", "amx", "avx_ne_convert", "avx_vnni"),
           "avx512_bf16": ("avx512_fp16", "amx", "avx_ne_convert", "avx_vnni"),
           "amx": ()}
# gcc/clang switches that keep the compiled kernels within a cap (-march=native would use the real CPU's);
# -mno-avx512f turns off every AVX-512 extension, AVX512-BF16 included, but not AMX (its own switches).
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
_NO_ISA = {"avx2": ["-mno-avx512f", *_NO_AMX], "avx512": ["-mno-avx512bf16", *_NO_AMX], "avx512_bf16": _NO_AMX,
           "amx": []}
NO_COMPILER = "no C++ compiler found (install g++, or set $CXX)"
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")       # AVX-512 as oneDNN and the kernels use it


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]           # the CPU's feature flags, as /proc/cpuinfo spells them, less those capped
    onednn: bool = True             # torch's oneDNN runs packed fp32 linears with fp32 results
    onednn_bf16: bool = True        # ... and packs bf16 weights (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)
    compiler: str | None = "g++"    # the C++ compiler for the native kernels; None: none found
    cap: str | None = None          # kernels.max_cpu_isa or $GRPO_MAX_CPU_ISA (the lower), when set
    model: str = ""                 # the CPU's model name, for the record

    @property
    def avx512(self) -> bool:
        return all(f in self.flags for f in AVX512)

    @property
    def avx512_bf16(self) -> bool:
        return self.avx512 and "avx512_bf16" in self.flags

    @property
    def amx(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def bf16_matmul(self) -> str | None:
        """The instruction set this CPU multiplies bf16 with natively ("AMX", "AVX512-BF16"), or None."""
        return "AMX" if self.amx else "AVX512-BF16" if self.avx512_bf16 else None

    def compiler_flags(self) -> list[str]:
        """Switches added to `-march=native` so the compiled kernels use no instruction above the cap."""
        return list(_NO_ISA[self.cap]) if self.cap else []

    def with_cap(self, cap: str) -> "CpuFeatures":
        """These features as a CPU at most of level `cap` would have them (oneDNN's bf16 packing included); a
        lower cap already set stays."""
        if cap not in ISA_LEVELS:
            raise ValueError(f"CPU cap {cap!r} ($GRPO_MAX_CPU_ISA or kernels.max_cpu_isa): use one of "
                             f"{', '.join(ISA_LEVELS)}")
        cap = min(cap, self.cap or cap, key=ISA_LEVELS.index)
        flags = frozenset(f for f in self.flags if not f.startswith(_HIDDEN[cap]))
        return replace(self, flags=flags, cap=cap, onednn_bf16=self.onednn_bf16 and _onednn_packs_bf16(flags))

    def summary(self) -> str:
        """One line for a run's header and its MLflow tag: the CPU and the features the fast paths use."""
        have = [name for name, ok in (("avx2", "avx2" in self.flags), ("avx512", self.avx512),
                                      ("avx512_bf16", self.avx512_bf16), ("amx", self.amx)) if ok]
        line = f"{self.model or platform.machine()}: {' '.join(have) or 'no AVX2'}"
        return line + (f" (capped at {self.cap})" if self.cap else "")


def _onednn_packs_bf16(flags) -> bool:
    """Whether oneDNN packs bf16 weights on a CPU with these flags (torch: 'bf16 path needs the cpu support
    avx_ne_convert or avx512bw, avx512vl and avx512dq')."""
    return all(f in flags for f in AVX512) or "avx_ne_convert" in flags


def _cpuinfo() -> tuple[frozenset[str], str]:
    """(flags, model name) from /proc/cpuinfo; elsewhere the flags torch's cpuinfo reports."""
    flags, model = None, ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features") and flags is None:
                flags = frozenset(value.split())
            elif key.strip() == "model name" and not model:
                model = value.strip()
    except OSError:
        pass
    if flags is None:
        level = torch.backends.cpu.get_cpu_capability().lower()            # "avx512", "avx2", "default", ...
        flags = {"avx2"} if level in ("avx2", "avx512") else set()
        flags |= set(AVX512) if level == "avx512" else set()
        probes = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported",
                  "amx_bf16": "_is_amx_tile_supported"}
        flags |= {flag for flag, probe in probes.items() if getattr(torch.cpu, probe, lambda: False)()}
        flags = frozenset(flags)
    return flags, model or platform.processor()


def _probe_onednn(dtype: torch.dtype) -> bool:
    """Does this torch build pack a weight of `dtype` for oneDNN here and multiply on it (fp32: with fp32
    results)?"""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 40, generator=g), torch.randn(5, 3, 40, generator=g)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
        got = torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, None, "none", [], "").float()
        want = (x.double() @ w.to(dtype).double().T).float()
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got, want, rtol=tol, atol=tol))
    except (RuntimeError, AttributeError):
        return False


def find_compiler() -> str | None:
    """The C++ compiler for the native kernels ($CXX, else g++, c++ or clang++), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.cache
def _this_machine() -> CpuFeatures:
    """This machine's features, uncapped (probed once per process)."""
    flags, model = _cpuinfo()
    return CpuFeatures(flags=flags, model=model, onednn=_probe_onednn(torch.float32),
                       onednn_bf16=_probe_onednn(torch.bfloat16), compiler=find_compiler())


@settings.forget_when("max_cpu_isa")
@functools.cache
def detect() -> CpuFeatures:
    """This machine's features, capped by the config's `kernels.max_cpu_isa` and by $GRPO_MAX_CPU_ISA (the
    tests' cap), the lower of the two, where set."""
    found = _this_machine()
    for cap in (settings.current().max_cpu_isa, os.environ.get("GRPO_MAX_CPU_ISA", "").strip().lower()):
        if cap:
            found = found.with_cap(cap)
    return found


# -- the decision: which kernel each fast path takes on given features --------------------------------------

def declines(path: str, dtype: torch.dtype = torch.float32, features: CpuFeatures | None = None) -> str | None:
    """Why the fast path `path` cannot run for `dtype` on `features` (this machine's by default); None when it
    can. Paths: "native_ops" (the compiled step, trunk and logit ops), "compiled_matmul" (gemm_ops.cpp's
    packed-weight matmul), "onednn_linear" (oneDNN's packed weights), "bf16_matmul" (native bf16 arithmetic,
    what `dtype: auto` takes bf16 for), "vector_attention" (the compiled attention's AVX-512 loops)."""
    f = features or detect()
    bf16 = dtype == torch.bfloat16
    if path == "native_ops":
        return None if f.compiler else NO_COMPILER
    if path == "compiled_matmul":
        if f.compiler is None:
            return declines("native_ops", dtype, f)
        if bf16 and not f.avx512_bf16:
            return "the compiled bf16 matmul needs AVX-512 with AVX512-BF16"
        return None if f.avx512 else "the compiled matmul needs AVX-512 (F, BW, VL, DQ)"
    if path == "onednn_linear":
        if not f.onednn:
            return "this torch build has no usable oneDNN (mkldnn) packed linear"
        if bf16 and not f.onednn_bf16:
            return "oneDNN packs bf16 weights only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT"
        return None
    if path == "bf16_matmul":
        return None if f.bf16_matmul else "no native bf16 matmul: neither AMX nor AVX512-BF16"
    if path == "vector_attention":
        return declines("native_ops", dtype, f) or (None if f.avx512 else "the vector attention needs AVX-512")
    raise ValueError(f"unknown fast path {path!r}")


# the sampler's linear kernels (`kernel_probes.linear_kernel`) and the fast path each one is
DECODE_LINEARS = {"plain": None, "onednn": "onednn_linear", "native": "compiled_matmul"}


def plan(features: CpuFeatures, dtype: torch.dtype) -> dict[str, str]:
    """What each fast path takes for `dtype` on `features`, and why: {path: "choice (reason)"}.

    - precision: what `dtype: auto` gives a LoRA run (bf16 only with native bf16 matmul);
    - step_ops: the decode step's and the update's small ops, compiled or torch's;
    - attention: the compiled attention's AVX-512 loops or its portable ones;
    - decode_linears: the kernels the sampler's probe times, fastest taken (`kernel_probes.linear_kernel`);
    - update_linears: what the update's frozen base linears multiply with.
    On AMX the compiled bf16 matmul runs on the tiles ("native (AMX tiles)"; gemm_ops.cpp)."""
    def why(path):
        return declines(path, dtype, features)

    bf16 = dtype == torch.bfloat16
    out = {"precision": f"bfloat16 ({features.bf16_matmul})" if not why("bf16_matmul")
           else f"float32 ({why('bf16_matmul')})",
           "step_ops": "compiled" if not why("native_ops") else f"torch ({why('native_ops')})",
           "attention": "avx512" if not why("vector_attention") else f"portable ({why('vector_attention')})"}
    kernels = {kernel: path and why(path) for kernel, path in DECODE_LINEARS.items()}
    left_out = "; ".join(f"not {k}: {reason}" for k, reason in kernels.items() if reason)
    tiles = bf16 and features.amx                                 # the compiled matmul multiplies on AMX tiles
    named = {k: "native (AMX tiles)" if k == "native" and tiles else k for k in kernels}
    out["decode_linears"] = "|".join(named[k] for k, reason in kernels.items() if not reason) + \
        (f" ({left_out})" if left_out else "")
    if bf16:
        out["update_linears"] = (f"{named['native']}|torch" if not why("compiled_matmul")
                                 else f"torch ({why('compiled_matmul')})")
    else:
        out["update_linears"] = "onednn" if not why("onednn_linear") else f"torch ({why('onednn_linear')})"
    return out


FAST_PATHS = {"native_ops": "compiled step ops", "vector_attention": "AVX-512 attention",
              "compiled_matmul": "compiled matmul", "onednn_linear": "oneDNN packed linears"}


def describe(features: CpuFeatures, dtype: torch.dtype) -> str:
    """One line for a run's header: the CPU, and each fast path it leaves out for `dtype`, with the reason."""
    left_out = [f"{name} ({reason})" for path, name in FAST_PATHS.items()
                if (reason := declines(path, dtype, features))]
    return f"cpu: {features.summary()}" + (f"; not used here: {'; '.join(left_out)}" if left_out else "")


_SAID: set[tuple[str, str]] = set()
log = logging.getLogger(__name__)


def note_declined(path: str, reason: str) -> None:
    """Log once per process (INFO) that a fast path was declined here and why (`grpo train` says it up front,
    in its header: `describe`)."""
    if (path, reason) not in _SAID:
        _SAID.add((path, reason))
        log.info("%s not used here (%s)", path, reason)
