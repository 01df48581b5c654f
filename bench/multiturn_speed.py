"""Multi-turn rollout speed: rollouts of 1, 2 and 4 turns, against the one-turn sampler and TRL 1.16's tool loop.

    python bench/multiturn_speed.py [--rounds 3] [--no-trl] [--json out.json]

Workload (the same for every contender): the default model (SmolLM2-135M-Instruct) in fp32 on CPU, 2 prompts
x 8 completions, at most 64 new tokens per rollout, temperature 1, one tool (`lookup`, which answers a fixed
short text after --tool-ms of waiting, a sandbox call's order of magnitude). The model is given a chat template
that renders tools itself (TRL's Qwen2.5 template: SmolLM2 shares its <|im_start|>/<|im_end|> tokens), so both
trainers render prompts and tool turns the same way.

A small model does not call tools on cue, so to make every rollout take exactly T turns the tool-call parser is
replaced, in ours (grpo_core.rollout.multiturn.parse_tool_calls) and in TRL (its parse_response), by one that reports a
`lookup` call after every turn, and the rounds are capped at T - 1 (max_tool_calling_iterations). A turn that
ends by the token budget ends the rollout in both.

Contenders, interleaved round by round in one process so machine noise hits all alike (the first round is a
warm-up): `one-turn` (our rollout, no tools), `ours T=1,2,4` (our tool loop as configured by default: each
row's later turns continue its own KV cache, the calls of a step run during the next decode step and the
batch then waits for them, reproducible), `overlap T=2,4` (tool_calls_overlap: the other rows keep decoding
for as long as the calls take), `re-encoded T=2,4` (our tool loop with that
off: the calls of a round run together, then each conversation is re-encoded for the next turn, as the `hf`
and `vllm` samplers do), `trl T=1,2,4` (TRL's GRPOTrainer._generate with the same tool). Prints median seconds per rollout and model tokens per second
(tokens the model sampled: TRL's tool-response tokens are not counted), with the machine, versions and commit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_speed as S  # noqa: E402

import grpo_core.rollout.multiturn as multiturn  # noqa: E402
from grpo_core.rollout.samplers import rollout  # noqa: E402
from grpo_core.rollout.sampling import SamplingParams  # noqa: E402
from grpo_core.rollout.tools import ToolCall, tool_of  # noqa: E402

TURNS = (1, 2, 4)
ANSWER = "The record says: blue, 42, and the word 'harbour'."


def make_lookup(delay_s: float):
    def lookup(key: str) -> str:
        """Look a key up in the records.

        Args:
            key: the key to look up.
        """
        time.sleep(delay_s)
        return ANSWER
    return lookup


def qwen_template() -> str:
    import trl
    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def always_call(text: str) -> list:
    return [ToolCall("lookup", {"key": "a"}, None)]


class Ours:
    def __init__(self, args, lookup):
        self.o = S.Ours(args)
        self.tok = self.o.policy.tokenizer
        self.tok.chat_template = qwen_template()
        self.tool = tool_of(lookup, "bench")

    def run(self, turns: int | None, k: int, stream: bool = True, overlap: bool = False) -> tuple[float, int]:
        cfg = self.o.cfg
        params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=1.0, seed=k)
        toolbox = None if turns is None else multiturn.Toolbox([self.tool], max_iterations=turns - 1, overlap=overlap)
        real = multiturn.parse_tool_calls
        multiturn.parse_tool_calls = always_call
        streams = type(self.o.backend).streams_turns
        type(self.o.backend).streams_turns = stream
        try:
            t0 = time.perf_counter()
            out = rollout(self.o.backend, self.tok, S.prompts_for(k, cfg), cfg.num_generations, params,
                          S.SYSTEM_PROMPT, cfg.max_prompt_length, toolbox=toolbox)
            dt = time.perf_counter() - t0
        finally:
            multiturn.parse_tool_calls = real
            type(self.o.backend).streams_turns = streams
        return dt, sum(sum(s.completion_mask) if s.completion_mask else len(s.completion_ids) for s in out)


class TRLLoop:
    """TRL's GRPOTrainer._generate (its tool loop included) on the same model, prompts and tool."""

    def __init__(self, args, lookup, tmp: str):
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig as TRLConfig, GRPOTrainer
        from grpo_core.model.loading import resolve_model
        cfg = S.workload_config(args)
        path = resolve_model(cfg.model)
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        tok.chat_template = qwen_template()
        self.cfg, self.trainers, self.lookup = cfg, {}, lookup
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        rows = [{"prompt": [{"role": "user", "content": "x"}]}] * 16
        for turns in TURNS:
            tcfg = TRLConfig(output_dir=tmp, per_device_train_batch_size=16, num_generations=8,
                             max_completion_length=cfg.max_completion_length, temperature=1.0, top_p=1.0,
                             max_tool_calling_iterations=turns - 1, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, beta=0.0)
            self.trainers[turns] = GRPOTrainer(model=model, reward_funcs=[lambda prompts, completions, **k: [0.0] *
                                                                           len(prompts)],
                                               args=tcfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
                                               tools=[lookup])

    def run(self, turns: int, k: int) -> tuple[float, int]:
        import torch
        import trl.trainer.grpo_trainer as G
        real = G.parse_response

        def forced(tokenizer, ids, **kw):
            message = real(tokenizer, ids, **kw)
            message["tool_calls"] = [{"type": "function", "function": {"name": "lookup", "arguments": {"key": "a"}}}]
            return message
        prompts = [[{"role": "system", "content": S.SYSTEM_PROMPT}, {"role": "user", "content": t.prompt}]
                   for t in S.prompts_for(k, self.cfg) for _ in range(self.cfg.num_generations)]
        trainer = self.trainers[turns]
        trainer._sync_tool_dicts = [{"lookup": self.lookup}] * len(prompts)    # what a training step sets up
        trainer._async_tool_dicts = [{}] * len(prompts)
        G.parse_response = forced
        torch.manual_seed(k)
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                out = trainer._generate(prompts)
            dt = time.perf_counter() - t0
        finally:
            G.parse_response = real
        completion_ids, tool_mask = out[1], out[2]
        tokens = sum(sum(m) for m in tool_mask) if tool_mask is not None else sum(len(c) for c in completion_ids)
        return dt, tokens


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds after the warm-up one")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tool-ms", type=float, default=50.0, help="how long the tool takes per call")
    ap.add_argument("--no-trl", action="store_true", help="leave TRL out")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    args.device, args.backend, args.bf16, args.steps, args.warmup = "cpu", "static", False, 1, 0
    import tempfile
    from learning import machine
    lookup = make_lookup(args.tool_ms / 1000)
    ours = Ours(args, lookup)
    trl = None if args.no_trl else TRLLoop(args, lookup, tempfile.mkdtemp(prefix="bench-trl-"))
    contenders = {"one-turn": lambda k: ours.run(None, k)}
    contenders.update({f"ours T={t}": (lambda k, t=t: ours.run(t, k)) for t in TURNS})
    contenders.update({f"overlap T={t}": (lambda k, t=t: ours.run(t, k, overlap=True)) for t in TURNS if t > 1})
    contenders.update({f"re-encoded T={t}": (lambda k, t=t: ours.run(t, k, stream=False)) for t in TURNS if t > 1})
    if trl is not None:
        contenders.update({f"trl T={t}": (lambda k, t=t: trl.run(t, k)) for t in TURNS})
    seconds: dict[str, list[float]] = {k: [] for k in contenders}
    tokens: dict[str, list[int]] = {k: [] for k in contenders}
    for r in range(args.rounds + 1):
        for name, run in contenders.items():
            dt, n = run(r)
            print(f"  round {r} {name:>16}: {dt:6.2f} s, {n} model tokens", flush=True)
            if r:
                seconds[name].append(dt)
                tokens[name].append(n)
    res = {"machine": machine(), "workload": {"prompts": 2, "generations": 8, "max_completion_length": 64,
                                              "tool_ms": args.tool_ms, "sampler": ours.o.backend.path},
           "median_s": {k: statistics.median(v) for k, v in seconds.items()},
           "tokens_per_s": {k: sum(tokens[k]) / sum(v) for k, v in seconds.items()},
           "seconds": seconds, "tokens": tokens}
    for name in contenders:
        print(f"{name:>16}: median {res['median_s'][name]:6.2f} s per rollout, {res['tokens_per_s'][name]:6.1f} "
              f"model tokens/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
