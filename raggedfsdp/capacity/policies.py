"""The planner's two policy settings: the user's unit and the optimizer, as runtime policies.

Neither re-derives a rule: ``UnitPolicy`` builds the user's unit from
:mod:`raggedfsdp.sharding.units` helpers, ``OptimizerSpec`` returns the policy the optimizer's
own ``shard_policy()`` returns, and ``shard_policy`` combines them exactly as

    fully_shard(group, shard_policy=combine(user_policy, Optimizer.shard_policy(...)))

does at run time (with :func:`~raggedfsdp.sharding.units.resolve_units` deciding each group),
so the planned layout is the one the runtime builds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from raggedfsdp.capacity.model_shapes import PlanError
from raggedfsdp.sharding.units import (
    DEFAULT_MAX_EXTRA_PADDING,
    ExpertShardPolicy,
    MuonShardPolicy,
    ShardPolicy,
    WholeMatrices,
    adamw8bit_policy,
    check_max_extra_padding,
    combine,
    element_units,
    matrix_unit,
    row_units,
    shampoo_policy,
)

__all__ = ["OPTIMIZERS", "UNIT_KINDS", "OptimizerSpec", "UnitPolicy", "is_expert"]

UNIT_KINDS = ("elements", "rows", "expert", "matrix")
OPTIMIZERS = ("adamw", "adamw8bit", "muon", "shampoo", "soap")

_PER_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")
_FUSED_EXPERTS = re.compile(r"(^|\.)experts\.")


def is_expert(name: str) -> bool:
    """One expert's tensor (``...experts.7.up_proj.weight``) or a fused stack of experts."""
    return _FUSED_EXPERTS.search(name) is not None


def _positive_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{key}={value!r}: must be a positive integer")


def _budget(value: Any) -> str:
    """Check a ``max_extra_padding`` (the runtime's rule, as a ``PlanError``); its words."""
    try:
        check_max_extra_padding(value)
    except ValueError as err:
        raise PlanError(str(err)) from None
    return f"within a {100 * value:g} % padding budget"


@dataclass(frozen=True)
class UnitPolicy:
    """The user's unit: ``elements`` (``fully_shard``'s default: ZeRO-style element units, fused
    experts whole within a padding budget, ``max_extra_padding``), ``rows`` (k rows,
    a row being a vector along the last dim), ``expert`` (whole expert matrices, k rows
    elsewhere) or ``matrix`` (whole matrices over the last two dims, so one slice of a stacked
    tensor; elements for vectors)."""

    kind: str = "elements"
    rows: int = 1
    max_extra_padding: float = DEFAULT_MAX_EXTRA_PADDING

    def __post_init__(self) -> None:
        if self.kind not in UNIT_KINDS:
            raise PlanError(f"unit {self.kind!r}: choose one of {list(UNIT_KINDS)}")
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1:
            raise PlanError(f"--unit-rows {self.rows!r}: must be a positive integer (1, 16, 128)")
        _budget(self.max_extra_padding)

    def policy(self) -> ShardPolicy:
        """The shard policy a user would pass to ``fully_shard`` for this choice."""
        if self.kind == "elements":
            return ExpertShardPolicy(max_extra_padding=self.max_extra_padding)
        rows = row_units(self.rows)
        if self.kind == "rows":
            return rows
        if self.kind == "matrix":
            return lambda fqn, param: (
                max(1, matrix_unit(param.shape[-2:])) if len(param.shape) >= 2 else 1
            )

        def expert(fqn: str, param: Any) -> int:
            shape = tuple(param.shape)
            if not is_expert(fqn):
                return rows(fqn, param)
            one_expert = _PER_EXPERT.search(fqn) is not None or len(shape) < 2
            return max(1, math.prod(shape if one_expert else shape[1:]))

        return expert

    def describe(self) -> str:
        rows = f"{self.rows} row{'s' if self.rows > 1 else ''}"
        return {
            "rows": rows,
            "elements": f"1 element, whole experts {_budget(self.max_extra_padding)}",
            "matrix": "whole matrices",
            "expert": f"whole experts, {rows} elsewhere",
        }[self.kind]


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer and the settings that decide its units and state: ``block_size``, ``tile``
    and ``min_8bit_size`` (``AdamW8bit``), ``preconditioner_dim`` (``Shampoo``'s
    ``max_preconditioner_dim``, SOAP's too; their other defaults, momentum 0 included), and
    ``whole_matrices`` and ``max_extra_padding`` (``Muon``; its Newton–Schulz runs ``ns_steps``
    iterations)."""

    name: str = "adamw"
    block_size: int = 256
    min_8bit_size: int = 4096
    tile: tuple[int, int] | None = None
    preconditioner_dim: int = 1024
    whole_matrices: WholeMatrices = "auto"
    ns_steps: int = 5
    max_extra_padding: float = DEFAULT_MAX_EXTRA_PADDING

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise PlanError(f"optimizer {self.name!r}: choose one of {list(OPTIMIZERS)}")
        for key in ("block_size", "min_8bit_size", "preconditioner_dim", "ns_steps"):
            _positive_int(key, getattr(self, key))
        if self.tile is not None:
            if len(self.tile) != 2:
                raise PlanError(f"tile={self.tile!r}: must be (rows, cols)")
            for value in self.tile:
                _positive_int("tile", value)
        if self.whole_matrices not in (True, False, "auto"):
            raise PlanError(f"whole_matrices={self.whole_matrices!r}: use True, False or 'auto'")
        _budget(self.max_extra_padding)

    def shard_policy(self) -> ShardPolicy:
        """What ``<Optimizer>.shard_policy(...)`` returns for these settings."""
        if self.name == "adamw8bit":
            return adamw8bit_policy(self.block_size, self.tile, self.min_8bit_size)
        if self.name in ("shampoo", "soap"):
            return shampoo_policy(self.preconditioner_dim)
        if self.name == "muon":
            return MuonShardPolicy(self.whole_matrices, max_extra_padding=self.max_extra_padding)
        return element_units()

    def describe(self) -> str:
        tile = f"{self.tile[0]}x{self.tile[1]} tiles" if self.tile else f"block {self.block_size}"
        auto = _budget(self.max_extra_padding)
        whole = {True: "always", False: "never", "auto": auto}[self.whole_matrices]
        return {
            "adamw": "AdamW (2 moments like the master weights)",
            "adamw8bit": f"8-bit AdamW ({tile}, fp32 below {self.min_8bit_size} elements)",
            "muon": "Muon (momentum on hidden matrices; AdamW on embeddings, head, vectors; "
            f"whole matrices {whole})",
            "shampoo": f"Shampoo (blocks of {self.preconditioner_dim}, Adam grafting)",
            "soap": f"SOAP (blocks of {self.preconditioner_dim}, Adam in Shampoo's eigenbasis)",
        }[self.name]


def shard_policy(units: UnitPolicy, optimizer: OptimizerSpec) -> ShardPolicy:
    """The policy ``fully_shard`` gets: the user's unit combined with the optimizer's."""
    return combine(units.policy(), optimizer.shard_policy())
