"""Optional vLLM rollout backend (GPU; `pip install grpo-pipeline[vllm]`). Imported only when
`rollout_backend: vllm` is chosen.

The base model is loaded once into a vLLM engine (colocated on the same GPU, sharing it with the
trainer via gpu_memory_utilization); the current LoRA adapter is saved to a temporary directory and
passed with each generate call as a LoRARequest, so the policy that samples is the policy being trained.
Full fine-tuning pushes the trainer's weights into the engine before each rollout. With
SamplingParams.logprobs each completion carries the engine's log-prob of every sampled token, taken
after the repetition penalty, temperature, min-p and top-k/top-p (`logprobs_mode="processed_logprobs"`,
vLLM >= 0.10.2, as TRL asks for): the trainer's importance correction compares them with its own.

Not testable without a GPU: bench/gpu_checks.sh exercises it on a GPU machine.
"""
from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

from grpo_core.rollout.sampling import Completion, SamplingParams, StopStrings


def vllm_sampling_kwargs(params: SamplingParams, n: int) -> dict:
    """vLLM SamplingParams keywords for `params`, as TRL's colocated generation builds them: min_p None is vLLM's
    0.0 (off), top_k 0 its -1 (all), the repetition penalty over the prompt and the output as transformers',
    then generation_kwargs (already checked against vLLM's fields when the config loaded). One difference from
    our samplers and generate: vLLM applies min_p before top-k/top-p, so with both min_p and top_p < 1 top-p
    sees the min-p-filtered distribution. With logprobs, 0: the sampled token's own log-prob only, processed
    (`logprobs_mode="processed_logprobs"`: after penalty, temperature, min-p, top-k and top-p)."""
    kwargs = dict(n=n, temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
                  top_k=params.top_k if params.top_k else -1, min_p=params.min_p or 0.0,
                  repetition_penalty=params.repetition_penalty, max_tokens=params.max_new_tokens, seed=params.seed,
                  logprobs=0 if params.logprobs else None)
    return {**kwargs, **params.generation_kwargs}


class VLLMBackend:
    _ids = itertools.count(1)

    def __init__(self, model_dir: str, policy, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.3,
                 max_lora_rank: int = 16, max_model_len: int = 2048, sampler_logprobs: bool = False,
                 model_impl: str = "vllm"):
        try:
            from vllm import LLM
        except ImportError as e:      # the extra is not installed
            raise ImportError("rollout_backend: vllm needs the vllm package (pip install 'grpo-pipeline[vllm]') "
                              "and a CUDA GPU; use rollout_backend: auto otherwise") from e
        self.policy = policy
        self.use_lora = policy.use_peft
        # processed log-probs (what the token was drawn from), only asked for when they are used
        extra = {"logprobs_mode": "processed_logprobs"} if sampler_logprobs else {}
        try:
            self.llm = LLM(model=str(model_dir), dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                           enable_lora=self.use_lora, max_lora_rank=max_lora_rank, max_model_len=max_model_len,
                           enable_prefix_caching=True, model_impl=model_impl, **extra)
        except TypeError as e:
            if not extra:
                raise
            raise ImportError("sampler log-probs (vllm_importance_sampling_correction, off_policy_mask_threshold) "
                              "need vLLM >= 0.10.2 (logprobs_mode)") from e
        self.eos = policy.tokenizer.eos_token_id
        self._tmp = tempfile.TemporaryDirectory(prefix="grpo-vllm-lora-")

    @classmethod
    def from_policy(cls, policy, cfg) -> "VLLMBackend":
        dtype = "bfloat16" if cfg.dtype in ("auto", "bfloat16") else "float32"
        return cls(policy.base_dir, policy, dtype=dtype, max_lora_rank=max(16, cfg.lora_r),
                   max_model_len=cfg.max_prompt_length + cfg.max_completion_length,
                   sampler_logprobs=cfg.needs_sampler_logprobs,
                   gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, model_impl=cfg.vllm_model_impl)

    def _sync(self):
        """The adapter (LoRA) to pass along, or the full weights pushed into the engine."""
        if self.use_lora:
            from vllm.lora.request import LoRARequest
            i = next(self._ids)
            path = Path(self._tmp.name) / f"adapter-{i}"
            self.policy.model.save_pretrained(path, selected_adapters=["default"])
            return LoRARequest(f"policy-{i}", i, str(path))
        state = self.policy.model.state_dict()
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner.model     # vLLM V0-style API
        runner.load_weights(state.items())
        return None

    def generate(self, prompts, n, params: SamplingParams):
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        kwargs = vllm_sampling_kwargs(params, n)
        if isinstance(kwargs.get("structured_outputs"), dict):             # as TRL: a dict from the YAML
            from vllm.sampling_params import StructuredOutputsParams
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        sp = VSP(**kwargs)
        lora = self._sync()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, lora_request=lora,
                                 use_tqdm=False)
        # stop strings are cut here, by the same rule as the other backends (vLLM's own `stop` drops the string)
        stops = StopStrings(self.policy.tokenizer, params.stop_strings)
        result = []
        for o in outs:
            group = []
            for c in o.outputs:
                ids = stops.cut(c.token_ids)
                logprobs = [step[t].logprob for t, step in zip(ids, c.logprobs)] if params.logprobs else None
                # an end at a stop string gets no EOS (`cut` found it before vLLM's own finish reason)
                if c.finish_reason == "stop" and not stops.ended(ids) and (not ids or ids[-1] != self.eos):
                    ids.append(self.eos)       # keep the "EOS included when the model stopped" convention
                    if logprobs is not None:
                        logprobs.append(float("nan"))              # not sampled: no correction for it
                group.append(Completion(ids, logprobs) if params.logprobs else ids)
            result.append(group)
        return result
