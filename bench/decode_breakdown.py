"""Where a decode step of the fused sampler spends its time, on step_speed.py's workload.

    python bench/decode_breakdown.py [--bf16] [--rounds 5] [--json out.json]

The fused sampler (grpo_core/kernels/fused_decode.py) of the step-speed policy is prefilled with 16 rows of
80 prompt tokens and then steps 64 tokens. Each variant removes one kind of work from every layer and the
difference to the full step is that work's cost, as it is paid *in place* (between the weight streams
that evict the caches, which makes a small op several times dearer than in a loop of its own):

    full            the real step (with the small ops compiled, grpo_core/kernels/native.py, where they load;
                    every layer in one compiled call where the linears are the compiled matmul's)
    full, per-op calls  the same step with one compiled call per operation from Python
    full, torch ops the step with those ops as torch ops; the next three ablate them there
    -attention      the decode attention returns its queries (no KV read)
    -rmsnorm        both RMSNorms of every layer return their input
    -activation     silu(gate) * up becomes gate
    -lora           the adapter's factors are left out (base weights only), on the real step
    linears only    the base weights of every layer and the LM head, streamed by the same kernels at the
                    same shapes, nothing else: the step's weight-reading time

Variants take turns (full, -attention, ..., full, ...) so that noise hits all alike; the outputs of
ablated variants are meaningless and not used. Prints the median ms per decode step of each, the GB/s the
weights were read at, and the machine, versions and commit.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_speed as S  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from grpo_core.kernels import fused_decode  # noqa: E402
from grpo_core.kernels.fused_decode import FusedDecoder  # noqa: E402

ROWS, PROMPT, NEW = 16, 80, 64


@contextlib.contextmanager
def patched_functional(**overrides):
    """fused_decode sees torch.nn.functional with these functions replaced."""
    real = fused_decode.F
    fused_decode.F = types.SimpleNamespace(**{**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")},
                                              **overrides})
    try:
        yield
    finally:
        fused_decode.F = real


def linears_and_widths(dec: FusedDecoder) -> list:
    """[(linear, input width)] of one decode step: the four of every layer, then the LM head."""
    C, attn, mlp = dec.embed.weight.size(1), dec.n_q * dec.d, dec.width
    return [(lin, w) for layer in dec.layers
            for lin, w in ((layer.qkv, C), (layer.o, attn), (layer.gate_up, C), (layer.down, mlp))] + [(dec.head, C)]


@contextlib.contextmanager
def without_lora(dec: FusedDecoder):
    linears = [lin for lin, _ in linears_and_widths(dec)]
    saved = [(lin.lora_a, lin.lora_b) for lin in linears]
    for lin in linears:
        lin.lora_a = lin.lora_b = None
    table, dec.table = dec.table, dec._layer_table()          # the one-call step reads the factors from its table
    try:
        yield
    finally:
        for lin, (a, b) in zip(linears, saved):
            lin.lora_a, lin.lora_b = a, b
        dec.table = table


@contextlib.contextmanager
def per_op_calls(dec: FusedDecoder):
    """The native step as one compiled call per operation from Python instead of one for all layers."""
    table, dec.table = dec.table, None
    try:
        yield
    finally:
        dec.table = table


def decode_seconds(dec: FusedDecoder, ids: torch.Tensor) -> float:
    """Prefill, then NEW steps; the seconds of the steps."""
    dec.prefill(ids, torch.ones_like(ids), NEW)
    tokens = ids[:, -1]
    t0 = time.perf_counter()
    for _ in range(NEW):
        dec.step(tokens)
    return time.perf_counter() - t0


def linears_seconds(dec: FusedDecoder) -> float:
    """NEW rounds of every base linear of the step at its decode shape (one row per sampled sequence)."""
    pairs = linears_and_widths(dec)
    x = {w: torch.randn(ROWS, 1, w).to(dec.embed.weight.dtype) for _, w in pairs}
    calls = [(lin, x[w]) for lin, w in pairs]
    with without_lora(dec):
        for lin, inp in calls:
            lin(inp)
        t0 = time.perf_counter()
        for _ in range(NEW):
            for lin, inp in calls:
                lin(inp)
        return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    args.device, args.backend = "cpu", "static"
    from learning import machine
    ours = S.Ours(args)
    torch.set_grad_enabled(False)
    dec = FusedDecoder.snapshot(ours.policy.model, ROWS)
    if dec is None:
        raise SystemExit("this model has no fused sampling forward (not Llama-family, or not on the CPU)")
    ids = torch.randint(100, 1000, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    identity = lambda x, *a, **k: x  # noqa: E731
    native_ops = dec.ops

    @contextlib.contextmanager
    def torch_ops(patch=contextlib.nullcontext):
        """The step's small ops as torch ops (the ablations patch those), then the native ops again."""
        dec.ops = None
        try:
            with patch():
                yield
        finally:
            dec.ops = native_ops

    variants = {
        "full": contextlib.nullcontext,
        "-attention": lambda: torch_ops(lambda: patched_functional(scaled_dot_product_attention=lambda q, *a, **k: q)),
        "-rmsnorm": lambda: torch_ops(lambda: patched_functional(rms_norm=identity)),
        "-activation": lambda: torch_ops(lambda: patched_functional(silu=identity)),
        "-lora": lambda: without_lora(dec),
    }
    if native_ops is not None:           # the ablations above run on torch ops: their own full step too
        variants = {"full": variants["full"], "full, torch ops": torch_ops, **dict(list(variants.items())[1:])}
    if dec.table is not None:            # every layer in one compiled call: also one call per operation
        variants = {"full": variants["full"], "full, per-op calls": lambda: per_op_calls(dec),
                    **dict(list(variants.items())[1:])}
    seconds: dict[str, list[float]] = {k: [] for k in [*variants, "linears only"]}
    for r in range(args.rounds + 1):
        for name, ctx in variants.items():
            with ctx():
                dt = decode_seconds(dec, ids)
            if r:
                seconds[name].append(dt)
        dt = linears_seconds(dec)
        if r:
            seconds["linears only"].append(dt)
    ms = {k: statistics.median(v) / NEW * 1e3 for k, v in seconds.items()}
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.policy.model.parameters()
                       if not p.requires_grad)
    print(f"{dec.path}; {ROWS} rows, {PROMPT} prompt tokens, {NEW} steps, median of {args.rounds}")
    print(f"{'variant':>15}  ms/step  cost of the removed work (against the full step it ablates)")
    for k, v in ms.items():
        base = "full, torch ops" if k in ("-attention", "-rmsnorm", "-activation") and "full, torch ops" in ms else "full"
        cost = "" if k == "full" else f"{ms[base] - v:+.2f}"
        print(f"{k:>15}  {v:7.2f}  {cost}")
    gbs = weight_bytes / (ms["linears only"] / 1e3) / 1e9
    print(f"weights read at {gbs:.1f} GB/s by the linears alone ({weight_bytes / 1e6:.0f} MB per step); the other "
          f"work is {ms['full'] - ms['linears only']:.2f} ms of the {ms['full']:.2f} ms step")
    res = {"machine": machine(), "sampler": dec.path, "ms_per_step": ms, "seconds": seconds,
           "weight_mb": weight_bytes / 1e6, "linears_gb_s": gbs}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
