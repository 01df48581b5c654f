"""The curation steps after loading: normalise, deduplicate, decontaminate, split, calibrate, mix.

Every step is a pure function over lists of `Task`s that returns what it keeps plus a `Rejection` per
dropped item, so the report can say what happened to each task and why.
"""
from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from grpo_core.data.records import Rejection
from grpo_core.task import Task
from grpo_core.io import numbered_jsonl

# -- normalise ----------------------------------------------------------------------------------------


def normalise(task: Task) -> Task:
    """Canonical text (NFC, \\n line ends, no trailing spaces) and a difficulty clamped to [0, 1]."""
    def clean(s: str | None) -> str | None:
        if s is None:
            return None
        s = unicodedata.normalize("NFC", s).replace("\r\n", "\n").replace("\r", "\n")
        return "\n".join(line.rstrip() for line in s.split("\n")).strip("\n")
    task.prompt = clean(task.prompt) or ""
    task.answer = None if task.answer is None else clean(str(task.answer)).strip()
    if task.difficulty is not None:
        task.difficulty = min(1.0, max(0.0, float(task.difficulty)))
    return task


def text_key(text: str) -> str:
    """Lower-case NFKC text as space-separated tokens (words, and symbols such as + - * kept one by one),
    used for duplicate and overlap checks: "3 + 4" and "3 - 4" stay different."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.findall(r"\w+|[^\w\s]", text))


_OPERATORS = set("+-*/^%=()")
_COMMUTATIVE = {"+", "*"}
_WORD_OPERATORS = {"plus": "+", "minus": "-", "times": "*"}
_NUMBER = re.compile(r"\d+(?:\.\d+)?$")
# Words and punctuation that only phrase an arithmetic question ("What is 3 + 5?", "Compute 3 + 5.",
# "State the final answer to the following arithmetic problem: 3 + 5 ="): a question made of these and
# one expression asks that expression, whatever the wording. A word outside this list ("modulo",
# "apples") keeps the whole question as its key.
TEMPLATE_WORDS = frozenset("what is compute calculate evaluate find work out solve the value of give result "
                           "state final answer to following arithmetic problem expression please ? . : !".split())


# How an expression may also be written: other operator symbols, LaTeX ($5 \\times 3$), invisible characters.
# Read only where the question is then one expression, so no other question's key changes.
_SYMBOL_OPERATORS = {"\u2212": "-", "\u2013": "-", "\u00f7": "/", "\u22c5": "*", "\u2217": "*",
                     "\\times": "*", "\\cdot": "*", "\\div": "/"}
_NOT_IN_AN_EXPRESSION = {"$", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff"}


def _between_numbers(tokens: list[str], words: dict[str, str]) -> list[str]:
    """Operator words between two numbers as their symbols: '3 plus 5' -> '3 + 5' (a lone 'plus' stays)."""
    return [words[t] if t in words and 0 < i < len(tokens) - 1 and _NUMBER.match(tokens[i - 1])
            and _NUMBER.match(tokens[i + 1]) else t for i, t in enumerate(tokens)]


def _latex_commands(tokens: list[str]) -> list[str]:
    """'\\' and the word after it as one token: ['\\', 'times'] -> ['\\times']."""
    out: list[str] = []
    for t in tokens:
        if out and out[-1] == "\\" and t.isalpha():
            out[-1] += t
        else:
            out.append(t)
    return out


def _as_expression(tokens: list[str]) -> list[str]:
    """The tokens as an expression reads them: '5 − 3', '$5 \\times 3$' and '007 + 1' as '5 - 3', '5 * 3', '7 + 1'."""
    return [re.sub(r"^0+(?=\d)", "", _SYMBOL_OPERATORS.get(t, t))
            for t in _latex_commands(tokens) if t not in _NOT_IN_AN_EXPRESSION]


def _expression(tokens: list[str]) -> list[str] | None:
    """The arithmetic expression a templated question asks, or None when it says more than that."""
    body = [t for t in tokens if t not in TEMPLATE_WORDS]
    while body and body[-1] == "=":
        body.pop()
    if not all(_NUMBER.match(t) or t in _OPERATORS for t in body):
        return None
    if not any(_NUMBER.match(t) for t in body) or not any(t in _OPERATORS for t in body):
        return None
    return body


def _sort_commutative(tokens: list[str]) -> list[str]:
    """Operands of a lone + or * in ascending order: '5 + 3' -> '3 + 5' (not '2 + 5 * 3', not '5 - 3')."""
    tokens = list(tokens)
    for i in range(1, len(tokens) - 1):
        before = tokens[i - 2] if i >= 2 else ""
        after = tokens[i + 2] if i + 2 < len(tokens) else ""
        a, op, b = tokens[i - 1], tokens[i], tokens[i + 1]
        if (op in _COMMUTATIVE and _NUMBER.match(a) and _NUMBER.match(b) and before not in _OPERATORS
                and after not in _OPERATORS and float(a) > float(b)):
            tokens[i - 1], tokens[i + 1] = b, a
    return tokens


def canonical_question(text: str) -> str:
    """What a question asks, for telling questions apart by content: `text_key` tokens with numbers
    written one way ('1,000' -> '1000', '2.50' -> '2.5', '.5' -> '0.5', '×' -> '*', 'plus' -> '+'), the wording of a
    templated arithmetic question dropped ('What is 3 + 5?' and 'Compute 3 + 5.' both give '3 + 5'),
    and the operands of a lone commutative operation in order ('5 + 3' is '3 + 5'; '5 - 3' is not
    '3 - 5', nor is '2 + 3 * 4' '3 + 2 * 4', where the '+' is not alone). A question that is one expression
    once written plainly ('What is 5 − 3?', 'Compute $5 \\times 3$.', 'What is 007 + 1?') is that expression."""
    text = unicodedata.normalize("NFKC", text).lower().replace("×", "*").replace("·", "*")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    text = re.sub(r"(?<![\w.)\]}])\.(?=\d)", "0.", text)     # '.5' is '0.5' (not 5); a tuple's `t.1` stays
    text = re.sub(r"\b(\d+)\.(\d*[1-9])?0+\b", lambda m: m.group(1) + (f".{m.group(2)}" if m.group(2) else ""), text)
    tokens = _between_numbers(re.findall(r"\d+(?:\.\d+)?|\w+|[^\w\s]", text), _WORD_OPERATORS)
    return " ".join(_sort_commutative(_expression(_as_expression(tokens)) or tokens))


def stable_hash(*parts: str) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest(), "big")


# -- deduplicate ----------------------------------------------------------------------------------------


def shingles(text: str, k: int = 5) -> set[int]:
    words = text_key(text).split()
    if len(words) < k:
        return {stable_hash(" ".join(words))} if words else set()
    return {stable_hash(" ".join(words[i:i + k])) for i in range(len(words) - k + 1)}


_MERSENNE = (1 << 61) - 1


def minhash(sh: set[int], num_perm: int = 64, seed: int = 1) -> np.ndarray:
    """MinHash signature with universal hashes (a*x + b) mod 2^61-1, computed with Python ints per perm."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 1 << 60, size=num_perm, dtype=np.int64)
    b = rng.integers(0, 1 << 60, size=num_perm, dtype=np.int64)
    if not sh:
        return np.full(num_perm, _MERSENNE, dtype=np.uint64)
    xs = [x % _MERSENNE for x in sh]
    return np.array([min((int(ai) * x + int(bi)) % _MERSENNE for x in xs) for ai, bi in zip(a, b)],
                    dtype=np.uint64)


def dedupe(tasks: Sequence[Task], near_threshold: float = 0.85, k: int = 5, num_perm: int = 64,
           bands: int = 16) -> tuple[list[Task], list[Rejection]]:
    """Drop exact duplicates (same content hash or same `canonical_question`) and near-duplicates
    (MinHash LSH candidates confirmed by exact shingle Jaccard >= near_threshold), and a different task reusing
    an id (`invalid_schema`). First seen wins."""
    kept: list[Task] = []
    rejected: list[Rejection] = []
    seen_content: dict[str, str] = {}
    seen_prompt: dict[str, str] = {}
    seen_ids: set[str] = set()
    buckets: dict[tuple[int, bytes], list[int]] = defaultdict(list)
    kept_shingles: list[set[int]] = []
    rows = num_perm // bands
    for t in tasks:
        ch, pk = t.content_hash(), hashlib.sha256(canonical_question(t.prompt).encode()).hexdigest()
        first = seen_content.get(ch) or seen_prompt.get(pk)
        if first:
            rejected.append(Rejection(t.id, t.source, "duplicate_exact", f"same as {first}"))
            continue
        if t.id in seen_ids:                    # rewards and pass rates are looked up by id
            rejected.append(Rejection(t.id, t.source, "invalid_schema", f"field 'id': {t.id!r} is also the id of an "
                                                                        f"earlier, different task; give each its own id"))
            continue
        sh = shingles(t.prompt, k)
        sig = minhash(sh, num_perm) if near_threshold < 1.0 else None
        match = None
        if sig is not None:
            cands = {j for bnd in range(bands) for j in buckets.get((bnd, sig[bnd * rows:(bnd + 1) * rows].tobytes()), [])}
            for j in sorted(cands):
                other = kept_shingles[j]
                jac = len(sh & other) / max(1, len(sh | other))
                if jac >= near_threshold:
                    match = (j, jac)
                    break
        if match:
            rejected.append(Rejection(t.id, t.source, "duplicate_near",
                                      f"Jaccard {match[1]:.2f} with {kept[match[0]].id}"))
            continue
        seen_content[ch], seen_prompt[pk] = t.id, t.id
        seen_ids.add(t.id)
        if sig is not None:
            for bnd in range(bands):
                buckets[(bnd, sig[bnd * rows:(bnd + 1) * rows].tobytes())].append(len(kept))
        kept_shingles.append(sh)
        kept.append(t)
    return kept, rejected


# -- split --------------------------------------------------------------------------------------------


def split_of(task: Task, eval_fraction: float, salt: str = "grpo-split-v2") -> str:
    """'eval' or 'train' from what the task asks (kind + `canonical_question`), never its id: stable
    across runs, machines and order, and the same for two wordings of one question."""
    if eval_fraction <= 0:
        return "train"
    return "eval" if stable_hash(salt, task.kind, canonical_question(task.prompt)) / 2 ** 64 < eval_fraction else "train"


def split(tasks: Iterable[Task], eval_fraction: float, salt: str = "grpo-split-v2") -> tuple[list[Task], list[Task]]:
    train, ev = [], []
    for t in tasks:
        (ev if split_of(t, eval_fraction, salt) == "eval" else train).append(t)
    return train, ev


def use_eval_wording(train: Iterable[Task], ev: Iterable[Task]) -> None:
    """Tasks that carry a second wording (`meta["eval_prompt"]`) are asked in it when held out, so
    evaluation uses words training never saw; training tasks drop it. The split is unaffected:
    `canonical_question` ignores the wording of a templated question."""
    for t in train:
        t.meta.pop("eval_prompt", None)
    for t in ev:
        if (reworded := t.meta.pop("eval_prompt", None)):
            t.prompt = reworded


# -- decontaminate -----------------------------------------------------------------------------------


def ngrams(text: str, n: int) -> set[str]:
    words = text_key(text).split()
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def decontaminate(train: Sequence[Task], eval_tasks: Sequence[Task], n: int = 8, threshold: float = 0.5,
                  boilerplate_df: int = 20) -> tuple[list[Task], list[Rejection]]:
    """Drop training tasks that ask an eval question again (same `canonical_question`), or whose prompt
    shares >= `threshold` of its word n-grams with eval prompts.

    N-grams found in >= `boilerplate_df` different prompts (instructions, templates shared by a whole
    source) are ignored, so a shared "Reply in one ```rust block" does not make everything overlap.
    """
    per_task = [ngrams(t.prompt, n) for t in train]
    eval_grams = [ngrams(t.prompt, n) for t in eval_tasks]
    df: dict[str, int] = defaultdict(int)
    for grams in per_task + eval_grams:
        for g in grams:
            df[g] += 1
    common = {g for g, c in df.items() if c >= boilerplate_df}
    eval_set = set().union(*eval_grams) - common if eval_grams else set()
    eval_questions = {canonical_question(t.prompt) for t in eval_tasks}
    kept, rejected = [], []
    for t, grams in zip(train, per_task):
        if canonical_question(t.prompt) in eval_questions:
            rejected.append(Rejection(t.id, t.source, "contaminated", "asks an eval question again"))
            continue
        grams = grams - common
        if grams and eval_set:
            frac = len(grams & eval_set) / len(grams)
            if frac >= threshold:
                rejected.append(Rejection(t.id, t.source, "contaminated", f"{frac:.0%} of its {n}-grams occur in eval prompts"))
                continue
        kept.append(t)
    return kept, rejected


# -- calibrate -----------------------------------------------------------------------------------------

# policy(tasks, k) -> for each task, k rewards in [0, 1] (1 = correct) from the current model.
PolicyFn = Callable[[Sequence[Task], int], Sequence[Sequence[float]]]


def _band_check(task: Task, rate: float, n: int, band: tuple[float, float], how: str) -> Rejection | None:
    task.meta["pass_rate"] = round(rate, 4)
    task.meta["pass_rate_samples"] = n
    task.meta["pass_rate_from"] = how
    task.difficulty = round(1.0 - rate, 4)
    lo, hi = band
    if rate < lo or rate > hi:
        side = "too hard" if rate < lo else "too easy"
        return Rejection(task.id, task.source, "out_of_band", f"pass rate {rate:.2f} over {n} samples is {side} "
                                                              f"for band [{lo}, {hi}]")
    return None


def check_samples_fit_band(k: int, band: tuple[float, float]) -> None:
    """k samples give pass rates 0, 1/k, ..., 1: a ValueError when none is inside `band` (every task would be
    dropped as out of band), e.g. k=1 with the default band [0.1, 0.9]."""
    lo, hi = band
    rates = [j / k for j in range(k + 1)] if k >= 1 else []
    if not any(lo <= r <= hi for r in rates):
        raise ValueError(f"calibration.k={k} gives pass rates {[round(r, 3) for r in rates]}, none inside band "
                         f"[{lo}, {hi}], so every task would be dropped; raise k or widen the band")


def calibrate(tasks: Sequence[Task], policy: PolicyFn, k: int = 8, band: tuple[float, float] = (0.1, 0.9),
              batch_size: int = 16, correct_at: float = 1.0,
              progress: Callable[[int], None] | None = None) -> tuple[list[Task], list[Rejection]]:
    """Sample k answers per task from `policy`, record its pass rate, keep tasks inside `band`."""
    check_samples_fit_band(k, band)
    kept, rejected = [], []
    for start in range(0, len(tasks), batch_size):
        chunk = list(tasks[start:start + batch_size])
        scores = policy(chunk, k)
        if len(scores) != len(chunk):
            raise ValueError(f"policy returned {len(scores)} score lists for {len(chunk)} tasks; return one per task")
        for t, s in zip(chunk, scores):
            if not len(s):
                raise ValueError(f"policy returned no rewards for task {t.id!r}; return k={k} per task")
            rate = sum(1.0 for x in s if x is not None and x >= correct_at) / len(s)
            bad = _band_check(t, rate, len(s), band, "policy")
            (rejected.append(bad) if bad else kept.append(t))
        if progress:
            progress(len(chunk))
    return kept, rejected


def pass_rates_from_rollouts(path: str | Path, id_field: str = "task_id", score_field: str = "correct",
                             correct_at: float = 1.0) -> dict[str, tuple[float, int]]:
    """{task id: (pass rate, samples)} from a rollouts+scores JSONL (e.g. iter-k/scores.jsonl).
    Rows whose score is null or NaN (unscorable) are left out; an error names the line of any other bad row."""
    hits: dict[str, list[float]] = defaultdict(list)
    for lineno, row in numbered_jsonl(path):
        if id_field not in row:
            raise ValueError(f"{path}:{lineno}: row without {id_field!r}; pass id_field= the column holding task ids")
        score = _score_at(row.get(score_field), f"{path}:{lineno}: {score_field!r}")
        if score is not None:
            hits[str(row[id_field])].append(1.0 if score >= correct_at else 0.0)
    return {tid: (sum(v) / len(v), len(v)) for tid, v in hits.items() if v}


def _score_at(value: object, where: str) -> float | None:
    """A row's score as a number; None for null or NaN (not scored)."""
    if value is None:
        return None
    try:
        score = float(value)        # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where} is {value!r}, not a number (or null when unscored); fix the row") from None
    return None if math.isnan(score) else score


def recalibrate(tasks: Sequence[Task], rollouts: str | Path | dict[str, tuple[float, int]],
                band: tuple[float, float] = (0.1, 0.9), min_samples: int = 2,
                **fields: str) -> tuple[list[Task], list[Rejection]]:
    """Re-measure difficulty from the previous iteration's rollouts; tasks without enough samples are
    kept unchanged (they have not been tried yet)."""
    rates = rollouts if isinstance(rollouts, dict) else pass_rates_from_rollouts(rollouts, **fields)
    kept, rejected = [], []
    for t in tasks:
        if t.id in rates and rates[t.id][1] >= min_samples:
            bad = _band_check(t, rates[t.id][0], rates[t.id][1], band, "rollouts")
            if bad:
                rejected.append(bad)
                continue
        kept.append(t)
    return kept, rejected


def pass_rate_histogram(tasks: Iterable[Task], bins: int = 10) -> dict[str, int]:
    counts = [0] * bins
    for t in tasks:
        r = t.meta.get("pass_rate")
        if r is not None:
            counts[min(bins - 1, int(float(r) * bins))] += 1
    return {f"{i / bins:.1f}-{(i + 1) / bins:.1f}": c for i, c in enumerate(counts)}


# -- mix -------------------------------------------------------------------------------------------------


def group_of(task: Task) -> str:
    return task.meta.get("group", "user")


def source_key(task: Task) -> str:
    """The configured source name (e.g. 'reasoning_gym' for source 'reasoning_gym/gsm_symbolic')."""
    return task.meta.get("source_name") or task.source.split("/")[0]


def check_weights(weights: dict[str, float]) -> None:
    """Mix weights are finite numbers >= 0 with a positive sum (NaN or inf would give no task a quota)."""
    bad = {k: w for k, w in weights.items() if not math.isfinite(w) or w < 0}
    if bad or (weights and sum(weights.values()) <= 0):
        raise ValueError(f"weights must be finite numbers >= 0 with a positive sum, got {bad or weights}; fix them "
                         f"or remove weights (every task then counts alike)")


def mix_keys(task: Task) -> tuple[str, str, str]:
    """The weight keys a task may be drawn under, the first that has a weight winning: its source key, its source
    name, its group."""
    return source_key(task), task.source, group_of(task)


def mix(tasks: Sequence[Task], weights: dict[str, float], total: int | None, seed: int = 0
        ) -> tuple[list[Task], list[Rejection]]:
    """Draw `total` tasks with shares given per source name or group ('synthetic', 'community', 'user').

    A key's quota that its pool cannot fill is handed to the other keys in proportion to their weights.
    Draws are deterministic (hash of seed and content). No weights: every task, in hash order.
    """
    order = sorted(tasks, key=lambda t: stable_hash(str(seed), t.content_hash()))
    if not weights:
        chosen = order if total is None else order[:total]
    else:
        check_weights(weights)
        pools: dict[str, list[Task]] = {k: [] for k in weights}
        for t in order:
            for key in mix_keys(t):
                if key in pools:
                    pools[key].append(t)
                    break
        want = sum(len(p) for p in pools.values()) if total is None else total
        quota = _quotas(weights, {k: len(p) for k, p in pools.items()}, want)
        chosen = [t for k, p in pools.items() for t in p[:quota[k]]]
        chosen.sort(key=lambda t: stable_hash(str(seed), "order", t.content_hash()))
    picked = {id(t) for t in chosen}
    rejected = [Rejection(t.id, t.source, "not_selected", "outside this run's mix quota")
                for t in tasks if id(t) not in picked]
    return chosen, rejected


def _quotas(weights: dict[str, float], sizes: dict[str, int], total: int) -> dict[str, int]:
    quota = {k: 0 for k in weights}
    active = {k for k in weights if weights[k] > 0 and sizes[k] > 0}
    cap = min(total, sum(sizes[k] for k in active))
    remaining = cap
    while remaining > 0 and active:
        wsum = sum(weights[k] for k in active)
        shares = {k: remaining * weights[k] / wsum for k in active}
        floor = {k: min(int(shares[k]), sizes[k] - quota[k]) for k in active}
        # hand out the rounding remainder by largest fractional share, deterministic on ties
        extra = remaining - sum(floor.values())
        for k in sorted(active, key=lambda k: (-(shares[k] - int(shares[k])), k)):
            if extra <= 0:
                break
            if floor[k] < sizes[k] - quota[k]:
                floor[k] += 1
                extra -= 1
        for k in active:
            quota[k] += floor[k]
        remaining = cap - sum(quota.values())
        active = {k for k in active if quota[k] < sizes[k]}
        if sum(floor.values()) == 0:
            break
    return quota

