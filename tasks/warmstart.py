"""warmstart: before the first GRPO update, the policy's correct answers in the full prompt (or the questions' reference
exchanges, warmstart.demonstrations) are fine-tuned in as answers to the questions without the worked examples
(grpo_core/update/warmstart.py); the iteration's later stages start from the adapter it writes. Runs in iteration 1
when warmstart.enabled."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from grpo_core.io import write_jsonl
from grpo_core.model.policy import load_policy
from grpo_core.rollout.sampling import readable_conversation
from grpo_core.task import read_tasks
from grpo_core.update.warmstart import collect_demonstrations, supervised_finetune
from tasks import tracking
from tasks.curate import training_prompts
from tasks.layout import cfg_of, iter_dir
from tasks.run_state import init_adapter_path, mlflow_run_id
from tasks.stage import stage


@stage("warmstart", key=lambda config, checkpoint, **_: {"config": config, "checkpoint": checkpoint})
def warmstart(config: dict, run_dir: str, iteration: int, checkpoint: str | None) -> dict:
    cfg = cfg_of(config)
    w, out = cfg.warmstart, iter_dir(run_dir, iteration) / "warmstart"
    # 1) questions of its own, never held out or gated, and the policy where the run starts
    prompts = training_prompts(cfg, run_dir, iteration, w.prompts, out, cfg.seed + 1_000_003)["prompts"]
    torch.manual_seed(cfg.seed * 31 + iteration)                # the fresh adapter, as the update would make it
    policy = load_policy(cfg, checkpoint, need_reference=False, init_adapter=init_adapter_path(run_dir))
    # 2) its correct answers in the full prompt (or the questions' reference exchanges), as demonstrations without
    #    the examples
    demos, kept, stats = collect_demonstrations(policy, read_tasks(prompts), cfg, seed=cfg.seed * 7919 + 17)
    write_jsonl(out / "demonstrations.jsonl", [{"task_id": s.task_id, "completion": s.completion,
                                                 **({"reference": True} if s.extra.get("reference") else {}),
                                                 **({"conversation": readable_conversation(s.extra)}
                                                    if s.extra.get("conversation") else {})} for s in kept])
    # 3) supervised fine-tuning, and the adapter the iteration goes on from
    steps = w.epochs * -(-len(demos) // w.batch_size)
    with tqdm(total=steps, desc="warm start", unit="step") as bar:
        losses = supervised_finetune(policy, demos, w.epochs, w.batch_size, w.learning_rate or cfg.learning_rate,
                                     cfg.max_grad_norm, cfg.seed, bar, cfg.cast_lm_head_to_fp32) if demos else []
    adapter = policy.save(out / "checkpoint")
    metrics = {**{f"warmstart/{k}": v for k, v in stats.items()}, "warmstart/steps": float(len(losses)),
               **({"warmstart/loss_first": losses[0], "warmstart/loss_last": losses[-1]} if losses else {})}
    tracking.console(warmstart_summary(stats, losses))
    if (run_id := mlflow_run_id(run_dir)):
        tracking.log_metrics(cfg, run_id, metrics, step=0)
    return {"checkpoint": str(adapter), "metrics": metrics}


def warmstart_summary(stats: dict[str, float], losses: list[float]) -> str:
    """One line for the run log: what was demonstrated and how far the fine-tuning went."""
    line = (f"warm start: {int(stats['demonstrations'])} demonstrations on {int(stats['questions_demonstrated'])} "
            f"of {int(stats['questions'])} questions")
    if stats.get("answers"):
        line += f" ({int(stats['answers'])} answers sampled)"
    if "references" in stats:
        line += f"; reference exchanges kept {int(stats['references_kept'])} of {int(stats['references'])}"
    if not losses:
        return line + "; nothing to fine-tune (no correct answer), the run starts from the model as it is"
    return line + f"; SFT loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps"
