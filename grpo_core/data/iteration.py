"""What the `curate` stage does with curated data each iteration (pure Python; `tasks/curate.py` calls it).

Once per run: resolve `data.curated` and write the held-out split. `data.curated` may name
  - a dataset directory from `grpo data build` (used as is),
  - a curation YAML (built once into <run_dir>/data/built),
  - the user's own JSONL/CSV/Parquet file, `datasets` directory (`save_to_disk`) or folder of such files and
    Stack Exchange Posts.xml dumps (whatever it holds when the run starts): read with the same column aliases
    as `grpo data build` (sources/files.py), then validated, deduplicated and split by content like any
    build, cached by the content hash of its files so that a second run on the same files reuses it.
The resolution is recorded in <run_dir>/data/curated.json. Every iteration: re-measure each task's pass
rate from the previous iterations' scores (later iterations win), drop tasks outside
`data.pass_rate_band` (groups that are all right or all wrong teach nothing), and draw
`data.prompts_per_iteration` prompts with the configured per-source/group weights.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from grpo_core.data import curation
from grpo_core.data.build import BuildConfig, build, load_build_config, read_dataset, write_dataset
from grpo_core.data.records import REASONS
from grpo_core.data.sources.files import folder_files
from grpo_core.task import Task, write_tasks
from grpo_core.io import InputError, atomic_write_text, read_json

FILE_EVAL_FRACTION = 0.1  # held-out share of a user's file
FILE_LOADERS = {".jsonl": "jsonl", ".csv": "csv", ".parquet": "parquet"}
HF_DISK_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
FILE_BUILD_VERSION = "user-file-v2"  # part of the cache key: bump when the file pipeline changes (v2: content keys read
                                     # '.5' as 0.5, '5 − 3', '$5 \times 3$' as 5 - 3, 5 * 3)


# -- resolving data.curated ------------------------------------------------------------------------------


def is_built_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "train.parquet").is_file()


def file_source(path: Path) -> dict[str, Any]:
    """The `grpo data build` source spec that reads the user's file or `datasets` directory."""
    if path.is_dir():
        if any((path / m).is_file() for m in HF_DISK_MARKERS):
            return {"name": "hf_disk", "path": str(path)}
        if folder_files(path):
            return {"name": "folder", "path": str(path)}
        raise InputError(f"data.curated: {str(path)!r} is a directory but neither a `grpo data build` dataset "
                         "(train.parquet), a `datasets` directory written with save_to_disk, nor a folder of "
                         ".jsonl/.csv/.parquet/Posts.xml files; add your files to it or point it at one of those")
    if path.suffix.lower() not in FILE_LOADERS:
        raise InputError(f"data.curated: {str(path)!r} has an unknown type; give a .jsonl, .csv or .parquet file, "
                         "a `datasets` directory, a dataset from `grpo data build` or a curation YAML")
    return {"name": FILE_LOADERS[path.suffix.lower()], "path": str(path)}


def _missing(spec: str) -> str:
    return (f"data.curated: {spec!r} does not exist; give a dataset directory from `grpo data build`, a "
            "curation YAML, or a .jsonl/.csv/.parquet file")


# What to do about the rows a user file lost, by the most common reason (grpo_core.data.records.REASONS).
REJECTION_FIXES = {
    "not_verifiable": "give each row an answer (answer|final_answer|solution_value) or hidden tests",
    "invalid_schema": "give the file a prompt column (prompt|question|problem|instruction) and an answer column "
                      "(answer|final_answer|solution_value) or tests",
    "answer_unparseable": "write the answers as numbers or math expressions",
    "duplicate_exact": "add distinct questions", "duplicate_near": "add distinct questions",
}


def no_usable_rows(spec: str, report: dict[str, Any], rejections: list) -> str:
    """One line for a user file that yields no training task: what was rejected, why, and the fix."""
    if not report["totals"].get("loaded"):
        return f"data.curated: {spec!r} has no rows; add rows with a prompt and an answer (or hidden tests)"
    reasons = Counter(r.reason for r in rejections).most_common()
    first = next(r for r in rejections if r.reason == reasons[0][0])
    return (f"data.curated: no usable rows in {spec!r}: {len(rejections)} rejected "
            f"({', '.join(f'{n} {reason}' for reason, n in reasons)}; e.g. {first.detail or first.id}); "
            f"{REJECTION_FIXES.get(reasons[0][0], 'fix the rows the reasons name')}")


def content_key(path: Path) -> str:
    """Hash of the file's bytes (of every file, for a directory) and of how it is curated."""
    h = hashlib.sha256(f"{FILE_BUILD_VERSION}:{FILE_EVAL_FRACTION}".encode())
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    for f in files:
        h.update(f"\n{f.relative_to(path) if f != path else f.name}\n".encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def build_user_file(path: Path, cache_dir: Path) -> Path:
    """Validate, dedupe and split the user's file once; later calls with the same bytes reuse the result."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem).lstrip("._-") or "data"
    key = content_key(path)[:16]
    marker = cache_dir / f"{name}-{key}.json"
    if marker.is_file() and Path(cached := read_json(marker)["path"]).is_dir():
        return Path(cached)
    cfg = BuildConfig(name=name, out_dir=str(cache_dir / f"{name}-{key}"), sources=[file_source(path)],
                      eval_fraction=FILE_EVAL_FRACTION)
    result = build(cfg, write=False)        # written only when usable: a failed build leaves nothing behind
    if not result.train:
        raise InputError(no_usable_rows(str(path), result.report, result.rejections))
    built = write_dataset(cfg, result.train, result.eval, result.rejections, result.report)
    atomic_write_text(marker, json.dumps({"path": str(built), "file": str(path), "content_key": key}))
    return built


def resolve_curated(spec: str, run_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The built dataset directory `data.curated` stands for, resolved (and built if needed) once per run.

    User files are cached under `cache_dir` (default <run_dir>/data/curated); curation YAMLs are built
    into <run_dir>/data/built."""
    if (done := already_resolved(spec, run_dir)) is not None:
        return done
    marker = Path(run_dir) / "data" / "curated.json"
    p = Path(spec)
    if p.suffix in (".yaml", ".yml"):
        path = build(load_build_config(p, {"out_dir": str(Path(run_dir) / "data" / "built")})).path
    elif not p.exists():
        raise FileNotFoundError(_missing(spec))
    elif is_built_dataset(p):
        path = p
    else:
        path = build_user_file(p, Path(cache_dir) if cache_dir else Path(run_dir) / "data" / "curated")
    atomic_write_text(marker, json.dumps({"spec": spec, "path": str(path), **dataset_summary(path)}))
    return path


def already_resolved(spec: str, run_dir: str | Path) -> Path | None:
    """The dataset a run already resolved `spec` to (its data/curated.json), if any."""
    marker = Path(run_dir) / "data" / "curated.json"
    if marker.is_file() and (resolved := read_json(marker)).get("spec", spec) == spec:
        return Path(resolved["path"])
    return None


def check_curated(spec: str, run_dir: str | Path, cache_dir: str | Path) -> set[str] | None:
    """Before a run: `data.curated` exists and yields training and held-out tasks (a user file is curated
    now, into the same cache the run reads; a resumed run's own resolution is used as is). Returns the
    task kinds it holds (None for a curation YAML, which the run builds: only its config is checked here).
    Raises InputError naming the file and the fix; writes nothing under `run_dir`."""
    p = already_resolved(spec, run_dir) or Path(spec)
    if p.suffix in (".yaml", ".yml"):
        try:
            load_build_config(p)
        except (FileNotFoundError, ValueError) as e:
            raise InputError(f"data.curated: {'; '.join(str(e).splitlines())}") from e
        return None
    if not p.exists():
        raise InputError(_missing(spec))
    try:
        train, ev = splits_of(peek_curated(spec, run_dir, cache_dir))
    except InputError:
        raise
    except (ValueError, OSError) as e:       # undecodable text, a corrupt Parquet file, ...
        raise InputError(f"data.curated: {spec!r} cannot be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); fix or re-export the file") from e
    if not train or not ev:
        raise InputError(f"data.curated: {spec!r} has {len(train)} training and {len(ev)} held-out tasks; both "
                         f"must be > 0: add distinct rows (a user file holds out {FILE_EVAL_FRACTION:.0%} of them) "
                         f"or build the dataset with eval_fraction > 0")
    return {t.kind for t in train + ev}


def peek_curated(spec: str, run_dir: str | Path, cache_dir: str | Path) -> Path | None:
    """The built dataset `spec` stands for, found without writing under `run_dir`: the run's own resolution, a
    built directory, a user file curated into `cache_dir`; None for a curation YAML the run has not built yet."""
    p = already_resolved(spec, run_dir) or Path(spec)
    if p.suffix in (".yaml", ".yml"):
        return None
    return p if is_built_dataset(p) else build_user_file(p, Path(cache_dir))


def dataset_summary(path: Path) -> dict[str, Any]:
    """Counts of a built dataset from its report: totals and rows rejected per reason."""
    report = path / "report.json"
    if not report.is_file():
        return {"hash": None, "totals": {}, "rejections": {}}
    rep = json.loads(report.read_text())
    return {"hash": rep.get("dataset_hash"), "totals": rep.get("totals", {}), "rejections": rep.get("rejections", {})}


def describe_rejections(spec: str, path: Path) -> str:
    """One paragraph for the user: how many rows were kept, how many were rejected and why."""
    s = dataset_summary(path)
    t = s["totals"]
    lines = [f"data.curated {spec}: {t.get('train', '?')} training and {t.get('eval', '?')} held-out tasks "
             f"({path}); {t.get('rejected', 0)} rows rejected"
             + (f", one line each in {path / 'rejections.jsonl'}:" if s["rejections"] else ".")]
    lines += [f"  {n:6d}  {reason}: {REASONS.get(reason, '')}" for reason, n in
              sorted(s["rejections"].items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def splits_of(path: Path) -> tuple[list[Task], list[Task]]:
    """(train, eval) of a built dataset directory."""
    return read_dataset(path, "train"), read_dataset(path, "eval")


def eval_tasks(spec: str, run_dir: str | Path, n: int, cache_dir: str | Path | None = None) -> list[Task]:
    """Up to n held-out tasks, in a stable order."""
    return held_out_of(resolve_curated(spec, run_dir, cache_dir), n, spec)


def held_out_of(path: Path, n: int, spec: str) -> list[Task]:
    """Up to n held-out tasks of the built dataset at `path` (data.curated `spec`), in a stable order."""
    _, ev = splits_of(path)
    if not ev:
        raise InputError(f"data.curated {spec!r} has no eval split; build it with eval_fraction > 0 "
                         "(a user file needs enough distinct rows for a 10% split)")
    return sorted(ev, key=lambda t: t.content_hash())[:n]


def gate_tasks(spec: str, run_dir: str | Path, n: int, seed: int, cache_dir: str | Path | None = None) -> list[Task]:
    """The promotion gate's questions: up to n of the training split, never more than a quarter of it (a small
    dataset keeps most of its questions to train on and gets a smaller gate), drawn in an order of their own
    seed (never from the eval split, on which runs pick their registered iteration); curation then keeps them
    out of training."""
    train, ev = splits_of(resolve_curated(spec, run_dir, cache_dir))
    train, _ = curation.decontaminate(train, ev)
    if len(train) < 4:
        raise InputError(f"data.curated {spec!r} has {len(train)} training tasks, too few to set any aside for the "
                         f"promotion gate; add rows or set gate.enabled: false")
    return sorted(train, key=lambda t: _gate_rank(seed, t))[:min(n, len(train) // 4)]


def _gate_rank(seed: int, task: Task) -> str:
    """The order of the gate's draw: a hash of the seed and the task's content."""
    return hashlib.sha256(f"gate-{seed}:{task.content_hash()}".encode()).hexdigest()


# -- each iteration ---------------------------------------------------------------------------------------


def previous_pass_rates(run_dir: str | Path, iteration: int, max_age: int = 0) -> dict[str, tuple[float, int]]:
    """{task id: (pass rate, samples)} from iter-1..iter-(k-1)/scores.jsonl, the latest measurement winning.
    With `max_age`, only the last max_age iterations count: an older rate was the policy's of then, so its task
    is untried again rather than out of the band for good."""
    rates: dict[str, tuple[float, int]] = {}
    for k in range(max(1, iteration - max_age) if max_age else 1, iteration):
        path = Path(run_dir) / f"iter-{k}" / "scores.jsonl"
        if path.is_file():
            rates.update(curation.pass_rates_from_rollouts(path))
    return rates


def draw_prompts(pool: list[Task], n: int, weights: dict[str, float], seed: int, band: tuple[float, float],
                 rates: dict[str, tuple[float, int]], min_samples: int = 2) -> tuple[list[Task], dict[str, Any]]:
    """n prompts inside the band (untried tasks count as inside), topped up with the nearest outside."""
    inside, outside = curation.recalibrate(pool, rates, band, min_samples)
    chosen, _ = curation.mix(inside, weights, n, seed)
    if len(chosen) < n and outside:
        by_id = {t.id: t for t in pool}
        lo, hi = band
        nearest = sorted((by_id[r.id] for r in outside),
                         key=lambda t: (min(abs(t.meta["pass_rate"] - lo), abs(t.meta["pass_rate"] - hi)), t.content_hash()))
        chosen += nearest[:n - len(chosen)]
    info = {
        "pool": len(pool), "in_band": len(inside), "out_of_band": len(outside),
        "measured": sum(1 for t in pool if t.id in rates), "prompts": len(chosen),
        "sources": dict(Counter(curation.source_key(t) for t in chosen)),
        "kinds": dict(Counter(t.kind for t in chosen)),
        "pass_rate_histogram": curation.pass_rate_histogram(t for t in pool if t.id in rates),
    }
    return chosen, info


def question_hashes(tasks: Sequence[Task]) -> list[str]:
    """The questions of `tasks` by content (Task.content_hash), sorted: what `new since the parent run` counts."""
    return sorted({t.content_hash() for t in tasks})


def freshness(pool: Sequence[Task], known: set[str] | None) -> dict[str, int]:
    """How many questions of the pool the parent run's pool did not hold ({} when there is no parent pool)."""
    if known is None:
        return {}
    return {"new_questions": sum(1 for h in question_hashes(pool) if h not in known)}


def curate_iteration(spec: str, run_dir: str | Path, iteration: int, n: int, weights: dict[str, float],
                     band: tuple[float, float], recalibrate: bool, seed: int, out_dir: str | Path,
                     cache_dir: str | Path | None = None, gate: Sequence[Task] = (),
                     known_questions: set[str] | None = None, max_age: int = 0) -> dict[str, Any]:
    """Write <out_dir>/prompts.jsonl and curation.json; return the stage record fields. Training never asks
    a `gate` question (decontaminated like a build's eval split); `known_questions` (the parent run's pool by
    content hash) gives the count of new questions. The pool's hashes go to <run_dir>/data/questions.txt.
    Pass rates older than `max_age` iterations (0: none) no longer count (previous_pass_rates)."""
    path = resolve_curated(spec, run_dir, cache_dir)
    train, _ = splits_of(path)
    train, contaminated = curation.decontaminate(train, gate) if gate else (train, [])
    if not train:
        raise InputError(f"data.curated {spec!r} has no training tasks; add rows or build it with a "
                         "smaller eval_fraction" + (" (the rest ask gate questions)" if contaminated else ""))
    pool_file = Path(run_dir) / "data" / "questions.txt"
    if not pool_file.is_file():
        atomic_write_text(pool_file, "".join(h + "\n" for h in question_hashes(train)))
    rates = previous_pass_rates(run_dir, iteration, max_age) if recalibrate else {}
    prompts, info = draw_prompts(train, n, weights, seed * 100_003 + iteration, band, rates)
    fresh = freshness(train, known_questions)
    info.update({"gate_excluded": len(contaminated), **fresh})
    out = write_tasks(Path(out_dir) / "prompts.jsonl", prompts)
    report = {"dataset": str(path), "iteration": iteration, "band": list(band), "weights": weights, **info}
    report_path = atomic_write_text(Path(out_dir) / "curation.json", json.dumps(report, indent=2))
    return {"prompts": str(out), "num_prompts": len(prompts), "sources": info["sources"],
            "report": str(report_path), "dataset": str(path),
            "rejections": dataset_summary(path)["rejections"],
            "metrics": {"pool": info["pool"], "in_band": info["in_band"], "out_of_band": info["out_of_band"],
                        "measured": info["measured"], "gate_excluded": info["gate_excluded"], **fresh}}
