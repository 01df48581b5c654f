"""Which linear kernel a CPU run multiplies with, decided by a short timing probe once per process (or named by
the config's `kernels:`): the sampler's (`linear_kernel`: plain rows on huge pages, oneDNN's packed layout or the
compiled matmul, whichever streams the model's weight shapes fastest here) and the update's bf16 base linears
(`native_update_gemm`: the compiled matmul on the sampler's packed weights, or torch's). A probe is a timing: on a
busy machine two processes can decide differently, and the kernels round bf16 sums in different orders, so what
was decided is reported with the numbers it made (the rollout's `sampler`, the update's `linears`;
docs/operations.md, "Runs you can reproduce bit for bit"). `cpu_features` says which kernels this CPU can run.
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn.functional as F

from grpo_core.kernels import cpu_features, native, settings
from grpo_core.kernels.cpu_linear import onednn_linear, onednn_pack
from grpo_core.kernels.pages import hugepage_empty

# -- the sampler's linears --------------------------------------------------------------------------------------

PROBE_MATRICES = 256


def _stream_seconds(candidates: dict, rounds: int = 5) -> dict:
    """Median seconds of each candidate, run in turns (A B A B ...) so that a noisy neighbour hits all alike."""
    for fn in candidates.values():
        fn()
    times: dict = {k: [] for k in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def streaming_weights(shapes, mib: int, dtype: torch.dtype, huge_pages: bool = True, max_matrices: int | None = None):
    """Synthetic [out, in] weights of these shapes, repeated to ~`mib` MiB (far more than any cache holds) or to
    `max_matrices` matrices if fewer, in one flat buffer on 2 MiB pages (or ordinary ones) -> (flat buffer, list of
    weight views)."""
    per_set = sum(o * i for o, i in shapes)
    sets = max(2, mib * 2**20 // (per_set * torch.empty((), dtype=dtype).element_size()))
    if max_matrices is not None:
        sets = max(2, min(sets, max_matrices // len(shapes)))
    flat = hugepage_empty(per_set * sets, dtype) if huge_pages else torch.empty(per_set * sets, dtype=dtype)
    flat.normal_(std=0.02, generator=torch.Generator().manual_seed(0))
    weights, off = [], 0
    for _ in range(sets):
        for o, i in shapes:
            weights.append(flat[off:off + o * i].view(o, i))
            off += o * i
    return flat, weights


def native_gemm(dtype: torch.dtype, shapes) -> "native.NativeOps | None":
    """The compiled packed-weight matmul, where it runs for this dtype and these [out, in] shapes (where this
    CPU cannot run it, says why once)."""
    ops = native.load()
    if ops is None:
        return None
    name = str(dtype).removeprefix("torch.")
    reason = cpu_features.declines("compiled_matmul", dtype)
    if reason is None and not ops.packed_linear_supported(dtype):
        reason = f"the compiler built it without the {name} instructions this CPU has"
    if reason is not None:
        cpu_features.note_declined(f"compiled {name} matmul", reason)
        return None
    odd = dtype == torch.bfloat16 and any(i % 2 for _, i in shapes)          # bf16 packs inputs in pairs
    return None if odd else ops


def onednn_ok(dtype: torch.dtype) -> bool:
    """Does oneDNN pack weights of this dtype here (where not, says why once)?"""
    reason = cpu_features.declines("onednn_linear", dtype)
    if reason is not None:
        cpu_features.note_declined(f"oneDNN {str(dtype).removeprefix('torch.')} linears", reason)
    return reason is None


def linear_kernel(dtype: torch.dtype, rows: int, shapes: tuple[tuple[int, int], ...],
                  mib: int = 96) -> tuple[str, dict]:
    """"plain" (F.linear on rows of a huge-page buffer), "onednn" (oneDNN's packed layout) or "native" (the
    compiled matmul on column blocks in the huge-page buffer, `gemm_ops.cpp`), whichever streams ~`mib` MiB
    of synthetic weights of these [out, in] shapes fastest at `rows` rows, here (probed once per process);
    oneDNN only when more than 10% faster than the best other (it costs a second layout, outside the huge
    pages). The config's `kernels.decode_linear` names one instead (no probe). Returns (kernel, GB/s of each
    candidate)."""
    chosen = settings.current().decode_linear
    if chosen == "auto":
        return _probe(dtype, rows, shapes, mib)
    if chosen == "native" and native_gemm(dtype, shapes) is None:
        raise ValueError(f"kernels.decode_linear=native: the compiled matmul does not run for {dtype} here "
                         f"({cpu_features.declines('compiled_matmul', dtype) or 'odd input width, or no build'}); "
                         f"set kernels.decode_linear: auto")
    if chosen == "onednn" and not onednn_ok(dtype):
        raise ValueError(f"kernels.decode_linear=onednn: {cpu_features.declines('onednn_linear', dtype)}; set "
                         f"kernels.decode_linear: auto")
    return chosen, {}


@settings.forget_when("native", "max_cpu_isa")      # the candidates this CPU runs
@functools.cache
def _probe(dtype: torch.dtype, rows: int, shapes: tuple[tuple[int, int], ...], mib: int) -> tuple[str, dict]:
    # At most PROBE_MATRICES: a small model's layers fit in the caches (its decode does not stream either), and
    # thousands of tiny calls would time per-call overhead for seconds; a 135M model's 96 MiB is ~100 matrices.
    flat, weights = streaming_weights(shapes, mib, dtype, max_matrices=PROBE_MATRICES)
    itemsize = flat.element_size()
    g = torch.Generator().manual_seed(0)             # not the global stream: a resumed run must draw the same
    inputs = {i: torch.randn(rows, i, generator=g).to(dtype) for _, i in shapes}
    candidates = {"plain": lambda: [F.linear(inputs[w.size(1)], w) for w in weights]}
    if onednn_ok(dtype):
        packed = [(onednn_pack(w, rows), w.size(1)) for w in weights]
        candidates["onednn"] = lambda: [onednn_linear(inputs[i], p, None) for p, i in packed]
    ops = native_gemm(dtype, shapes)
    if ops is not None:
        blocks = [(ops.pack(w, hugepage_empty(ops.packed_numel(*w.shape), dtype)), *w.shape) for w in weights]
        candidates["native"] = lambda: [ops.packed_linear(inputs[i], p, None, o) for p, o, i in blocks]
    gbs = {k: flat.numel() * itemsize / s / 1e9 for k, s in _stream_seconds(candidates).items()}
    return max(gbs, key=lambda k: gbs[k] / (1.1 if k == "onednn" else 1.0)), gbs


# -- the update's linears ---------------------------------------------------------------------------------------

UPDATE_ROWS = (255, 512, 701)         # the probe's row counts: a micro-batch's packed prompts and answers


def native_update_gemm(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> bool:
    """Does the compiled matmul on packed weights multiply a layer's [out, in] weights of these shapes by the
    update's row counts (`UPDATE_ROWS`, odd ones among them: matmul libraries often run those slower) faster,
    all shapes together, than torch's matmul, the one the update takes otherwise? Probed once per process; it
    decides whether the update's forward reads the sampler's packed weights. The config's `kernels.update_linear:
    native` or `torch` decides instead. What decided is kept for the run's records (`update_reason`)."""
    chosen = settings.current().update_linear
    if chosen != "auto":
        use = chosen == "native" and native_gemm(dtype, shapes) is not None
        _UPDATE_REASONS[dtype, shapes] = f"kernels.update_linear: {chosen}" + \
            ("" if use or chosen == "torch" else ", but no compiled matmul here")
        return use
    if native_gemm(dtype, shapes) is None:
        _UPDATE_REASONS[dtype, shapes] = "no compiled matmul here"
        return False
    secs = _probe_update_gemm(dtype, shapes)
    _UPDATE_REASONS[dtype, shapes] = "probe: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in secs.items())
    return secs["native"] < secs["torch"]


_UPDATE_REASONS: dict = {}          # (dtype, shapes) -> what decided `native_update_gemm` last


def update_reason(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> str | None:
    """What decided `native_update_gemm` the last time it was asked about these shapes (None: never asked)."""
    return _UPDATE_REASONS.get((dtype, shapes))


@settings.forget_when("native", "max_cpu_isa")      # the candidates this CPU runs
@functools.cache
def _probe_update_gemm(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> dict[str, float]:
    """Median seconds of each candidate at the update's row counts (a timing: under load it can pick another)."""
    ops = native.load()
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(out, inp, generator=g) * 0.02).to(dtype) for out, inp in shapes]
    xs = {inp: [torch.randn(rows, inp, generator=g).to(dtype) for rows in UPDATE_ROWS] for _, inp in shapes}
    packed = [ops.pack(w, torch.empty(ops.packed_numel(*w.shape), dtype=dtype)) for w in ws]
    candidates = {"torch": lambda: [F.linear(x, w) for w in ws for x in xs[w.size(1)]],
                  "native": lambda: [ops.packed_linear(x, p, None, w.size(0))
                                     for w, p in zip(ws, packed) for x in xs[w.size(1)]]}
    return _stream_seconds(candidates, rounds=5)
