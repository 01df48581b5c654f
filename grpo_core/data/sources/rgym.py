"""reasoning-gym (`reasoning-gym==0.1.25`, Apache-2.0): procedural tasks with their own answer checkers.

Each task stores in `meta` how to rebuild its reasoning-gym entry (dataset name, config, seed, size,
index), so a reward function can ask the dataset's own checker: `grpo_core.rewards.answers.reasoning_gym_score`.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from grpo_core.rewards.answers import reasoning_gym_dataset
from grpo_core.data.records import Rejection
from grpo_core.task import Task

DEFAULT_DATASETS: dict[str, dict[str, Any]] = {
    "gsm_symbolic": {"size": 200},
    "basic_arithmetic": {"size": 100},
    "chain_sum": {"size": 100},
    "leg_counting": {"size": 50},
    "fraction_simplification": {"size": 50},
}
PROVENANCE_NOTES = {
    "gsm_symbolic": "GSM-Symbolic templates derived from GSM8K (OpenAI, MIT) as shipped in reasoning-gym; "
                    "numbers are re-sampled, so items are not verbatim GSM8K test problems",
}


def is_reasoning_gym(task: Task) -> bool:
    return task.meta.get("checker") == "reasoning_gym"


def load(datasets: dict[str, dict[str, Any]] | None = None, seed: int = 0,
         **_: Any) -> Iterable[Task | Rejection]:
    """Yield tasks from each reasoning-gym dataset: {name: {"size": n, "config": {...}}}."""
    for name, opts in (datasets or DEFAULT_DATASETS).items():
        size = int(opts.get("size", 50))
        config = dict(opts.get("config") or {})
        ds_seed = int(opts.get("seed", seed))
        ds = reasoning_gym_dataset(name, json.dumps(config, sort_keys=True), ds_seed, size)
        for i in range(size):
            entry = ds[i]
            tid = f"rg/{name}/s{ds_seed}/{i}"
            meta = {"checker": "reasoning_gym", "rg_dataset": name, "rg_config": config, "rg_seed": ds_seed,
                    "rg_size": size, "rg_index": i,
                    "rg_difficulty": _jsonable(entry.get("metadata", {}).get("difficulty"))}
            if float(ds.score_answer(entry["answer"], entry) or 0.0) < 1.0:
                yield Rejection(tid, "reasoning_gym", "checker_rejects_gold", f"{name}[{i}]")
                continue
            yield Task(id=tid, kind="math", source=f"reasoning_gym/{name}", prompt=entry["question"],
                       answer=str(entry["answer"]), license="Apache-2.0",
                       provenance=f"reasoning-gym==0.1.25 {name} seed={ds_seed} index={i}"
                                  + (f"; {PROVENANCE_NOTES[name]}" if name in PROVENANCE_NOTES else ""),
                       meta=meta)


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return str(x)
