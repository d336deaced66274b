"""Equal-size blocks of a blocked preconditioner, batched: which blocks may share a ``bmm``.

Why it exists: with blocks that repeat (every ``B × B`` block of a matrix, equal layers), a
step that does each block's products one by one issues a few small kernels per block. On a GPU
their launches, not their arithmetic, take the time, and one ``bmm`` per product and group
(one norm per group) removes them. On CPU it wins nothing, measured (BENCHMARKS.md, "Shampoo"):
a single 128³ ``mm`` already runs at the matmul ceiling, MKL's batched gemm is slower than a
loop of single ones (58 against 77 GFLOP/s, one thread), and stacking all blocks streams
megabytes through DRAM that the per-block path keeps in L2. So it is opt-in
(``Shampoo(batch_blocks=True)``).

When a batch is bitwise the per-block path (measured on CPU, tested in
``tests/optim/test_shampoo.py``): torch's CPU ``bmm`` gives every slot the bits of that slot's
own ``mm`` once each product is large enough for BLAS (ATen computes tiny products, ``m·n·k <
400``, with its own loop, whose sums differ from MKL's by an ulp) and every slot starts 64-byte
aligned (MKL's results may depend on alignment, as its eigh's do: ``matrix_roots``). Both hold
for blocks whose sides are multiples of 64 bytes of elements (16 fp32, 8 fp64), which every
realistic block size is. A norm over the last two dims of a contiguous stack gives each slot
the bits of that slot's norm as a contiguous matrix, but not those of a norm over a strided
view of the same values (a block of a wider slab): such norms stay per block (one foreach
call). On CUDA, cuBLAS may pick other kernels for
a batch than for one matrix, and by batch size, so there bits may depend on which blocks share
a rank (not verified here).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

__all__ = ["batchable_block", "group_blocks"]

_ALIGNMENT_BYTES = 64
T = TypeVar("T")


def batchable_block(rows: int, cols: int, dtype: torch.dtype) -> bool:
    """Whether ``rows × cols`` blocks of ``dtype`` may share ``bmm`` calls (module docstring)."""
    return all((n * dtype.itemsize) % _ALIGNMENT_BYTES == 0 for n in (rows, cols))


def group_blocks(items: Sequence[T], key: Callable[[T], Hashable | None]) -> list[list[T]]:
    """``items`` in groups of equal ``key`` (first-seen order, each group in item order); an
    item whose key is None is a group of its own."""
    groups: dict[Hashable, list[T]] = {}
    out: list[list[T]] = []
    for item in items:
        k = key(item)
        if k is None:
            out.append([item])
        elif k in groups:
            groups[k].append(item)
        else:
            groups[k] = [item]
            out.append(groups[k])
    return out
