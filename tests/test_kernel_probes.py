"""The kernel probes (grpo_core/kernels/kernel_probes.py): the sampler's probe times exactly the kernels this CPU
runs, on a bounded number of matrices, and a kernel named in the config that this CPU cannot run is an error that
says why; the update's choice says what decided it (the setting, or the probe's timings)."""
from __future__ import annotations

import re

import pytest
import torch

from grpo_core.kernels import cpu_features
from grpo_core.kernels.kernel_probes import _probe, linear_kernel, native_gemm, native_update_gemm, update_reason
from grpo_core.kernels.pages import hugepage_empty
from tests.conftest import cpu_declines, use_kernels


def test_the_probe_of_a_small_model_times_a_bounded_number_of_matrices():
    """96 MiB of 64-wide weights would be thousands of matrices (per-call overhead, for seconds); a real model's
    shapes stay below the bound, so its probe streams the whole ~96 MiB."""
    from grpo_core.kernels.kernel_probes import PROBE_MATRICES, streaming_weights
    _, tiny = streaming_weights(((64, 64), (128, 64)), 96, torch.float32, huge_pages=False,
                                max_matrices=PROBE_MATRICES)
    assert len(tiny) <= PROBE_MATRICES
    layer = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))   # SmolLM2-135M
    flat, real = streaming_weights(layer, 96, torch.bfloat16, huge_pages=False, max_matrices=PROBE_MATRICES)
    assert len(real) < PROBE_MATRICES and flat.numel() * 2 > 90 * 2**20


def test_hugepage_buffer_is_aligned_and_the_probe_names_a_kernel():
    buf = hugepage_empty(3 << 20, torch.float32)
    assert buf.numel() == 3 << 20 and buf.data_ptr() % (2 << 20) == 0
    use_kernels(decode_linear="auto")
    for dtype in (torch.float32, torch.bfloat16):
        kernel, rates = linear_kernel(dtype, 4, ((96, 64), (64, 96)), mib=4)
        assert kernel in rates and all(r > 0 for r in rates.values())
        # the probe times exactly the kernels `cpu_features.plan` lists for this CPU
        assert "|".join(rates) == cpu_features.plan(cpu_features.detect(), dtype)["decode_linears"].split(" ")[0]
    if cpu_declines("onednn_linear") is None:
        use_kernels(decode_linear="onednn")
        assert linear_kernel(torch.float32, 4, ((96, 64), (64, 96)), mib=4) == ("onednn", {})
    with pytest.raises(ValueError, match="kernels.decode_linear='fast': use one of auto, plain, onednn, native"):
        use_kernels(decode_linear="fast")


def test_a_kernel_this_cpu_cannot_run_is_declined_with_the_reason(monkeypatch, caplog):
    """On an AVX2 CPU (this one, capped): the probe leaves oneDNN's bf16 packing and the compiled matmul out and
    logs why once; naming one of them in kernels.decode_linear is an error that says why."""
    import logging
    caplog.set_level(logging.INFO, logger=cpu_features.__name__)
    avx2 = cpu_features.detect().with_cap("avx2")
    monkeypatch.setattr(cpu_features, "detect", lambda: avx2)
    monkeypatch.setattr(cpu_features, "_SAID", set())
    use_kernels(decode_linear="auto")
    _probe.cache_clear()
    try:
        kernel, rates = linear_kernel(torch.bfloat16, 4, ((96, 64), (64, 96)), mib=4)
    finally:
        _probe.cache_clear()
    assert kernel == "plain" and list(rates) == ["plain"]
    said = caplog.messages
    assert any(m.startswith("oneDNN bfloat16 linears not used here (oneDNN packs bf16 weights only with AVX-512")
               for m in said), said
    if cpu_features.detect().compiler:
        assert any(m.startswith("compiled bfloat16 matmul not used here (the compiled bf16 matmul needs AVX-512")
                   for m in said), said
    for kernel, path in (("onednn", "onednn_linear"), ("native", "compiled_matmul")):
        use_kernels(decode_linear=kernel)
        reason = re.escape(cpu_features.declines(path, torch.bfloat16))
        with pytest.raises(ValueError, match=f"kernels.decode_linear={kernel}: .*{reason}"):
            linear_kernel(torch.bfloat16, 4, ((96, 64), (64, 96)), mib=4)
    assert len(caplog.messages) == len(said)                               # once per process


def test_the_updates_choice_says_what_decided_it():
    """Pinned, the setting decides (and where it names a kernel this CPU lacks, the record says so); on auto, the
    probe's timings of the compiled matmul and torch's are the reason (a timing: under load two processes can
    decide differently)."""
    shapes = ((96, 64), (64, 96))
    use_kernels(update_linear="torch")
    assert native_update_gemm(torch.bfloat16, shapes) is False
    assert update_reason(torch.bfloat16, shapes) == "kernels.update_linear: torch"
    runs_native = native_gemm(torch.bfloat16, shapes) is not None
    use_kernels(update_linear="native")
    assert native_update_gemm(torch.bfloat16, shapes) is runs_native
    assert update_reason(torch.bfloat16, shapes) == "kernels.update_linear: native" + \
        ("" if runs_native else ", but no compiled matmul here")
    use_kernels(update_linear="auto")
    chose = native_update_gemm(torch.bfloat16, shapes)
    said = update_reason(torch.bfloat16, shapes)
    if not runs_native:
        assert chose is False and said == "no compiled matmul here"
        return
    timed = dict((k, float(v)) for k, v in re.findall(r"(\w+) ([\d.]+) ms", said.removeprefix("probe: ")))
    # the two the bf16 update can take: oneDNN's packed matmul, faster than both under load once, is not one of them
    assert said.startswith("probe: ") and set(timed) == {"torch", "native"}
    assert chose == (timed["native"] < timed["torch"]) or abs(timed["native"] - timed["torch"]) < 0.15  # 0.1 ms
