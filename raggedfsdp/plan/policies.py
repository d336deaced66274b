"""Unit policies and optimizer models: what a tensor is cut into, and what its state costs.

A tensor's unit is the LCM of the user's unit policy and of what the optimizer's math needs whole
on one rank (8-bit blocks, Shampoo blocks), exactly as ``fully_shard(...,
shard_policy=combine(row_units(k), Opt.shard_policy()))`` would do at run time: a plan that cut
the optimizer's blocks would need communication the estimate does not show.

State sizes follow the reference implementations: torch's AdamW keeps two moments like the
parameter; 8-bit AdamW (bitsandbytes / torchao / ``raggedfsdp.optim.AdamW8bit``) keeps one byte
per moment element plus an fp32 absmax per block and per moment, with full-precision state below
4,096 elements; Muon keeps one momentum per hidden matrix and runs AdamW on embeddings, the
output head and vectors; Shampoo (DistributedShampoo defaults) keeps per block of at most
``b x b`` a left and a right factor and their inverse roots in fp32, plus a filtered gradient and
Adam grafting's second moment.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from raggedfsdp.plan.model_shapes import PlanError, Shape
from raggedfsdp.sharding.ragged_shard import row_numel

__all__ = ["OPTIMIZERS", "UNIT_KINDS", "OptimizerSpec", "UnitPolicy", "is_expert", "is_muon"]

UNIT_KINDS = ("rows", "elements", "expert", "matrix")
OPTIMIZERS = ("adamw", "adamw8bit", "muon", "shampoo")

_PER_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")
_FUSED_EXPERTS = re.compile(r"(^|\.)experts\.")
#: Embeddings and output heads: Muon leaves them to AdamW (they are lookup tables, not maps).
_EMBEDDING = re.compile(
    r"(^|\.)(embed_tokens|tok_embeddings|embeddings?|wte|wpe|lm_head|output)(\.|$)"
)


def is_expert(name: str) -> bool:
    """One expert's tensor (``...experts.7.up_proj.weight``) or a fused stack of experts."""
    return _FUSED_EXPERTS.search(name) is not None


def is_muon(name: str, shape: Shape) -> bool:
    """Whether Muon (not its AdamW fallback) updates this tensor: matrices (and stacks of them)
    other than embeddings and heads."""
    return len(shape) >= 2 and _EMBEDDING.search(name) is None


@dataclass(frozen=True)
class UnitPolicy:
    """The user's unit: ``rows`` (k rows, a row being a vector along the last dim), ``elements``
    (ZeRO-style), ``expert`` (whole expert matrices, k rows elsewhere) or ``matrix`` (whole
    matrices over the last two dims, so one slice of a stacked tensor; elements for vectors)."""

    kind: str = "rows"
    rows: int = 1

    def __post_init__(self) -> None:
        if self.kind not in UNIT_KINDS:
            raise PlanError(f"unit {self.kind!r}: choose one of {list(UNIT_KINDS)}")
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1:
            raise PlanError(f"--unit-rows {self.rows!r}: must be a positive integer (1, 16, 128)")

    def unit(self, name: str, shape: Shape) -> int:
        """Elements per unit of tensor ``name``."""
        if self.kind == "elements":
            return 1
        if self.kind == "expert" and is_expert(name):
            one_expert = _PER_EXPERT.search(name) is not None or len(shape) < 2
            return max(1, math.prod(shape if one_expert else shape[1:]))
        if self.kind == "matrix":
            return max(1, math.prod(shape[-2:])) if len(shape) >= 2 else 1
        return self.rows * row_numel(shape)

    def describe(self) -> str:
        rows = f"{self.rows} row{'s' if self.rows > 1 else ''}"
        return {
            "rows": rows,
            "elements": "1 element",
            "matrix": "whole matrices",
            "expert": f"whole experts, {rows} elsewhere",
        }[self.kind]


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer's sharding requirement and state size (see the module docstring)."""

    name: str = "adamw"
    block_size: int = 256
    min_8bit_size: int = 4096
    preconditioner_dim: int = 1024

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise PlanError(f"optimizer {self.name!r}: choose one of {list(OPTIMIZERS)}")
        for key in ("block_size", "min_8bit_size", "preconditioner_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{key}={value!r}: must be a positive integer")

    def unit(self, shape: Shape) -> int:
        """Elements that must stay whole on one rank for the optimizer's math."""
        if self.name == "adamw8bit" and math.prod(shape) >= self.min_8bit_size:
            return self.block_size
        if self.name == "shampoo":
            return self.preconditioner_dim * row_numel(shape)
        return 1

    def bytes_per_element(self, name: str, shape: Shape, master_bytes: int) -> float:
        """State bytes per element this rank holds (Shampoo's factors come on top)."""
        adam = 2 * master_bytes
        if self.name == "adamw8bit":
            if math.prod(shape) < self.min_8bit_size:
                return adam
            return 2 + 2 * 4 / self.block_size  # uint8 codes + fp32 absmax, both moments
        if self.name == "muon":
            return master_bytes if is_muon(name, shape) else adam
        if self.name == "shampoo":
            return 2 * master_bytes  # filtered gradient + grafting second moment
        return adam

    def factor_slabs(self, shape: Shape) -> tuple[int, np.ndarray]:
        """Shampoo: ``(slab elements, factor bytes per slab)``. A slab is ``b`` rows (``b``
        elements of a vector): exactly one unit, so it is whole on one rank; its blocks are
        the ``b x b`` (or smaller, at the edges) tiles of the 2-D view ``(rows, row length)``,
        each with fp32 factors ``L`` and ``R`` and their inverse roots (vectors: one factor)."""
        b = self.preconditioner_dim
        cols = row_numel(shape)
        rows = math.prod(shape) // cols if cols else 0
        starts = np.arange(0, rows, b)
        heights = np.minimum(b, rows - starts).astype(np.float64)
        if len(shape) < 2:
            return b, 2 * 4 * heights**2
        widths = np.minimum(b, cols - np.arange(0, cols, b)).astype(np.float64)
        per_slab = len(widths) * heights**2 + float((widths**2).sum())
        return b * cols, 2 * 4 * per_slab

    def describe(self) -> str:
        return {
            "adamw": "AdamW (2 moments like the master weights)",
            "adamw8bit": f"8-bit AdamW (block {self.block_size}, fp32 below "
            f"{self.min_8bit_size} elements)",
            "muon": "Muon (momentum on hidden matrices; AdamW on embeddings, head, vectors)",
            "shampoo": f"Shampoo (blocks of {self.preconditioner_dim}, Adam grafting)",
        }[self.name]
