"""Buffers on 2 MiB pages: weights a decode step streams read markedly faster from huge pages than from 4 KiB
ones on virtual machines (fewer TLB misses; `bench/floor.py` measures both, docs/speed.md has the figures)."""
from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def _madvise_huge(addr: int, length: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def hugepage_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised flat tensor starting on a 2 MiB boundary whose pages the kernel is asked to back
    with huge pages (Linux transparent huge pages in `madvise` or `always` mode; elsewhere a plain tensor)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel + HUGE_PAGE // itemsize, dtype=dtype)
    start = (-raw.data_ptr() % HUGE_PAGE) // itemsize
    out = raw[start:start + numel]                       # the view keeps the whole allocation alive
    if numel * itemsize >= HUGE_PAGE:
        _madvise_huge(out.data_ptr(), numel * itemsize)
    return out
