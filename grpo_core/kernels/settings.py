"""The run's kernel choices (the config's `kernels:` section), held for this process.

The kernels decide deep inside the samplers and the update, far from where the config is read, so the
choices are not threaded through every constructor: `apply(cfg.kernels)` makes them this process's where a
run starts (`flows/train.py`), where each stage starts (`tasks/stage.py`, in whatever process or work pool it
runs) and where a policy is loaded (`grpo_core.model.policy.load_policy`: the data-parallel processes, `grpo eval`,
the benchmarks), and the kernels read `current()`. Until a call the defaults hold: probe, detect, compiled
kernels on, no CPU cap.

What a kernel decided and cached under other settings (the CPU's capped features, the compiled library, the
probes) is forgotten when those settings change (`forget_when`). Nothing here reads the environment;
`$GRPO_MAX_CPU_ISA` and `$GRPO_CPU_BF16` are the tests' pins, read where they apply (docs/operations.md).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

DECODE_LINEARS = ("auto", "plain", "onednn", "native")    # auto: the probe picks (kernel_probes.linear_kernel)
UPDATE_LINEARS = ("auto", "native", "torch")              # auto: the probe decides (kernel_probes.native_update_gemm)
ISA_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")      # the CPU caps, lowest first (cpu_features)


@dataclass(frozen=True)
class KernelSettings:
    decode_linear: str = "auto"         # the sampler's linear kernel: DECODE_LINEARS
    update_linear: str = "auto"         # the update's bf16 base linears: UPDATE_LINEARS
    native: bool = True                 # the compiled kernels (native.py); false: torch ops everywhere
    max_cpu_isa: str | None = None      # see the CPU as one of at most this level: ISA_LEVELS
    cpu_bf16: bool | str = "auto"       # dtype auto on the CPU: bf16 base weights (True), fp32 (False), detect
    cuda_graphs: bool = True            # the torch engine's decode step on CUDA as CUDA graphs (graph_decode)

    def __post_init__(self):
        for name, allowed in (("decode_linear", DECODE_LINEARS), ("update_linear", UPDATE_LINEARS),
                              ("max_cpu_isa", (None, *ISA_LEVELS)), ("cpu_bf16", ("auto", True, False))):
            value = getattr(self, name)
            if value not in allowed or (name == "cpu_bf16" and type(value) not in (bool, str)):
                raise ValueError(f"kernels.{name}={value!r}: use one of {', '.join(map(str, allowed))}")


_current = KernelSettings()
_forgetters: list[tuple[frozenset[str], Callable[[], None]]] = []     # (settings it depends on, cache_clear)


def current() -> KernelSettings:
    """The settings in force in this process."""
    return _current


def apply(section: Any) -> KernelSettings:
    """Make the choices of `section` (the config's `kernels:`, a KernelSettings, or anything with the same
    fields) this process's; returns the settings they replace, for a caller that puts them back."""
    global _current
    previous = _current
    _current = KernelSettings(**{f.name: getattr(section, f.name) for f in fields(KernelSettings)})
    changed = {f.name for f in fields(KernelSettings) if getattr(previous, f.name) != getattr(_current, f.name)}
    for depends_on, cache_clear in _forgetters:
        if depends_on & changed:
            cache_clear()
    return previous


def forget_when(*changed: str) -> Callable[[Callable], Callable]:
    """Decorate a `functools.cache`d decision that depends on these settings: its cache is cleared whenever
    one of them changes (a decision made under the old settings must not outlive them)."""
    unknown = set(changed) - {f.name for f in fields(KernelSettings)}
    if unknown:
        raise ValueError(f"forget_when: no setting named {', '.join(sorted(unknown))}")

    def register(cached: Callable) -> Callable:
        _forgetters.append((frozenset(changed), cached.cache_clear))
        return cached
    return register
