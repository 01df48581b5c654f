"""Data parallel over processes: which share of a batch this process takes, and how the shares come together.

`DataParallel` is this process's place (rank, world size, how to sum tensors and gather results across the
processes); the rollout, evaluate and update stages all take one. tasks/distributed.py builds it on
torch.distributed; the default is one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

T = TypeVar("T")


def _alone(tensors: list[torch.Tensor]) -> None:
    """One process: the sum over the processes is the tensor itself."""


def _only(item: object) -> list:
    """One process: the gathered list is its own item."""
    return [item]


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the processes that share one update, data parallel over groups.

    Every process reads the whole scored batch and plans the same optimizer steps and micro-batches; each
    trains on every world_size-th group of each micro-batch (`shard_rows`), weighs its loss by its part of
    the micro-batch's normaliser (`shard_loss_weight`), and `sum_across` adds the gradients (and the
    step's statistics) over the processes, in place, so that N processes take the step one process takes
    on the same batch. Sampling stages deal prompts the same way (`shard`) and `gather` every process's
    (picklable) result, in rank order. tasks/distributed.py builds it on torch.distributed; the default is
    one process.
    """
    rank: int = 0
    world_size: int = 1
    sum_across: Callable[[list[torch.Tensor]], None] = _alone
    gather: Callable[[object], list] = _only

    def shard(self, items: Sequence[T]) -> list[T]:
        """This process's items: every world_size-th, from its rank on (undone by `interleave`)."""
        return list(items[self.rank::self.world_size])

    def shard_seed(self, seed: int) -> int:
        """This process's sampling seed: `seed` itself on the first process, distinct streams on the others."""
        return seed + self.rank * 1_000_003


def interleave(shards: Sequence[Sequence[T]]) -> list[T]:
    """The items `DataParallel.shard` dealt, in their original order, from every process's shard (rank order)."""
    out: list[T] = []
    for i in range(max((len(s) for s in shards), default=0)):
        out.extend(s[i] for s in shards if i < len(s))
    return out
