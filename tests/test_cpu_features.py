"""What the fast paths take on each kind of CPU (grpo_core/kernels/cpu_features.py): the decision is a function
of the features, checked here for an AVX2-only CPU, an AVX-512 one without bf16, one with AVX512-BF16 and one
with AMX whatever this machine is; the config's kernels.max_cpu_isa (and the tests' $GRPO_MAX_CPU_ISA) caps what
this machine shows, and the compiled kernels are built within the cap; `dtype: auto` follows the same features."""
from __future__ import annotations

import ctypes

import pytest
import torch

from grpo_core.kernels import cpu_features, native
from grpo_core.kernels.cpu_features import CpuFeatures, declines, plan
from tests.conftest import needs_cpu, use_kernels

BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx f16c fma bmi1 bmi2 avx2"
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
CPUS = {   # /proc/cpuinfo flags (the ones that matter) of the CPUs this project has run on, and one more
    "avx2 (AMD EPYC Zen 2)": BASE,
    "avx512 (Intel Xeon Cascade Lake)": f"{BASE} {AVX512}",
    "avx512_bf16 (AMD EPYC Zen 4)": f"{BASE} {AVX512} avx512_bf16 avx512vbmi",
    "amx (Intel Xeon Sapphire Rapids)": f"{BASE} {AVX512} avx512_bf16 avx512_fp16 avx_vnni amx_bf16 amx_tile amx_int8",
}


def cpu(name: str, **kw) -> CpuFeatures:
    flags = frozenset(CPUS[name].split())
    kw.setdefault("onednn_bf16", cpu_features._onednn_packs_bf16(flags))    # as torch's oneDNN decides
    return CpuFeatures(flags=flags, model=name, **kw)


FP32, BF16 = torch.float32, torch.bfloat16
NO_BF16 = "float32 (no native bf16 matmul: neither AMX nor AVX512-BF16)"
NEEDS_512 = "the compiled matmul needs AVX-512 (F, BW, VL, DQ)"
NEEDS_BF16 = "the compiled bf16 matmul needs AVX-512 with AVX512-BF16"
NO_ONEDNN_BF16 = "oneDNN packs bf16 weights only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT"
EXPECTED = {   # (cpu, dtype) -> what each fast path takes, and why
    ("avx2 (AMD EPYC Zen 2)", FP32): {
        "precision": NO_BF16, "step_ops": "compiled",
        "attention": "portable (the vector attention needs AVX-512)",
        "decode_linears": f"plain|onednn (not native: {NEEDS_512})", "update_linears": "onednn"},
    ("avx2 (AMD EPYC Zen 2)", BF16): {
        "precision": NO_BF16, "step_ops": "compiled",
        "attention": "portable (the vector attention needs AVX-512)",
        "decode_linears": f"plain (not onednn: {NO_ONEDNN_BF16}; not native: {NEEDS_BF16})",
        "update_linears": f"torch ({NEEDS_BF16})"},
    ("avx512 (Intel Xeon Cascade Lake)", FP32): {
        "precision": NO_BF16, "step_ops": "compiled", "attention": "avx512",
        "decode_linears": "plain|onednn|native", "update_linears": "onednn"},
    ("avx512 (Intel Xeon Cascade Lake)", BF16): {
        "precision": NO_BF16, "step_ops": "compiled", "attention": "avx512",
        "decode_linears": f"plain|onednn (not native: {NEEDS_BF16})", "update_linears": f"torch ({NEEDS_BF16})"},
    ("avx512_bf16 (AMD EPYC Zen 4)", FP32): {
        "precision": "bfloat16 (AVX512-BF16)", "step_ops": "compiled", "attention": "avx512",
        "decode_linears": "plain|onednn|native", "update_linears": "onednn"},
    ("avx512_bf16 (AMD EPYC Zen 4)", BF16): {
        "precision": "bfloat16 (AVX512-BF16)", "step_ops": "compiled", "attention": "avx512",
        "decode_linears": "plain|onednn|native", "update_linears": "native|torch"},
    ("amx (Intel Xeon Sapphire Rapids)", FP32): {
        "precision": "bfloat16 (AMX)", "step_ops": "compiled", "attention": "avx512",
        "decode_linears": "plain|onednn|native", "update_linears": "onednn"},
    ("amx (Intel Xeon Sapphire Rapids)", BF16): {
        "precision": "bfloat16 (AMX)", "step_ops": "compiled", "attention": "avx512",
        "decode_linears": "plain|onednn|native (AMX tiles)", "update_linears": "native (AMX tiles)|torch"},
}


@pytest.mark.parametrize("name, dtype", list(EXPECTED), ids=[f"{n.split()[0]}-{str(d)[6:]}" for n, d in EXPECTED])
def test_each_cpu_kind_gets_the_kernels_it_can_run(name, dtype):
    assert plan(cpu(name), dtype) == EXPECTED[name, dtype]


def test_without_a_compiler_or_onednn_everything_falls_back_to_torch():
    bare = cpu("amx (Intel Xeon Sapphire Rapids)", compiler=None, onednn=False, onednn_bf16=False)
    for dtype in (FP32, BF16):
        got = plan(bare, dtype)
        assert got["step_ops"] == f"torch ({cpu_features.NO_COMPILER})"
        assert got["attention"] == f"portable ({cpu_features.NO_COMPILER})"
        assert got["decode_linears"].startswith("plain (not onednn: this torch build has no usable oneDNN")
        assert got["decode_linears"].endswith(f"not native: {cpu_features.NO_COMPILER})")
        assert got["update_linears"].startswith("torch (")
    assert got["precision"] == "bfloat16 (AMX)"          # the bf16 matmul is torch's own: no compiler needed


def test_avx_ne_convert_lets_onednn_pack_bf16_without_avx512():
    """Intel's AVX2 cores with AVX-NE-CONVERT (e.g. Sierra Forest): oneDNN packs bf16, the compiled matmul
    still needs AVX-512."""
    flags = frozenset(f"{BASE} avx_vnni avx_ne_convert".split())
    ne = CpuFeatures(flags=flags, onednn_bf16=cpu_features._onednn_packs_bf16(flags))
    assert plan(ne, BF16)["decode_linears"] == f"plain|onednn (not native: {NEEDS_BF16})"


@pytest.mark.parametrize("cap, left", [("avx2", BASE), ("avx512", f"{BASE} {AVX512}"),
                                       ("avx512_bf16", f"{BASE} {AVX512} avx512_bf16"),
                                       ("amx", CPUS["amx (Intel Xeon Sapphire Rapids)"])])
def test_a_cap_hides_every_feature_above_it(cap, left):
    amx = cpu("amx (Intel Xeon Sapphire Rapids)")
    capped = amx.with_cap(cap)
    assert capped.flags == frozenset(left.split()) and capped.cap == cap
    assert capped.onednn_bf16 == (cap != "avx2")
    assert capped.summary().endswith(f"(capped at {cap})")
    no_amx = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]     # -mno-avx512f leaves AMX on
    assert capped.compiler_flags() == {"avx2": ["-mno-avx512f", *no_amx], "avx512": ["-mno-avx512bf16", *no_amx],
                                       "avx512_bf16": no_amx}.get(cap, [])
    assert capped.with_cap("amx") == capped                 # a lower cap stays
    with pytest.raises(ValueError, match=r"CPU cap 'sse4' \(\$GRPO_MAX_CPU_ISA or kernels.max_cpu_isa\): use one "
                                         r"of avx2, avx512, avx512_bf16, amx"):
        amx.with_cap("sse4")


def test_the_config_caps_what_this_machine_shows(monkeypatch):
    """kernels.max_cpu_isa caps the features every fast path asks about; $GRPO_MAX_CPU_ISA (`make test-avx2`)
    caps them too, and the lower cap wins."""
    monkeypatch.delenv("GRPO_MAX_CPU_ISA", raising=False)
    use_kernels(max_cpu_isa=None)
    cpu_features.detect.cache_clear()                   # what it kept under `make test-avx2`'s cap
    real = cpu_features.detect()
    use_kernels(max_cpu_isa="avx2")
    seen = cpu_features.detect()
    assert seen == real.with_cap("avx2") and not seen.avx512 and "avx2" in seen.summary()
    assert declines("compiled_matmul", FP32) == NEEDS_512                   # asked of this machine, capped
    use_kernels(max_cpu_isa="amx")
    monkeypatch.setenv("GRPO_MAX_CPU_ISA", "avx2")
    cpu_features.detect.cache_clear()
    try:
        assert cpu_features.detect() == real.with_cap("amx").with_cap("avx2")
        use_kernels(max_cpu_isa=None)
        assert cpu_features.detect().cap == "avx2"
    finally:
        cpu_features.detect.cache_clear()
    with pytest.raises(ValueError, match="kernels.max_cpu_isa='sse4': use one of None, avx2, avx512"):
        use_kernels(max_cpu_isa="sse4")


@pytest.mark.parametrize("name", list(CPUS))
def test_auto_precision_follows_the_features(name, monkeypatch):
    from grpo_core.model.loading import select_dtype
    monkeypatch.delenv("GRPO_CPU_BF16", raising=False)
    monkeypatch.setattr(cpu_features, "detect", lambda: cpu(name))
    want = BF16 if name.startswith(("avx512_bf16", "amx")) else FP32
    assert select_dtype("auto", torch.device("cpu"), use_peft=True) == want


def test_the_run_header_names_the_cpu_and_each_path_it_leaves_out():
    zen2, zen4 = cpu("avx2 (AMD EPYC Zen 2)"), cpu("avx512_bf16 (AMD EPYC Zen 4)")
    assert cpu_features.describe(zen4, BF16) == "cpu: avx512_bf16 (AMD EPYC Zen 4): avx2 avx512 avx512_bf16"
    assert cpu_features.describe(zen2, BF16) == (
        "cpu: avx2 (AMD EPYC Zen 2): avx2; not used here: AVX-512 attention (the vector attention needs AVX-512); "
        f"compiled matmul ({NEEDS_BF16}); oneDNN packed linears ({NO_ONEDNN_BF16})")
    assert cpu_features.describe(zen2, FP32).endswith(f"; compiled matmul ({NEEDS_512})")


def test_grpo_model_kernels_prints_each_paths_choice_and_why(capsys):
    from flows.cli.main import main
    assert main(["model", "kernels", "--as", "avx2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"cpu: {cpu_features.detect().with_cap('avx2').summary()}\n")
    assert "dtype auto (LoRA): float32 (no native bf16 matmul" in out
    bf16 = out[out.index("\nbfloat16:"):]
    assert f"  update_linears  torch ({NEEDS_BF16})" in bf16 and "  decode_linears  plain (not onednn: " in bf16


@needs_cpu("native_ops")
def test_the_compiled_kernels_are_built_within_the_cap(tmp_path, monkeypatch):
    """Built for this CPU and for it capped: the library's own answer on its matmul is `declines`' answer."""
    real = cpu_features.detect()
    for features in {real, real.with_cap("avx2"), real.with_cap("avx512")}:
        monkeypatch.setattr(cpu_features, "detect", lambda features=features: features)
        ops = native.NativeOps(ctypes.CDLL(str(native.library_path(tmp_path))))
        for dtype in (FP32, BF16):
            assert ops.packed_linear_supported(dtype) == (declines("compiled_matmul", dtype, features) is None), \
                (features.summary(), dtype)
