"""Completion tables during training: the update's prompts, completions, rewards and advantages, as an MLflow
table (completions/iter_<kkkk>.json, every tracking.log_completions_steps iterations) and as console text
(num_completions_to_print). Everything comes from the update stage, which reads samples.jsonl and scores.jsonl
once: the rows, the advantages `grpo_update` trained with, and the prompts decoded by the policy's tokenizer."""
from __future__ import annotations

from grpo_core.config import GRPOConfig
from grpo_core.rewards.rewards import model_token_count
from grpo_core.rollout.sampling import readable_conversation
from tasks.tracking import COMPLETIONS_DIR, console, log_table

__all__ = ["COMPLETIONS_DIR", "completion_table", "log_completions", "printed_completions", "prompt_texts"]


def prompt_texts(samples: list[dict], tokenizer) -> list[str]:
    """Each row's prompt as the model saw it (`prompt_ids` decoded without special tokens; each distinct prompt
    decoded once), in row order."""
    decoded: dict[tuple, str] = {}
    for r in samples:
        if (ids := tuple(r["prompt_ids"])) not in decoded:
            decoded[ids] = tokenizer.decode(list(ids), skip_special_tokens=True)
    return [decoded[tuple(r["prompt_ids"])] for r in samples]


def _completion_text(row: dict) -> str:
    return readable_conversation(row["extra"]) if "turns" in (row.get("extra") or {}) else row["completion"]


def completion_table(samples: list[dict], scores: list[dict], advantages: list[float | None], prompts: list[str],
                     iteration: int, max_prompts: int, unique_prompts: bool = False) -> dict[str, list]:
    """Columns for log_table: the first `max_prompts` prompts (`prompts[i]`: row i's, as the model saw it), each
    with all its completions, the reward of each reward function, the total, the advantage and whether it was
    sampled after the guide's prompt (data.guided_completions) rather than the one shown. `unique_prompts`
    (TRL's log_unique_prompts): one row per prompt text, its first completion's."""
    groups = set(list(dict.fromkeys(r["group"] for r in samples))[:max_prompts])
    funcs = list(dict.fromkeys(f for sc in scores for f in sc.get("rewards", {})))
    cols: dict[str, list] = {c: [] for c in ("iteration", "group", "task_id", "prompt", "completion",
                                             *[f"reward_{f}" for f in funcs], "reward", "advantage", "correct",
                                             "length", "truncated", "guided")}
    shown: dict[int, str] = {}
    for r, sc, adv, prompt in zip(samples, scores, advantages, prompts):
        if r["group"] not in groups:
            continue
        if r["group"] not in shown:
            shown[r["group"]] = prompt
            if unique_prompts and prompt in cols["prompt"]:
                groups.discard(r["group"])          # the same text as an earlier prompt: its row is there
                continue
        elif unique_prompts:
            continue
        row = {"iteration": iteration, "group": r["group"], "task_id": r["task_id"], "prompt": shown[r["group"]],
               "completion": _completion_text(r), "reward": sc["reward"], "advantage": adv,
               "correct": sc.get("correct"),
               "length": model_token_count(r["completion_ids"], r.get("completion_mask")),
               "truncated": r["truncated"], "guided": bool((r.get("extra") or {}).get("guided")),
               **{f"reward_{f}": sc["rewards"].get(f) for f in funcs}}
        for c in cols:
            cols[c].append(row[c])
    return cols


def printed_completions(samples: list[dict], scores: list[dict], advantages: list[float | None], prompts: list[str],
                        iteration: int, n: int, seed: int, prompt_chars: int = 300) -> str:
    """TRL's num_completions_to_print as console text: `n` of the iteration's completions drawn at random (a
    stream of its own, seeded by `seed` and the iteration: the run's random streams are untouched), each
    with the end of its prompt (at most `prompt_chars` characters), the completion, the total reward and each
    function's, and the advantage (None: did not train)."""
    import random
    picked = sorted(random.Random(f"{seed}:{iteration}").sample(range(len(samples)), min(n, len(samples))))
    lines = [f"completions of iteration {iteration} ({len(picked)} of {len(samples)}, drawn at random):"]
    for k, i in enumerate(picked, 1):
        r, sc, adv, prompt = samples[i], scores[i], advantages[i], prompts[i]
        prompt = prompt if len(prompt) <= prompt_chars else "..." + prompt[-prompt_chars:]
        per_func = ", ".join(f"{f}={v}" for f, v in (sc.get("rewards") or {}).items())
        lines += [f"[{k}] group {r['group']}, task {r['task_id']}: reward {sc['reward']} ({per_func}), advantage "
                  f"{'None' if adv is None else f'{adv:.4f}'}",
                  "  prompt: " + prompt.replace("\n", "\n    "),
                  "  completion: " + _completion_text(r).replace("\n", "\n    ")]
    return "\n".join(lines)


def log_completions(cfg: GRPOConfig, run_id: str | None, iteration: int, samples: list[dict], scores: list[dict],
                    advantages: list[float | None], prompts: list[str]) -> bool:
    """Every tracking.log_completions_steps iterations, the completion table of this iteration's update as
    completions/iter_<kkkk>.json (once: a re-run stage finds it and skips; log_unique_prompts: one row per
    prompt). With num_completions_to_print, after every update, that many completions to the console log
    (`printed_completions`). `samples`, `scores`: the rows of samples.jsonl and scores.jsonl; `advantages`:
    grpo_update's, one per row; `prompts`: `prompt_texts`. True if the table was logged."""
    t = cfg.tracking
    table_due = bool(t.log_completions and run_id and iteration % t.log_completions_steps == 0)
    if cfg.num_completions_to_print:
        console(printed_completions(samples, scores, advantages, prompts, iteration, cfg.num_completions_to_print,
                                    cfg.seed))
    if not table_due:
        return False
    table = completion_table(samples, scores, advantages, prompts, iteration, t.log_completions_prompts,
                             cfg.log_unique_prompts)
    return log_table(cfg, run_id, table, f"{COMPLETIONS_DIR}/iter_{iteration:04d}.json")
