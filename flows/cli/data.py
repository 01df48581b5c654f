"""`grpo data ...`: build a curated dataset, print its statistics, list the sources.

The curation itself is grpo_core.data (build, stats, the source loaders); this module parses the
arguments and prints the results.
"""
from __future__ import annotations

import argparse
import json
import sys

from flows.cli.format import format_source_counts
from grpo_core.data.records import REASONS
from grpo_core.data.sources import list_sources

BUILD_EPILOG = """\
The config is YAML (a standalone file, or a training config with a `curation:` section):

  name: rust-mix
  out_dir: data/built
  sources:
    - {name: reasoning_gym, datasets: {gsm_symbolic: {size: 200}}}
    - {name: gen_rust, n: 40}
    - {name: humaneval_rust}
    - {name: stackexchange, path: dumps/rust/Posts.xml, tags: [rust]}
  weights: {synthetic: 0.7, community: 0.3}
  total: 300
  calibration: {band: [0.1, 0.9], rollouts: runs/r1/iter-2/scores.jsonl}

Output: <out_dir>/<name>-<hash12>/ with train.parquet, eval.parquet, report.json, rejections.jsonl.
Run `grpo data sources` for the source names and their options."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `data build`, `data stats` and `data sources` under a `data` command."""
    d = subparsers.add_parser("data", help="curate datasets: build, stats, sources",
                              description="Curate training data: load sources, validate, deduplicate, "
                                          "decontaminate, split, calibrate difficulty, mix.")
    dsub = d.add_subparsers(dest="data_command", metavar="<action>", required=True)

    b = dsub.add_parser("build", help="build a versioned dataset and its curation report",
                        epilog=BUILD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--config", "-c", required=True, metavar="YAML", help="curation config (see below)")
    b.add_argument("--out-dir", help="override out_dir")
    b.add_argument("--backend", choices=("auto", "sandbox", "local", "none"),
                   help="override validation.backend (how reference solutions are run)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_build)

    s = dsub.add_parser("stats", help="print statistics of a built dataset directory or a task file")
    s.add_argument("path", help="dataset directory, .parquet or .jsonl")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_stats)

    ls = dsub.add_parser("sources", help="list data sources (built-in and installed plugins) and rejection reasons")
    ls.set_defaults(func=cmd_sources)
    return d


def cmd_build(args) -> int:
    from grpo_core.data.build import build, load_build_config
    overrides = {}
    if args.out_dir:
        overrides["out_dir"] = args.out_dir
    try:
        cfg = load_build_config(args.config, overrides)
        if args.backend:
            cfg.validation.backend = args.backend
        result = build(cfg, progress=not args.no_progress)
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rep = result.report
    print(f"dataset {result.path}")
    print(f"  train {len(result.train)}  eval {len(result.eval)}  hash {rep['dataset_hash'][:12]}")
    print(format_source_counts(rep["sources"]))
    print("  rejections: " + (", ".join(f"{k}={v}" for k, v in rep["rejections"].items()) or "none"))
    print(f"  report: {result.path / 'report.json'}")
    if not result.train:
        print("error: no training task is left (every task was rejected or held out); the rejections above and "
              f"{result.path / 'rejections.jsonl'} say why; fix the sources or their options", file=sys.stderr)
        return 1
    return 0


def cmd_stats(args) -> int:
    from grpo_core.data.build import stats
    try:
        st = stats(args.path)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(st["path"])
    for k, v in st.get("metadata", {}).items():
        print(f"  {k}: {v}")
    for split_name, v in st.items():
        if not isinstance(v, dict) or "tasks" not in v:
            continue
        print(f"{split_name}: {v['tasks']} tasks")
        for key in ("sources", "kinds", "groups", "prompt_chars"):
            print(f"  {key}: " + ", ".join(f"{a}={b}" for a, b in v[key].items()))
        hist = v["pass_rate_histogram"]
        if any(hist.values()):
            print("  pass rate: " + ", ".join(f"{a}:{b}" for a, b in hist.items()))
    if st.get("rejections"):
        print("rejections: " + ", ".join(f"{k}={n}" for k, n in st["rejections"].items()))
    return 0


def cmd_sources(args) -> int:
    sources = list_sources()
    print("sources (name, group, what):")
    for s in sources:
        if s.origin == "built-in":
            print(f"  {s.name:<16}{s.group:<11}{s.summary}")
    plugins = [s for s in sources if s.origin != "built-in"]
    print("plugin sources (entry-point group grpo_pipeline.sources; name, group, what, from):")
    for s in plugins:
        print(f"  {s.name:<16}{s.group:<11}{s.summary}  [{s.origin}]")
    if not plugins:
        print('  none installed (any source may also be written "package.module:function")')
    print("rejection reasons:")
    for r, text in REASONS.items():
        print(f"  {r:<21}{text}")
    return 0

