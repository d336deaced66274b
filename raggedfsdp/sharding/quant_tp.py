"""Whether a TP or EP split cuts AdamW8bit's quantization blocks: one rule, torch-free.

``AdamW8bit`` quantizes a split parameter in the blocks of its *global* tensor (as on one
process) by quantizing each rank's local block: that needs every block whole on one rank, and
the ranks' blocks to form a ``Shard`` of the global absmax grid (so checkpoints keep the
single-process grid). ``AdamW8bit`` refuses at construction what this rule refuses, and the
capacity planner (``raggedfsdp plan --optimizer adamw8bit``) refuses the same case before
planning, so the rule lives here once, in the words each caller's user changes (``Words``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from raggedfsdp.sharding.tp_split import tp_splits_local_shape

__all__ = ["RUNTIME_WORDS", "Words", "quant_split_grid"]


@dataclass(frozen=True)
class Words:
    """How a refusal names what to change: asking for tiles, the tile and block settings, and
    another optimizer for the tensor (the constructor's arguments, or the CLI's flags)."""

    tiles: str
    tile: str
    block_size: str
    other: str


#: ``AdamW8bit``'s own arguments.
RUNTIME_WORDS = Words(
    "tile=(rows, cols)",
    "tile",
    "block_size",
    "AdamW, Muon, Shampoo or SOAP (a param group of its own)",
)


def quant_split_grid(
    global_shape: Sequence[int],
    splits: Sequence[tuple[int, int]],
    block_size: int,
    tile: tuple[int, int] | None,
    words: Words = RUNTIME_WORDS,
) -> tuple[int | None, ...]:
    """The absmax grid dim each split cuts (``None``: a split over one rank cuts nothing), for a
    quantized tensor of ``global_shape`` split on ``splits``, ``(tensor dim, ranks)`` pairs in
    mesh order (``Shard(1)`` over tp 2: ``((1, 2),)``; EP x TP experts: ``((0, ep), (1,
    tp))``). Tiles (``tile``, tensors of 2+ dims) form a 2-D grid over the 2-D view, blocks
    (``block_size`` elements of the flat index) a 1-D one.

    A split of the last dim cuts tile columns (grid dim 1); any other split cuts the grid's
    rows (dim 0), which needs every rank's block to be contiguous runs of whole rows: at most
    one such split, with only one index before its dim (dim 0 of the tensor, or the first dim
    that is more than one long). Then every rank must hold whole tiles or blocks. Raises
    ``ValueError`` with the reason and the fix, in ``words``, otherwise."""
    shape = tuple(global_shape)
    local = tp_splits_local_shape(shape, [(d, n) for d, n in splits])
    tiled = tile is not None and len(shape) >= 2
    what = f"tile={tile} rows" if tiled else f"{block_size}-element blocks"
    dims: list[int | None] = []
    for d, ranks in splits:
        if ranks == 1:
            dims.append(None)
        elif tiled and d == len(shape) - 1:
            dims.append(1)
        elif 0 in dims or math.prod(shape[:d]) != 1:
            fix = f"give it to {words.other}"
            if not tiled and d == len(shape) - 1:
                fix = f"quantize it in tiles ({words.tiles}, cols dividing {local[-1]}), or {fix}"
            raise ValueError(
                f"the {what} of the global tensor cross its TP blocks: the split of dim {d} "
                "interleaves them with the dims before it, so its absmax grid is no Shard of "
                f"the global grid; {fix}"
            )
        else:
            dims.append(0)
    rows = math.prod(local[:-1]) if tiled else math.prod(local)
    if 0 in dims and rows % (tile[0] if tiled else block_size):
        per = f"{rows} {'rows' if tiled else 'elements'} per TP rank"
        cut = f"tile={tile}" if tiled else f"{block_size}-element blocks"
        fix = f"a {words.tile} height" if tiled else f"a {words.block_size}"
        raise ValueError(
            f"its {per} cut {cut}; use {fix} that divides {rows}, or give it to {words.other}"
        )
    if 1 in dims and local[-1] % tile[1]:
        raise ValueError(
            f"its {local[-1]} columns per TP rank cut tile={tile}; use a {words.tile} width "
            f"that divides {local[-1]}, or give it to {words.other}"
        )
    return tuple(dims)
