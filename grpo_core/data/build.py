"""`grpo data build`: load -> normalise -> validate -> dedupe -> split -> decontaminate -> calibrate -> mix,
then write a versioned dataset (Parquet, content hash in the directory name and the file metadata) and a
curation report (JSON: counts per source and per rejection reason, pass-rate histogram).

Config (YAML; either at top level or under a `curation:` key):

    name: rust-mix
    out_dir: data/built
    seed: 0
    sources:                       # loader name + its options (see grpo_core.data.sources)
      - {name: reasoning_gym, datasets: {gsm_symbolic: {size: 200}}}
      - {name: gen_rust, n: 40}
      - {name: humaneval_rust}
      - {name: stackexchange, path: dumps/rust/Posts.xml, tags: [rust]}
    weights: {synthetic: 0.7, community: 0.3}   # per group or per source name
    total: 300                     # size of the mixed training set (null: all that survive)
    eval_fraction: 0.1
    eval_files: []                 # extra JSONL/Parquet eval sets to decontaminate against
    validation: {backend: auto, workers: 2}
    dedupe: {near_threshold: 0.85, shingle: 5}
    decontam: {ngram: 8, threshold: 0.5}
    calibration: {band: [0.1, 0.9], k: 8, rollouts: null, model: null}   # model: e.g. smollm2-135m-instruct
"""
from __future__ import annotations

import hashlib
import inspect
import json
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from grpo_core.config import yaml_error_message
from grpo_core.data import curation
from grpo_core.data.records import REASONS, Rejection
from grpo_core.task import Task, read_tasks
from grpo_core.io import atomic_dir, atomic_write_text, load_yaml, write_jsonl
from grpo_core.data.sources import GROUPS, SOURCE_NAMES, check_source, get_loader
from grpo_core.data.validate import validate

# -- config ----------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ValidationSpec(_Strict):
    backend: str = Field("auto", description="auto | sandbox | local | none")
    workers: int = Field(2, ge=1)


class DedupeSpec(_Strict):
    near_threshold: float = Field(0.85, gt=0, le=1, description="Jaccard of word shingles; 1 disables near-dup")
    shingle: int = Field(5, ge=1)
    num_perm: int = Field(64, ge=8)
    bands: int = Field(16, ge=1)


class DecontamSpec(_Strict):
    ngram: int = Field(8, ge=2)
    threshold: float = Field(0.5, gt=0, le=1, description="fraction of a train prompt's n-grams found in eval")
    boilerplate_df: int = Field(20, ge=2, description="n-grams in this many prompts are boilerplate, ignored")


class CalibrationSpec(_Strict):
    band: tuple[float, float] = (0.1, 0.9)
    k: int = Field(8, ge=1)
    rollouts: str | None = Field(None, description="scores JSONL of a previous iteration to recalibrate from")
    min_samples: int = Field(2, ge=1)
    model: str | None = Field(None, description="sample k answers per task from this model (built-in name or "
                              "local dir) and keep tasks inside the band; null: no sampling")
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)

    @field_validator("band")
    @classmethod
    def _band(cls, v):
        if not 0 <= v[0] <= v[1] <= 1:
            raise ValueError(f"calibration.band must be [low, high] with 0 <= low <= high <= 1, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _k_can_land_in_band(self):
        """k samples give pass rates 0, 1/k, ..., 1: with none inside the band every task would be dropped."""
        if self.model:
            curation.check_samples_fit_band(self.k, tuple(self.band))
        return self


class BuildConfig(_Strict):
    name: str = Field("dataset", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    out_dir: str = "data/built"
    seed: int = 0
    sources: list[dict[str, Any]] = Field(default_factory=lambda: [{"name": "reasoning_gym"}])
    weights: dict[str, float] = Field(default_factory=dict)
    total: int | None = Field(None, ge=1)
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    eval_total: int | None = Field(None, ge=1)
    eval_files: list[str] = Field(default_factory=list)
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    dedupe: DedupeSpec = Field(default_factory=DedupeSpec)
    decontam: DecontamSpec = Field(default_factory=DecontamSpec)
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)

    @field_validator("sources")
    @classmethod
    def _sources(cls, v):
        for i, s in enumerate(v):
            if not isinstance(s, dict) or "name" not in s:
                raise ValueError(f"sources[{i}] must be a mapping with a 'name' (one of {', '.join(SOURCE_NAMES)})")
            check_source(s["name"], f"sources[{i}].name")    # built in or a plugin; the error says the fix
            _check_options(i, s["name"], {"seed": 0, **{k: v for k, v in s.items() if k != "name"}})
            if s["name"] in SOURCE_NAMES:
                _check_counts(i, s["name"], s)
        return v

    @field_validator("weights")
    @classmethod
    def _weights(cls, v):
        curation.check_weights(v)
        return v


# the least value of a built-in source's count options: a negative count, or a fraction, is a typo
_COUNT_MINIMUM = {"n": 0, "limit": 0, "n_cases": 2}


def _check_counts(i: int, name: str, options: dict[str, Any]) -> None:
    """The count options of built-in sources[i] are whole numbers at or above their minimum (a count per kind,
    as tool_problems' `n: {product: 50}`, each)."""
    for key, least in _COUNT_MINIMUM.items():
        value = options.get(key)
        for count in (value.values() if isinstance(value, dict) else () if value is None else (value,)):
            if isinstance(count, bool) or not isinstance(count, int) or count < least:
                raise ValueError(f"sources[{i}] ({name}): option {key!r} must be a whole number >= {least}"
                                 f"{' for each kind' if isinstance(value, dict) else ''}, got {value!r}")


def check_weight_keys(cfg: BuildConfig, tasks: list[Task]) -> None:
    """A `weights` key must name a group, a configured source, or the source or group of a loaded task: any other
    key is a typo whose quota would silently go to the other keys."""
    configured = {s["name"] for s in cfg.sources}
    known = set(GROUPS) | configured | {get_loader(name)[1] for name in configured} | {
        key for t in tasks for key in curation.mix_keys(t)}
    if unknown := sorted(set(cfg.weights) - known):
        raise ValueError(f"weights: {', '.join(map(repr, unknown))} names no group or loaded source; use one of "
                         f"{', '.join(sorted(known))}")


def _check_options(i: int, name: str, options: dict[str, Any]) -> None:
    """The options of sources[i] against its loader's signature (`options` with the seed load_sources adds). A
    built-in loader's `**_` only takes what other loaders are given: an option it does not name is a typo."""
    signature = inspect.signature(get_loader(name)[0])
    params = signature.parameters
    try:
        signature.bind(**options)
    except TypeError as e:
        raise ValueError(f"sources[{i}] ({name}): {e}; fix its options (`grpo data sources` lists them)") from None
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    named = [p for p in params if params[p].kind not in variadic]
    if "_" in params and (unknown := sorted(set(options) - set(named) - {"seed"})):
        raise ValueError(f"sources[{i}] ({name}): unknown option(s) {', '.join(unknown)}; it takes "
                         f"{', '.join(named) or 'none'}")


def load_build_config(path: str | Path, overrides: dict[str, Any] | None = None) -> BuildConfig:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data config {str(p)!r} does not exist; pass an existing YAML file to --config")
    try:
        raw = load_yaml(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ValueError(f"data config {str(p)!r} is not UTF-8 text ({e.object[e.start]:#04x} at byte {e.start}); "
                         f"save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ValueError(yaml_error_message(f"data config {str(p)!r}", e)) from None
    if isinstance(raw, dict) and "curation" in raw:
        raw = raw["curation"]
    if not isinstance(raw, dict):
        raise ValueError(f"data config {str(p)!r} must hold a mapping (name:, sources:, ...), not a list or a single "
                         f"value; `grpo data build --help` shows one")
    raw = {**raw, **(overrides or {})}
    try:
        return BuildConfig.model_validate(raw)
    except ValidationError as e:
        lines = [f"invalid data config {str(p)!r}:"]
        lines += [f"  {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise ValueError("\n".join(lines)) from None


# -- progress --------------------------------------------------------------------------------------------


@contextmanager
def _bar(desc: str, total: int | None, enabled: bool) -> Iterator:
    if not enabled:
        yield lambda n=1: None
        return
    from tqdm.auto import tqdm
    with tqdm(total=total, desc=desc, unit="task", leave=False) as bar:
        yield bar.update


# -- build -------------------------------------------------------------------------------------------------


@dataclass
class BuildResult:
    path: Path
    train: list[Task]
    eval: list[Task]
    rejections: list[Rejection]
    report: dict[str, Any] = field(default_factory=dict)


def load_sources(cfg: BuildConfig, progress: bool = False) -> tuple[list[Task], list[Rejection], dict[str, Counter]]:
    """Run every configured loader; tag each task with its source name and group."""
    tasks: list[Task] = []
    rejected: list[Rejection] = []
    loaded: dict[str, Counter] = defaultdict(Counter)
    with _bar("load", len(cfg.sources), progress) as tick:
        for spec in cfg.sources:
            opts = {k: v for k, v in spec.items() if k != "name"}
            loader, group = get_loader(spec["name"])
            opts.setdefault("seed", cfg.seed)
            for rec in loader(**opts):
                if isinstance(rec, Rejection):
                    rejected.append(rec)
                else:
                    rec.meta.setdefault("group", group)
                    rec.meta.setdefault("source_name", spec["name"])
                    tasks.append(curation.normalise(rec))
                loaded[spec["name"]]["loaded"] += 1
            tick(1)
    return tasks, rejected, loaded


def build(cfg: BuildConfig, policy: curation.PolicyFn | None = None, progress: bool = False,
          write: bool = True) -> BuildResult:
    """The whole curation pipeline. `policy(tasks, k)` (optional) calibrates difficulty on the current model."""
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    tasks, rejected, loaded = load_sources(cfg, progress)
    check_weight_keys(cfg, tasks)
    timings["load"] = time.monotonic() - t0

    t0 = time.monotonic()
    with _bar("validate", len(tasks), progress) as tick:
        tasks, bad = validate(tasks, backend=cfg.validation.backend, workers=cfg.validation.workers, progress=tick)
    rejected += bad
    timings["validate"] = time.monotonic() - t0

    t0 = time.monotonic()
    d = cfg.dedupe
    tasks, bad = curation.dedupe(tasks, d.near_threshold, d.shingle, d.num_perm, d.bands)
    rejected += bad
    timings["dedupe"] = time.monotonic() - t0

    train, ev = curation.split(tasks, cfg.eval_fraction)
    if cfg.eval_total is not None and len(ev) > cfg.eval_total:
        ev = sorted(ev, key=lambda t: curation.stable_hash(str(cfg.seed), t.content_hash()))[:cfg.eval_total]
    curation.use_eval_wording(train, ev)
    external = [t for f in cfg.eval_files for t in read_any(f)]
    t0 = time.monotonic()
    x = cfg.decontam
    train, bad = curation.decontaminate(train, ev + external, x.ngram, x.threshold, x.boilerplate_df)
    rejected += bad
    timings["decontaminate"] = time.monotonic() - t0

    t0 = time.monotonic()
    c = cfg.calibration
    measured = list(train)
    if c.rollouts:
        train, bad = curation.recalibrate(train, c.rollouts, tuple(c.band), c.min_samples)
        rejected += bad
    if policy is None and c.model:
        from grpo_core.data.model_policy import model_policy
        policy = model_policy(c.model, c.max_new_tokens, c.temperature, seed=cfg.seed)
    if policy is not None:
        with _bar("calibrate", len(train), progress) as tick:
            train, bad = curation.calibrate(train, policy, c.k, tuple(c.band), progress=tick)
        rejected += bad
    timings["calibrate"] = time.monotonic() - t0

    selected, not_selected = curation.mix(train, cfg.weights, cfg.total, cfg.seed)
    rejected += not_selected
    report = make_report(cfg, loaded, selected, ev, rejected, timings, measured)
    path = write_dataset(cfg, selected, ev, rejected, report) if write else Path(cfg.out_dir)
    return BuildResult(path=path, train=selected, eval=ev, rejections=rejected, report=report)


def dataset_hash(train: list[Task], ev: list[Task]) -> str:
    h = hashlib.sha256()
    for split_name, items in (("train", train), ("eval", ev)):
        for ch in sorted(t.content_hash() for t in items):
            h.update(f"{split_name}:{ch}\n".encode())
    return h.hexdigest()


def make_report(cfg: BuildConfig, loaded: dict[str, Counter], train: list[Task], ev: list[Task],
                rejected: list[Rejection], timings: dict[str, float],
                measured: list[Task] | None = None) -> dict[str, Any]:
    per_source: dict[str, dict[str, Any]] = {}
    for name in [s["name"] for s in cfg.sources]:
        per_source.setdefault(name, {"group": get_loader(name)[1], "loaded": loaded[name]["loaded"],
                                     "rejected": Counter(), "train": 0, "eval": 0})
    src_of_id: dict[str, str] = {}
    for t in train + ev:
        src_of_id[t.id] = curation.source_key(t)
    for r in rejected:
        key = r.source.split("/")[0]
        per_source.setdefault(key, {"group": "?", "loaded": 0, "rejected": Counter(), "train": 0, "eval": 0})
        per_source[key]["rejected"][r.reason] += 1
    for split_name, items in (("train", train), ("eval", ev)):
        for t in items:
            per_source.setdefault(curation.source_key(t), {"group": curation.group_of(t), "loaded": 0,
                                                           "rejected": Counter(), "train": 0, "eval": 0})
            per_source[curation.source_key(t)][split_name] += 1
    for v in per_source.values():
        v["valid"] = v["loaded"] - sum(n for r, n in v["rejected"].items()
                                       if r not in ("duplicate_exact", "duplicate_near", "contaminated",
                                                    "out_of_band", "not_selected"))
        v["rejected"] = dict(sorted(v["rejected"].items()))
    reasons = Counter(r.reason for r in rejected)
    return {
        "name": cfg.name,
        "dataset_hash": dataset_hash(train, ev),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "totals": {"loaded": sum(v["loaded"] for v in per_source.values()), "train": len(train), "eval": len(ev),
                   "rejected": len(rejected)},
        "sources": per_source,
        "groups": dict(Counter(curation.group_of(t) for t in train)),
        "kinds": {"train": dict(Counter(t.kind for t in train)), "eval": dict(Counter(t.kind for t in ev))},
        "rejections": dict(sorted(reasons.items())),
        "reason_descriptions": {r: REASONS[r] for r in sorted(reasons)},
        "pass_rate_histogram": curation.pass_rate_histogram(measured or []),
        "pass_rate_histogram_kept": curation.pass_rate_histogram(train),
        "validation_backend": Counter(t.meta.get("validated_by", "static") for t in train + ev),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "config": cfg.model_dump(mode="json"),
    }


# -- dataset files ----------------------------------------------------------------------------------------

JSON_COLUMNS = ("tests", "meta")


def tasks_to_table(tasks: list[Task], metadata: dict[str, str] | None = None):
    import pyarrow as pa
    rows = []
    for t in tasks:
        d = t.to_dict()
        for c in JSON_COLUMNS:
            d[c] = None if d[c] is None else json.dumps(d[c], sort_keys=True, ensure_ascii=False)
        rows.append(d)
    schema = pa.schema([(f, pa.float64() if f == "difficulty" else pa.string()) for f in Task.__dataclass_fields__])
    table = pa.Table.from_pylist(rows, schema=schema)
    return table.replace_schema_metadata({**(table.schema.metadata or {}), **{
        k.encode(): v.encode() for k, v in (metadata or {}).items()}})


def table_to_tasks(table) -> list[Task]:
    out = []
    for d in table.to_pylist():
        for c in JSON_COLUMNS:
            d[c] = None if d.get(c) is None else json.loads(d[c])
        d["meta"] = d.get("meta") or {}
        out.append(Task.from_dict(d))
    return out


def write_dataset(cfg: BuildConfig, train: list[Task], ev: list[Task], rejected: list[Rejection],
                  report: dict[str, Any]) -> Path:
    """<out_dir>/<name>-<hash12>/{train,eval}.parquet + report.json + rejections.jsonl, moved in atomically."""
    import pyarrow.parquet as pq
    h = report["dataset_hash"]
    final = Path(cfg.out_dir) / f"{cfg.name}-{h[:12]}"
    meta = {"grpo.dataset_hash": h, "grpo.name": cfg.name, "grpo.schema": "grpo_core.task.Task"}

    def build(tmp: Path) -> None:
        for split_name, items in (("train", train), ("eval", ev)):
            pq.write_table(tasks_to_table(items, {**meta, "grpo.split": split_name}), tmp / f"{split_name}.parquet")
        atomic_write_text(tmp / "report.json", json.dumps({**report, "path": str(final)}, indent=2,
                                                          sort_keys=False, default=_json_default))
        write_jsonl(tmp / "rejections.jsonl", (r.to_dict() for r in rejected))

    return atomic_dir(final, build)   # same content hash = same dataset: an existing copy is kept


def _json_default(o: Any) -> Any:
    if isinstance(o, Counter):
        return dict(o)
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def read_dataset(path: str | Path, split: str = "train") -> list[Task]:
    """Tasks of a built dataset directory (or a .parquet / .jsonl file)."""
    p = Path(path)
    if p.is_dir():
        p = p / f"{split}.parquet"
    return read_any(p)


def read_any(path: str | Path) -> list[Task]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"task file {str(p)!r} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq
        return table_to_tasks(pq.read_table(p))
    return read_tasks(p)


def dataset_metadata(path: str | Path) -> dict[str, str]:
    import pyarrow.parquet as pq
    p = Path(path)
    p = p / "train.parquet" if p.is_dir() else p
    md = pq.read_schema(p).metadata or {}
    return {k.decode(): v.decode() for k, v in md.items() if k.startswith(b"grpo.")}


def stats(path: str | Path) -> dict[str, Any]:
    """Summary of a built dataset (dir) or task file: counts per split, source, kind, difficulty bins."""
    p = Path(path)
    splits = {"train": read_dataset(p, "train"), "eval": read_dataset(p, "eval")} if p.is_dir() \
        else {p.name: read_any(p)}
    out: dict[str, Any] = {"path": str(p)}
    if p.is_dir():
        out["metadata"] = dataset_metadata(p)
    for name, items in splits.items():
        lens = sorted(len(t.prompt) for t in items) or [0]
        out[name] = {
            "tasks": len(items),
            "sources": dict(Counter(t.source.split("/")[0] for t in items).most_common()),
            "kinds": dict(Counter(t.kind for t in items)),
            "groups": dict(Counter(curation.group_of(t) for t in items)),
            "prompt_chars": {"min": lens[0], "median": lens[len(lens) // 2], "max": lens[-1]},
            "pass_rate_histogram": curation.pass_rate_histogram(items),
        }
    if p.is_dir() and (p / "report.json").is_file():
        rep = json.loads((p / "report.json").read_text())
        out["rejections"] = rep.get("rejections", {})
    return out
