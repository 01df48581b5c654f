"""The sampling engines: the one registry (`ENGINES`) every other place reads.

A rollout samples through one interface (`sampling.RolloutBackend.generate`, with the local engines' `session`,
`on_group` and streamed `turns`) and one of three engines behind it. `rollout_backend` names one, or `auto`
(the default): the fused engine where it applies (a Llama-family model on the CPU), the torch engine otherwise.
The config checks `generation_kwargs` against the chosen engine here (`engine_options`), the rollout's turn
driver (`multiturn.drive_turns`) asks the engine whether it streams turns, and docs/architecture.md's table
"Sampling engines" is these entries (tests/test_engines.py compares the two).

No torch here (the config's validators import it): each entry names its sampler class as "module:attribute".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

# generation_kwargs keys that name one of our sampling fields: every engine takes them, and they override the field
OWN_OPTIONS = ("top_p", "top_k", "min_p", "repetition_penalty")

# vLLM SamplingParams fields, for the check when vllm is not installed (where it is, its own fields are used)
VLLM_FIELDS = ("presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
               "bad_words", "logit_bias", "allowed_token_ids", "structured_outputs", "guided_decoding",
               "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
               "truncate_prompt_tokens", "extra_args", "detokenize", "prompt_logprobs")


@dataclass(frozen=True)
class Engine:
    """One sampling engine: its `rollout_backend` name, its sampler class, who takes it and why, and what it
    supports (each a cell of the table in docs/architecture.md)."""
    name: str
    sampler: str                # "module:attribute" of its RolloutBackend class
    takes_it: str               # when it samples: what auto picks, or who names it
    why: str
    devices: str
    architectures: str
    turns: str                  # multi-turn rollouts: streamed (each row's KV cache continues) or re-encoded
    streams_turns: bool
    sampler_logprobs: str
    filters: str                # top-k, top-p, min-p, repetition penalty, stop strings
    generation_kwargs: str      # beyond OWN_OPTIONS (the check: `engine_options`)
    kernel_choices: str

    def row(self) -> list[str]:
        """The engine's row of the table in docs/architecture.md."""
        return [f"`{self.name}`", f"`{self.sampler.replace(':', '.')}`", self.takes_it, self.why, self.devices,
                self.architectures, self.turns, self.sampler_logprobs, self.filters, self.generation_kwargs,
                self.kernel_choices]


TABLE_HEADER = ["engine", "sampler", "takes it", "why", "devices", "architectures", "multi-turn", "sampler log-probs",
                "top-k, top-p, min-p, repetition penalty, stop strings", "generation_kwargs", "kernel choices"]

_OUR_LOOP = ("all, in one place (`samplers.sample_next`, transformers' order: penalty, temperature, top-k, top-p, "
             "min-p; the compiled draw where no filter is on); stop strings after each token")

ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("fused", "grpo_core.rollout.samplers:FusedEngine",
           "auto, on the CPU, for the models it applies to", "the fastest CPU decode: one snapshot of the weights "
           "(adapter merged) packed for the machine's matmul, the step's small ops compiled",
           "CPU", "Llama family (llama, qwen2 model types; SiLU MLP; no sliding window)",
           "streamed", True, "yes (processed: what the token was drawn from)", _OUR_LOOP,
           "none", "`kernels:` decode_linear (auto: probed; plain, onednn, native), native (C++ step ops or the "
           "torch step: a CPU without a compiler runs the torch step)"),
    Engine("torch", "grpo_core.rollout.samplers:TorchEngine",
           "auto, where the fused engine does not apply (CUDA, other architectures); or named", "any device and "
           "architecture, the same loop and draws as fused: Llama-family models through the lean forward "
           "(`kernels/lean_decode.py`; on CUDA its step at fixed shapes, replayed as CUDA graphs: "
           "`kernels/graph_decode.py`), others through the model's own forward with a transformers cache",
           "CPU, CUDA", "any causal LM transformers loads",
           "streamed (re-encoded for sliding-window models on the model's own forward)", True,
           "yes (processed)", _OUR_LOOP, "none", "`kernels:` cuda_graphs (the CUDA-graph step on a GPU, else the lean forward eagerly); "
           "the lean forward's compiled trunk ops follow `kernels.native`"),
    Engine("vllm", "grpo_core.rollout.vllm_backend:VLLMBackend",
           "named (`rollout_backend: vllm`, the vllm extra)", "GPU throughput: a colocated vLLM engine, the adapter "
           "passed each call", "CUDA", "what vLLM runs (`vllm_model_impl`)",
           "re-encoded (as TRL)", False, "yes (vLLM's processed_logprobs, vLLM >= 0.10.2)",
           "vLLM's (min-p before top-k/top-p); stop strings cut by our rule", "vLLM SamplingParams fields",
           "vLLM's own"),
)}

# the names rollout_backend takes: auto picks an engine; static is the old name of auto
CHOICES = ("auto", *ENGINES)
ALIASES = {"static": "auto"}
REMOVED = {"hf": "rollout_backend: hf (transformers' generate) was removed (issue #49); use torch (our KV-cache "
                 "loop, on the model's own forward where the lean one does not apply: any architecture, CPU or "
                 "CUDA) or auto (the default)"}


def engine_name(choice: str) -> str:
    """`rollout_backend` (after its aliases) -> the name of the engine that samples where auto's choice does not
    depend on the model: auto -> "auto" (fused or torch, decided when sampling starts)."""
    return ALIASES.get(choice, choice)


@functools.lru_cache(maxsize=None)
def engine_options(choice: str) -> frozenset[str]:
    """The generation_kwargs keys `choice` (a rollout_backend) maps onto its engine: vllm its SamplingParams
    fields, the others none (`sampling.backend_options` takes out OWN_OPTIONS and the pipeline's own keys). Looked
    up once per process: the config check asks for every key and every engine, and a missing vllm would otherwise
    be searched for each time."""
    if engine_name(choice) != "vllm":
        return frozenset()
    try:
        from vllm import SamplingParams as VSP
        return frozenset(k for k in getattr(VSP, "__struct_fields__", ()) if not k.startswith("_")) or \
            frozenset(VLLM_FIELDS)
    except ImportError:
        return frozenset(VLLM_FIELDS)
