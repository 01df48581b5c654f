"""PNG plots of a run's evaluations (matplotlib, headless): curves over iterations and length histograms.

Pure functions of the eval history: {iteration: metrics} and {iteration: per-completion lengths}.
"""
from __future__ import annotations

from pathlib import Path

from grpo_core.evaluation.evaluate import MODES


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _groups(history: dict[int, dict]) -> list[str]:
    """Metric prefixes to plot: overall first, then each source / kind."""
    prefixes = set()
    for m in history.values():
        for k in m:
            parts = k.split("/")
            if len(parts) >= 4 and parts[0] == "eval" and parts[2] in MODES and parts[1] != "monitor":
                prefixes.add(parts[1])
    return ["(all)"] + sorted(prefixes)


def _key(group: str, rest: str) -> str:
    return f"eval/{rest}" if group == "(all)" else f"eval/{group}/{rest}"


def curve_plot(history: dict[int, dict], metric_suffixes: list[str], title: str, ylabel: str, out: Path) -> Path | None:
    """One panel per group (overall + each source); one line per mode/metric. None if nothing to plot."""
    iters = sorted(history)
    groups = _groups(history)
    lines = [(g, f"{mode}/{suf}") for g in groups for mode in MODES for suf in metric_suffixes]
    if not any(_key(g, s) in history[i] for g, s in lines for i in iters):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.4), squeeze=False, sharey=True)
    for ax, g in zip(axes[0], groups):
        for mode in MODES:
            for suf in metric_suffixes:
                key = _key(g, f"{mode}/{suf}")
                pts = [(i, history[i][key]) for i in iters if key in history[i]]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} {suf}")
        ax.set_title("overall" if g == "(all)" else g)
        ax.set_xlabel("iteration (0 = base model)")
        ax.grid(alpha=0.3)
        if iters:
            ax.set_xticks(iters)
    axes[0][0].set_ylabel(ylabel)
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
            break
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def length_plot(lengths: dict[int, list[int]], out: Path, max_new_tokens: int | None = None) -> Path | None:
    """Completion-length histograms: the base model (iteration 0), the latest iteration, and any between."""
    iters = sorted(i for i in lengths if lengths[i])
    if not iters:
        return None
    show = iters if len(iters) <= 4 else [iters[0], *iters[-3:]]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    hi = max(max(lengths[i]) for i in show)
    bins = range(0, max(hi, max_new_tokens or 0) + 2, max(1, (hi + 1) // 30 or 1))
    for i in show:
        ax.hist(lengths[i], bins=bins, histtype="step", linewidth=1.6, label=f"iter {i}", density=True)
    if max_new_tokens:
        ax.axvline(max_new_tokens, color="grey", linestyle="--", linewidth=1, label="token limit")
    ax.set_xlabel("completion length (tokens)")
    ax.set_ylabel("density")
    ax.set_title("eval completion lengths")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def make_plots(history: dict[int, dict], lengths: dict[int, list[int]], out_dir: Path,
               ks: list[int] | None = None, max_new_tokens: int | None = None) -> list[Path]:
    """accuracy.png (pass@k per source), reward.png (mean reward per function), lengths.png."""
    out_dir = Path(out_dir)
    ks = ks or [1]
    reward_funcs = sorted({k.split("/reward/")[1] for m in history.values() for k in m
                           if k.startswith("eval/") and "/reward/" in k})
    paths = [
        curve_plot(history, [f"pass_at_{k}" for k in sorted(set([1, *ks]))], "held-out pass@k", "pass@k",
                   out_dir / "accuracy.png"),
        curve_plot(history, [f"reward/{f}" for f in reward_funcs], "held-out mean reward", "mean reward",
                   out_dir / "reward.png"),
        length_plot(lengths, out_dir / "lengths.png", max_new_tokens),
    ]
    return [p for p in paths if p is not None]
