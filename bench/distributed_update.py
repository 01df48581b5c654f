"""The update on N processes vs one (tasks/distributed.py): seconds per optimizer step and the largest weight
difference, on one fixed scored batch, CPU only (gloo).

Workload: the default model (SmolLM2-135M-Instruct) in fp32 (`--dtype`), LoRA r=16 on q/k/v/o, 4 prompts x 8 answers of
40 prompt and 48 completion tokens (random ids, mixed rewards), beta 0.04, loss dapo, one optimizer step per
update. One process uses `--threads`; each of the N processes max(1, threads // N) (accelerate launch,
started by the stage's own launcher). The rounds alternate (1 process, then N) so both see the same load.

    python bench/distributed_update.py --rounds 3 --processes 2 --threads 2     # the same 2 cores in all
    python bench/distributed_update.py --rounds 3 --processes 2 --threads 1     # 1 thread per process

Prints, per round, the step seconds of each and the max |weight difference|, then the medians; `--json`
writes them too. Process start and model load are not in the step time (they are in `launch_seconds`).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""            # gloo on the CPU

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from grpo_core.config import GRPOConfig  # noqa: E402
from grpo_core.io import read_jsonl, write_jsonl  # noqa: E402
from grpo_core.parallel import DataParallel  # noqa: E402
from tasks import distributed  # noqa: E402
from tasks.update import train_on_batch  # noqa: E402


def write_batch(directory: Path, prompts: int, answers: int, vocab: int) -> tuple[str, str]:
    rng = random.Random(0)
    samples, scores = [], []
    for g in range(prompts):
        prompt = [rng.randrange(100, vocab) for _ in range(40)]
        for _ in range(answers):
            samples.append({"group": g, "prompt_ids": prompt, "truncated": False,
                            "completion_ids": [rng.randrange(100, vocab) for _ in range(48)]})
            scores.append({"reward": float(rng.randint(0, 1))})
    return str(write_jsonl(directory / "samples.jsonl", samples)), str(write_jsonl(directory / "scores.jsonl", scores))


def max_weight_difference(a: str, b: str) -> float:
    ta, tb = (load_file(str(Path(d) / "checkpoint" / "adapter_model.safetensors")) for d in (a, b))
    return max((ta[k] - tb[k]).abs().max().item() for k in ta)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating 1-process / N-process updates")
    p.add_argument("--processes", type=int, default=2, help="N")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the one process (split over the N)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="the base's dtype (auto: the pipeline's choice for this CPU; the adapter stays fp32)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="dp-bench-"))
    config = GRPOConfig.model_validate(dict(
        model=args.model, device="cpu", dtype=args.dtype, num_generations=8, max_completion_length=48, loss_type="dapo", beta=0.04,
        learning_rate=1e-5, stages={"update": {"num_processes": args.processes}})).model_dump(mode="json")
    from grpo_core.model.loading import load_tokenizer, resolve_model
    batch = write_batch(tmp, 4, 8, len(load_tokenizer(resolve_model(args.model))))
    torch.set_num_threads(args.threads)
    rows = []
    for r in range(args.rounds):
        kwargs = lambda name: dict(config=config, run_dir=str(tmp / f"{name}-{r}"), iteration=1,  # noqa: E731
                                   samples=list(read_jsonl(batch[0])), scores=list(read_jsonl(batch[1])),
                                   checkpoint=None, state=None)
        one = train_on_batch(DataParallel(), **kwargs("one"))
        t0 = time.perf_counter()
        many = distributed.run_on_processes(train_on_batch, kwargs("many"), args.processes, "cpu", tmp / f"launch-{r}")
        rows.append({"step_seconds_1": one["steps"][0]["step_seconds"],
                     f"step_seconds_{args.processes}": many["steps"][0]["step_seconds"],
                     "launch_seconds": time.perf_counter() - t0,
                     "max_abs_weight_diff": max_weight_difference(one["out_dir"], many["out_dir"])})
        print(json.dumps(rows[-1]), flush=True)
    medians = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print("median:", json.dumps(medians))
    if args.json:
        from learning import machine
        args.json.write_text(json.dumps({"machine": machine(), "dtype": args.dtype, "threads": args.threads,
                                         "processes": args.processes, "rounds": rows, "median": medians,
                                         "load_average": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
