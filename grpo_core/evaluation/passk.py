"""pass@k with the unbiased estimator (Chen et al. 2021, the HumanEval paper).

With n samples of which c are correct, pass@k = E[at least one of k drawn without replacement is correct]
= 1 - C(n-c, k) / C(n, k), computed as a product so it never overflows:
    1 - prod_{i=n-c+1}^{n} (1 - k / i)
The mean over questions estimates the probability that k fresh samples contain a correct one.
"""
from __future__ import annotations

from typing import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question with n samples, c of them correct (needs n >= k >= 1, 0 <= c <= n)."""
    if k < 1 or n < k:
        raise ValueError(f"pass@k needs n >= k >= 1 (got n={n}, k={k})")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n (got c={c}, n={n})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float | None:
    """Mean pass@k over questions given (n, c) per question; questions with n < k are left out
    (e.g. samples the sandbox could not score). None if no question qualifies."""
    vals = [pass_at_k(n, c, k) for n, c in counts if n >= k]
    return sum(vals) / len(vals) if vals else None


def default_ks(num_samples: int) -> list[int]:
    """1, then 4, 8, 16, ... up to num_samples, and num_samples itself: [1, 2] for n=2, [1, 4, 8] for n=8."""
    if num_samples < 1:
        return []
    ks = {1, num_samples}
    k = 4
    while k <= num_samples:
        ks.add(k)
        k *= 2
    return sorted(ks)


