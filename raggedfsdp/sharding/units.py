"""Unit rules: which unit each tensor is cut into, decided once for the runtime and the planner.

A *unit* is the number of elements that must stay together on one rank: ranks' pieces of a
tensor start at multiples of it. A *shard policy* decides it per tensor, ``(fqn, param) ->
unit`` with only ``param.shape`` read, and ``fully_shard``, the optimizers' drop-in buffers and
the capacity planner all ask the same policies through :func:`resolve_units`, so an optimizer's
block requirement (8-bit quantization blocks, Shampoo slabs, whole Muon matrices) is honoured
wherever a layout is planned, and the planner predicts the layout the runtime builds:

    fully_shard(block, shard_policy=combine(row_units(32), AdamW8bit.shard_policy()))

Some policies can only decide for a whole group at once (Muon keeps a matrix whole where the
group's padding stays within a budget, which depends on the other tensors): they implement
:class:`GroupShardPolicy`.

This module is pure Python (the planner runs without torch); the optimizers' ``shard_policy``
classmethods return the policies built here.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from raggedfsdp.sharding.planner import (
    DEFAULT_ALIGNMENT_BYTES,
    TensorSpec,
    fits_within,
    plan_layout,
)
from raggedfsdp.sharding.ragged_shard import row_numel

__all__ = [
    "DEFAULT_MAX_EXTRA_PADDING",
    "DEFAULT_POLICY",
    "NON_MUON_MODULES",
    "ExpertShardPolicy",
    "Float8Tile",
    "GroupShardPolicy",
    "MuonShardPolicy",
    "ShardPolicy",
    "StrictPolicy",
    "TensorMeta",
    "WholeMatrices",
    "adamw8bit_policy",
    "check_max_extra_padding",
    "check_preconditioner_dim",
    "coarsen_units",
    "combine",
    "element_units",
    "expert_matrix",
    "expert_notes",
    "expert_unit_options",
    "float8_block_policy",
    "float8_tiles",
    "grouped_notes",
    "is_muon_matrix",
    "is_quantized",
    "matrix_unit",
    "merge_small_dims",
    "quantized_unit",
    "resolve_units",
    "row_units",
    "shampoo_blocked",
    "shampoo_matrix",
    "shampoo_policy",
    "shampoo_slab_rows",
    "slice_units",
    "strict",
    "tile_shape",
]

#: ``(fully qualified name, parameter) -> unit in elements``; only ``param.shape`` is read.
ShardPolicy = Callable[[str, Any], int]

#: One tensor of a group as group policies see it: ``(name, shape, dtype)``, the dtype a torch
#: dtype or its name (``"bfloat16"``).
TensorEntry = tuple[str, Sequence[int], Any]

#: Muon's ``whole_matrices`` setting (see ``MuonShardPolicy``).
WholeMatrices = bool | Literal["auto"]


class GroupShardPolicy(ABC):
    """A policy that decides the units of a whole group at once.

    ``units_for_group`` sees every tensor of one group (one ``fully_shard`` call, one drop-in
    bucket, one planned group) and the shard world size, and answers a unit per name; it is
    what :func:`resolve_units` calls. ``__call__`` is the per-tensor answer for callers that
    only see one tensor: it must be a safe choice on its own (usually the smallest unit).
    """

    @abstractmethod
    def __call__(self, fqn: str, param: Any) -> int:
        """The unit of one tensor when the group is not known."""

    @abstractmethod
    def units_for_group(self, tensors: Sequence[TensorEntry], world_size: int) -> dict[str, int]:
        """The unit of every ``(name, shape, dtype)`` tensor of one group over ``world_size``."""


@dataclass(frozen=True)
class TensorMeta:
    """What a plain policy receives when only a tensor's shape and dtype are known (the
    planner, group policies): it answers ``shape``, ``dtype``, ``numel()`` and ``dim()`` like a
    tensor, so policies written against parameters work unchanged."""

    shape: tuple[int, ...]
    dtype: Any = "float32"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)


def resolve_units(
    policy: ShardPolicy,
    tensors: Sequence[TensorEntry],
    world_size: int,
    params: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """The unit of every tensor of one group: the one entry point every caller uses.

    A :class:`GroupShardPolicy` decides for the group at once; a plain callable is asked per
    tensor, with ``params[name]`` when given (the real parameter) or a :class:`TensorMeta`.
    A unit that is not a positive int is an error naming the tensor, since a layout planned
    with it would be meaningless.
    """
    if isinstance(policy, GroupShardPolicy):
        units = policy.units_for_group(tensors, world_size)
    else:
        units = {}
        for name, shape, dtype in tensors:
            param = params[name] if params is not None else TensorMeta(tuple(shape), dtype)
            units[name] = policy(name, param)
    for name, shape, _ in tensors:
        unit = units.get(name)
        if not isinstance(unit, int) or isinstance(unit, bool) or unit < 1:
            raise ValueError(
                f"shard_policy returned unit={unit!r} for parameter {name!r} (shape "
                f"{tuple(shape)}); it must return a positive number of elements, at least 1 "
                "for a tensor with no elements (e.g. raggedfsdp.sharding.row_units(32))"
            )
    return units


@dataclass(frozen=True)
class StrictPolicy(GroupShardPolicy):
    """``policy``, with its blocks a promise rather than a wish: where another split (tensor
    parallelism's) would cut a block the policy asks for, ``fully_shard`` refuses, naming the
    parameter and the fix, instead of noting it in the group's ``notes``; so does a
    ``shard_placement_fn`` placement that a contiguous layout cannot honour (FSDP2's strided
    ``Shard(d)``, ``d > 0``). Build it with :func:`strict`."""

    policy: ShardPolicy

    @property
    def policies(self) -> tuple[ShardPolicy, ...]:
        """The policy it wraps (as ``combine``'s result lists its own), for searches."""
        return (self.policy,)

    def __call__(self, fqn: str, param: Any) -> int:
        return self.policy(fqn, param)

    def units_for_group(self, tensors: Sequence[TensorEntry], world_size: int) -> dict[str, int]:
        return resolve_units(self.policy, tensors, world_size)


def strict(policy: ShardPolicy) -> StrictPolicy:
    """``policy`` under which a block cut by another split is an error (see ``StrictPolicy``),
    e.g. ``fully_shard(block, shard_policy=strict(AdamW8bit.shard_policy(tile=(32, 32))))``."""
    return policy if isinstance(policy, StrictPolicy) else StrictPolicy(policy)


# ----------------------------------------------------------------------------- plain rules
def element_units() -> ShardPolicy:
    """ZeRO-style: any element may start a rank's piece (the least padding)."""
    return lambda fqn, param: 1


def row_units(rows: int = 1) -> ShardPolicy:
    """Units of ``rows`` rows (vectors along the last dim; elements for 1-D tensors): keeps
    ``rows × n`` tiles such as 32×32 quantization blocks or 128×128 FP8 blocks whole."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"row_units: rows={rows!r} must be a positive int")
    return lambda fqn, param: max(1, rows * row_numel(tuple(param.shape)))


def matrix_unit(shape: Sequence[int]) -> int:
    """Elements of one matrix: the whole tensor for 2-D, one ``(m, n)`` slice of a stacked
    ``(E, m, n)`` tensor (one expert), so Newton–Schulz sees whole matrices."""
    return math.prod(shape[1:]) if len(shape) == 3 else math.prod(shape)


def slice_units() -> ShardPolicy:
    """Whole slices of dim 0 for tensors of 3 or more dims (one expert matrix of a stacked
    ``(E, m, n)`` tensor), whole matrices for 2-D tensors, elements for vectors."""

    def unit(fqn: str, param: Any) -> int:
        shape = tuple(param.shape)
        if len(shape) >= 3:
            return max(1, math.prod(shape[1:]))
        return max(1, math.prod(shape)) if len(shape) == 2 else 1

    return unit


def combine(*policies: ShardPolicy) -> ShardPolicy:
    """A policy whose unit is the LCM of the given policies' units, so all stay whole. With a
    :class:`GroupShardPolicy` among them the result is one too (each decides for the group)."""
    if not policies:
        raise ValueError("combine: give at least one policy")
    if any(isinstance(p, GroupShardPolicy) for p in policies):
        return _Combined(policies)
    return lambda fqn, param: math.lcm(*(max(1, p(fqn, param)) for p in policies))


class _Combined(GroupShardPolicy):
    """``combine`` of policies of which at least one decides per group."""

    def __init__(self, policies: Sequence[ShardPolicy]) -> None:
        self.policies = tuple(policies)

    def __call__(self, fqn: str, param: Any) -> int:
        return math.lcm(*(max(1, p(fqn, param)) for p in self.policies))

    def units_for_group(self, tensors: Sequence[TensorEntry], world_size: int) -> dict[str, int]:
        decided = [resolve_units(p, tensors, world_size) for p in self.policies]
        return {name: math.lcm(*(units[name] for units in decided)) for name, _, _ in tensors}


# ----------------------------------------------------------------------------- coarser units
#: How many tensors the one-by-one search tries (largest first): it plans the group once per
#: trial, so a bound keeps planning a model with hundreds of tensors per group fast.
MAX_COARSEN_TRIALS = 32

#: Padding that coarser units (whole experts, whole Muon matrices) may add to a group, as a
#: fraction of the group's elements, beyond element units' padding. 0.1 % keeps every expert
#: whole where the planner finds a near-even layout for them (DeepSeek-V3 at W = 8 pays
#: 0.016 %; see BENCHMARKS.md) and costs at most 0.1 % of memory and all-gather bytes.
DEFAULT_MAX_EXTRA_PADDING = 0.001


def check_max_extra_padding(value: Any) -> None:
    """``max_extra_padding`` is a fraction in [0, 1] (it sizes every group's padding budget)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0.0 <= value <= 1.0  # also refuses NaN
    ):
        raise ValueError(
            f"max_extra_padding={value!r}: give the padding whole units may add as a fraction "
            "of the group's elements, a number in [0, 1] (0.001 = 0.1 %; 0 = never more padding "
            "than element units)"
        )


def planned_padding(
    tensors: Sequence[TensorEntry], units: Mapping[str, int], world_size: int, alignment_bytes: int
) -> int:
    """Padding elements of the group's planned layout with these units."""
    layout = plan_layout(_specs(tensors, units), world_size, alignment_bytes)
    return layout.buffer_numel - layout.numel


def _specs(tensors: Sequence[TensorEntry], units: Mapping[str, int]) -> list[TensorSpec]:
    """The group as the planner takes it (one dtype: the first tensor's)."""
    dtype = str(tensors[0][2]).removeprefix("torch.") if tensors else "float32"
    return [TensorSpec(name, tuple(shape), dtype, units[name]) for name, shape, _ in tensors]


def coarsen_units(
    tensors: Sequence[TensorEntry],
    world_size: int,
    options: Mapping[str, Sequence[int]],
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    max_extra_padding: float = DEFAULT_MAX_EXTRA_PADDING,
) -> dict[str, int]:
    """Units as coarse as the group's padding budget allows: the search Muon's "auto" and the
    default policy's experts share.

    ``options[name]`` lists a tensor's acceptable coarser units, preferred first. The budget is
    element units' planned padding plus ``max_extra_padding`` times the group's elements.
    Every tensor gets its first option at once if the planned padding fits the budget;
    otherwise tensors are tried one by one, largest first (the ``MAX_COARSEN_TRIALS`` largest),
    each keeping the first option under which it still fits. So the group's planned padding
    exceeds element units' by at most ``max_extra_padding`` of its elements (0: never).
    """
    check_max_extra_padding(max_extra_padding)
    units = {name: 1 for name, _, _ in tensors}
    if not options:
        return units
    numel = sum(math.prod(shape) for _, shape, _ in tensors)
    budget = planned_padding(tensors, units, world_size, alignment_bytes)
    budget += math.floor(max_extra_padding * numel)

    def fits(trial: Mapping[str, int]) -> bool:
        return fits_within(_specs(tensors, trial), world_size, budget, alignment_bytes)

    every = units | {name: choices[0] for name, choices in options.items()}
    if fits(every):
        return every
    sizes = {name: math.prod(shape) for name, shape, _ in tensors}
    for name in sorted(options, key=lambda n: -sizes[n])[:MAX_COARSEN_TRIALS]:
        for unit in options[name]:
            trial = units | {name: unit}
            if fits(trial):
                units = trial
                break
    return units


# ----------------------------------------------------------------------------- Muon
#: Modules whose 2-D weights are not hidden matrices (lookup tables and output maps): Muon
#: leaves them to its AdamW groups. Names containing "embed" are excluded as well.
NON_MUON_MODULES = (
    "classifier",
    "embed_tokens",
    "embedding",
    "embeddings",
    "head",
    "lm_head",
    "output",
    "tok_embeddings",
    "wpe",
    "wte",
)


def is_muon_matrix(fqn: str, shape: Sequence[int]) -> bool:
    """Whether Muon (not its AdamW fallback) updates this tensor: 2-D matrices and stacked
    ``(E, m, n)`` experts, except embeddings and output heads, told by the name of the module
    that owns the weight (``lm_head.weight``) or by "embed" anywhere in the name."""
    module = fqn.rsplit(".", 1)[0].rsplit(".", 1)[-1].lower() if "." in fqn else ""
    return len(shape) in (2, 3) and module not in NON_MUON_MODULES and "embed" not in fqn.lower()


class MuonShardPolicy(GroupShardPolicy):
    """Units for Muon: whole matrices (one expert matrix of a stacked tensor) for Muon
    matrices, elements for the rest.

    ``whole_matrices``: True always keeps Muon matrices whole (no Newton–Schulz communication,
    at the cost of padding); False uses element units (least padding; matrices cut between ranks
    travel to their owner); "auto" keeps a matrix whole where the group's planned padding stays
    within element units' plus ``max_extra_padding`` of the group's elements (``coarsen_units``;
    0 keeps padding exactly at element units'). "auto" needs the whole group, so it is decided
    by ``units_for_group``; asked per parameter, "auto" answers element units.
    """

    def __init__(
        self,
        whole_matrices: WholeMatrices = "auto",
        is_muon: Callable[[str, Sequence[int]], bool] = is_muon_matrix,
        alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
        max_extra_padding: float = DEFAULT_MAX_EXTRA_PADDING,
    ) -> None:
        if whole_matrices not in (True, False, "auto"):
            raise ValueError(f"whole_matrices={whole_matrices!r}: use True, False or 'auto'")
        check_max_extra_padding(max_extra_padding)
        self.whole_matrices = whole_matrices
        self.is_muon = is_muon
        self.alignment_bytes = alignment_bytes
        self.max_extra_padding = max_extra_padding

    def __call__(self, fqn: str, param: Any) -> int:
        shape = tuple(param.shape)
        if self.whole_matrices is True and self.is_muon(fqn, shape):
            return max(1, matrix_unit(shape))
        return 1

    def units_for_group(self, tensors: Sequence[TensorEntry], world_size: int) -> dict[str, int]:
        """Units for one group's ``(name, shape, dtype)`` tensors. "auto": start from element
        units and make Muon matrices whole, all at once or else one by one (largest first,
        the 32 largest), while the planned padding stays within the budget (``coarsen_units``)."""
        units = {name: 1 for name, _, _ in tensors}
        if self.whole_matrices is False or (world_size == 1 and self.whole_matrices == "auto"):
            return units
        options = {
            name: [matrix_unit(shape)]
            for name, shape, _ in tensors
            if self.is_muon(name, tuple(shape)) and matrix_unit(shape) > 1
        }
        if self.whole_matrices is True:
            return units | {name: choices[0] for name, choices in options.items()}
        return coarsen_units(
            tensors, world_size, options, self.alignment_bytes, self.max_extra_padding
        )


# ----------------------------------------------------------------------------- experts
#: Names of one expert's tensor (``experts.7.w1.weight``) and of anything under ``experts.``.
_PER_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")
_EXPERTS = re.compile(r"(^|\.)experts\.")

#: Most row counts tried per fused expert tensor when whole experts are too coarse (E < W):
#: each is one more plan of the group.
MAX_ROW_OPTIONS = 4


def expert_matrix(fqn: str, shape: Sequence[int]) -> tuple[int, int, int] | None:
    """``(experts, rows, row length)`` of an expert tensor, or None for other tensors.

    Fused experts are 3-D ``(E, m, n)`` tensors or tensors of 2+ dims under ``experts.`` (a
    2-D ``(E, k)`` one holds one row per expert); one expert's own tensor
    (``experts.3.w1``) is a single expert. Only ``shape`` and the name are read.
    """
    shape = tuple(shape)
    named = _EXPERTS.search(fqn) is not None
    if len(shape) < 2 or not (named or len(shape) == 3):
        return None
    if named and _PER_EXPERT.search(fqn) is not None:
        return 1, math.prod(shape[:-1]), shape[-1]
    return shape[0], math.prod(shape[1:-1]), shape[-1]


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` from the largest down."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def expert_unit_options(experts: int, rows: int, row: int, world_size: int) -> list[int]:
    """Units that keep expert matrices whole on a rank, preferred first: a whole expert, then,
    for a fused tensor with fewer experts than ranks (whole experts leave ranks empty or pad),
    ``k`` rows of one with ``k`` dividing the rows, largest first, so no piece spans two
    experts. One expert's own tensor (``experts == 1``) is only ever kept whole: its siblings
    are the other experts, and a model's many such tensors would each cost more plans."""
    options = [rows * row]
    if 1 < experts < world_size:
        options += [k * row for k in _divisors(rows)[1 : MAX_ROW_OPTIONS + 1]]
    return options


class ExpertShardPolicy(GroupShardPolicy):
    """``fully_shard``'s default: element units, except that expert tensors keep each expert
    matrix whole on a rank (or ``k`` of its rows, when ``E < W``) wherever the group's planned
    padding stays within element units' plus ``max_extra_padding`` of the group's elements.

    Experts whole on ranks are what Muon (per-expert Newton–Schulz without communication) and
    block quantization want, and cutting through them is what an even dim-0 split does to
    fused experts. The group's padding, and so its memory and all-gather bytes, exceed element
    units' by at most ``max_extra_padding`` (default 0.1 %; 0: exactly element units' padding).
    Asked per parameter it answers element units.
    """

    def __init__(
        self,
        alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
        max_extra_padding: float = DEFAULT_MAX_EXTRA_PADDING,
    ) -> None:
        check_max_extra_padding(max_extra_padding)
        self.alignment_bytes = alignment_bytes
        self.max_extra_padding = max_extra_padding

    def __call__(self, fqn: str, param: Any) -> int:
        return 1

    def units_for_group(self, tensors: Sequence[TensorEntry], world_size: int) -> dict[str, int]:
        """Element units, then each expert tensor's ``expert_unit_options`` through the same
        search as Muon's "auto" (``coarsen_units``). One rank cuts nothing: elements."""
        if world_size == 1:
            return {name: 1 for name, _, _ in tensors}
        options = {}
        for name, shape, _ in tensors:
            matrix = expert_matrix(name, shape)
            if matrix is not None and matrix[1] * matrix[2] > 1:
                options[name] = expert_unit_options(*matrix, world_size)
        return coarsen_units(
            tensors, world_size, options, self.alignment_bytes, self.max_extra_padding
        )


#: ``fully_shard``'s default, and the capacity planner's: element units, whole experts where
#: they add at most ``DEFAULT_MAX_EXTRA_PADDING`` of padding (``ExpertShardPolicy``).
DEFAULT_POLICY: ShardPolicy = ExpertShardPolicy()


#: Expert tensors named one by one in a group's notes before a choice is summarised.
MAX_NOTE_LINES = 4


def expert_notes(tensors: Sequence[Any]) -> tuple[str, ...]:
    """What a group's units mean for its expert tensors, from planned ``TensorSpec``-like
    entries (``name``, ``shape``, ``unit``): whole experts per rank, ``k`` rows of each, or
    experts cut between ranks. One line per tensor, or per choice when more than
    ``MAX_NOTE_LINES`` tensors share it (a model with one tensor per expert); dense tensors
    get none."""
    chosen: dict[str, list[str]] = {}
    for t in tensors:
        matrix = expert_matrix(t.name, t.shape)
        if matrix is not None and matrix[1] * matrix[2] > 0:
            chosen.setdefault(_expert_choice(t.name, t.unit, *matrix), []).append(
                f"{t.name} {tuple(t.shape)}"
            )
    return grouped_notes(chosen, "expert tensors")


def grouped_notes(chosen: dict[str, list[str]], what: str) -> tuple[str, ...]:
    """``"<tensor>: <choice>"`` lines, one per tensor, or one per choice when more than
    ``MAX_NOTE_LINES`` tensors share it (``what`` names them: "expert tensors")."""
    notes = []
    for choice, names in chosen.items():
        if len(names) > MAX_NOTE_LINES:
            names = [f"{len(names)} {what} ({names[0]}, ..., {names[-1]})"]
        notes += [f"{name}: {choice}" for name in names]
    return tuple(notes)


def _expert_choice(name: str, unit: int, experts: int, rows: int, row: int) -> str:
    """The words for what ``unit`` does to one expert tensor's ``rows x row`` matrices."""
    what = "expert" if experts > 1 or _PER_EXPERT.search(name) else "slice"
    if unit % (rows * row) == 0:
        return f"whole {what}s on ranks"
    if unit % row == 0 and (rows * row) % unit == 0:
        return f"{unit // row} of each {what}'s {rows} rows together on a rank"
    return f"{what}s cut between ranks (unit {unit}): whole ones did not fit the padding budget"


# ----------------------------------------------------------------------------- FP8 blocks
#: A square FP8 tile's side, or ``(rows, cols)`` of a tile: ``(1, 32)`` are MXFP8's blocks.
Float8Tile = int | tuple[int, int]


def tile_shape(block: Float8Tile, what: str) -> tuple[int, int]:
    """``(rows, cols)`` of a tile given as ``block``; a one-line error naming ``what`` if it is
    neither a positive int nor a pair of them."""
    dims = (block, block) if isinstance(block, int) else block
    if not (
        isinstance(dims, tuple)
        and len(dims) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims)
    ):
        raise ValueError(
            f"{what}: block={block!r} must be a positive int or a (rows, cols) pair of them"
        )
    return dims


def float8_tiles(fqn: str, shape: Sequence[int], block: Float8Tile = 128) -> tuple[int, int] | None:
    """``(matrix rows, row length)`` of the tiles a weight is quantized in for a block-wise FP8
    all-gather, or None for a tensor kept in the compute dtype. ``block`` is a square tile's
    side or a ``(rows, cols)`` tile.

    A tensor of 2+ dims is viewed as ``rows = prod(all but the last dim)`` rows of its last dim.
    Tiles restart at every matrix: a fused expert tensor ``(E, m, n)`` has one matrix per expert
    (``expert_matrix``), unless ``m`` is a multiple of the tile rows, when per-expert tiles are
    exactly the tiles of the whole ``(E * m, n)`` view (one matrix of all rows). Eligible when
    each matrix has at least a tile's rows and columns, so every tile row holds whole tiles
    except at a matrix's bottom or right edge (partial edge tiles are allowed). One-row tiles
    (MXFP8's ``1 x 32`` blocks) never span rows, so the view is one matrix; they are eligible
    when the row length is a multiple of the block, since an MX block is exactly that many
    elements (OCP MX v1.0).
    """
    tile_rows, tile_cols = tile_shape(block, "float8_tiles")
    shape = tuple(shape)
    if len(shape) < 2:
        return None
    rows, cols = math.prod(shape[:-1]), shape[-1]
    if tile_rows == 1:
        return (rows, cols) if rows > 0 and cols > 0 and cols % tile_cols == 0 else None
    matrix = expert_matrix(fqn, shape)
    per_matrix = matrix[1] if matrix is not None else rows
    if per_matrix < tile_rows or cols < tile_cols:
        return None
    return (rows if per_matrix % tile_rows == 0 else per_matrix), cols


def float8_block_policy(block: Float8Tile = 128) -> ShardPolicy:
    """Units that keep every FP8 tile on one rank, so each rank quantizes its own piece with no
    communication for the scales: a tile's rows of an eligible weight (``float8_tiles``; whole
    rows for MXFP8's one-row blocks), or a whole matrix where tiles restart at matrices that are
    not a multiple of the tile rows (unaligned experts); one element for tensors kept in the
    compute dtype. ``fully_shard`` combines it with the group's policy (LCM, ``combine``)."""
    tile_rows = tile_shape(block, "float8_block_policy")[0]

    def unit(fqn: str, param: Any) -> int:
        shape = tuple(param.shape)
        tiles = float8_tiles(fqn, shape, block)
        if tiles is None:
            return 1
        matrix_rows, cols = tiles
        rows = math.prod(shape[:-1])
        return (tile_rows if matrix_rows == rows else matrix_rows) * cols

    return unit


# ----------------------------------------------------------------------------- 8-bit AdamW
def is_quantized(shape: Sequence[int], min_8bit_size: int) -> bool:
    """Whether ``AdamW8bit`` keeps 8-bit state for a tensor: ``min_8bit_size`` elements or more
    (smaller ones keep full precision, as bitsandbytes and torchao), and never an empty tensor,
    which has no blocks."""
    numel = math.prod(shape)
    return numel >= min_8bit_size and numel > 0


def quantized_unit(shape: Sequence[int], block_size: int, tile: tuple[int, int] | None) -> int:
    """Elements of one quantization unit of a quantized tensor: ``tile[0]`` whole rows when
    tensors of 2+ dims are quantized in 2-D tiles, else one ``block_size`` block."""
    return tile[0] * row_numel(tuple(shape)) if tile and len(shape) >= 2 else block_size


def adamw8bit_policy(
    block_size: int = 256, tile: tuple[int, int] | None = None, min_8bit_size: int = 4096
) -> ShardPolicy:
    """``AdamW8bit``'s rule: units that keep every quantization block on one rank
    (``quantized_unit``); one element for tensors below ``min_8bit_size`` elements, which keep
    full-precision state."""

    def unit(fqn: str, param: Any) -> int:
        shape = tuple(param.shape)
        if not is_quantized(shape, min_8bit_size):
            return 1
        return max(1, quantized_unit(shape, block_size, tile))

    return unit


# ----------------------------------------------------------------------------- Shampoo
def check_preconditioner_dim(max_preconditioner_dim: Any) -> None:
    """Shampoo's block side ``B`` must be an int >= 1 (it decides the shard layout)."""
    if (
        not isinstance(max_preconditioner_dim, int)
        or isinstance(max_preconditioner_dim, bool)
        or max_preconditioner_dim < 1
    ):
        raise ValueError(
            f"Invalid max_preconditioner_dim: {max_preconditioner_dim!r}; it is the largest "
            "block side B and must be an int >= 1 (default 1024)"
        )


def merge_small_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """DistributedShampoo's dimension merging: walking the dims in order, a dim joins the
    previous one when either is 1 or their product stays within ``max_dim``, so small tensors
    become vectors (10×6 → 60 for B ≥ 60) and size-1 dims vanish. A merge of neighbours in
    row-major order is a reshape: the flat storage, and so the shard layout, is unchanged."""
    merged = [shape[0]] if shape else [1]
    for dim in shape[1:]:
        if merged[-1] == 1 or dim == 1 or merged[-1] * dim <= max_dim:
            merged[-1] *= dim
        else:
            merged.append(dim)
    return tuple(merged)


def shampoo_matrix(
    shape: Sequence[int],
    max_dim: int,
    merge_dims: bool = False,
    precondition_1d: bool = False,
) -> tuple[int, int, int] | None:
    """``(rows, cols, order)`` of the matrix whose ``B × B`` blocks Shampoo and SOAP
    precondition, or None for tensors they leave to the diagonal (grafting) rule.

    With ``merge_dims`` the shape is first merged (``merge_small_dims``). A shape of one dim is
    a vector, preconditioned only with ``precondition_1d``: an ``n × 1`` column of order 1 (one
    factor per block of ``B`` elements). Two or more dims are an order-2 ``prod(leading dims) ×
    last dim`` matrix (DistributedShampoo keeps one factor per dim for 3+ dims; we do not).
    """
    if math.prod(shape) == 0:
        return None
    dims = merge_small_dims(shape, max_dim) if merge_dims else tuple(shape)
    if len(dims) <= 1:
        return (math.prod(dims), 1, 1) if precondition_1d else None
    return math.prod(dims[:-1]), dims[-1], 2


def shampoo_blocked(
    shape: Sequence[int],
    max_dim: int = 1024,
    merge_dims: bool = False,
    precondition_1d: bool = False,
) -> bool:
    """Whether Shampoo preconditions the tensor with blocks (``shampoo_matrix`` is not None);
    others are updated by the grafting rule only."""
    return shampoo_matrix(shape, max_dim, merge_dims, precondition_1d) is not None


def shampoo_slab_rows(
    shape: Sequence[int],
    max_dim: int,
    merge_dims: bool = False,
    precondition_1d: bool = False,
) -> int:
    """Rows of one slab (one row of ``B × B`` blocks) of the tensor's matrix view."""
    view = shampoo_matrix(shape, max_dim, merge_dims, precondition_1d)
    rows = view[0] if view else math.prod(shape) // row_numel(tuple(shape))
    return min(max_dim, rows)


def shampoo_policy(
    max_preconditioner_dim: int = 1024,
    merge_dims: bool = False,
    precondition_1d: bool = False,
) -> ShardPolicy:
    """``Shampoo``'s (and ``SOAP``'s) rule: one slab (``min(B, rows)`` whole rows of the matrix
    view, ``merge_dims`` and ``precondition_1d`` deciding the view) per unit for preconditioned
    tensors, so every ``B × B`` block, merged or not, is whole on one rank; elements for the
    rest."""
    check_preconditioner_dim(max_preconditioner_dim)

    def unit(fqn: str, param: Any) -> int:
        view = shampoo_matrix(
            tuple(param.shape), max_preconditioner_dim, merge_dims, precondition_1d
        )
        if view is None:
            return 1
        rows, cols, _ = view
        return min(max_preconditioner_dim, rows) * cols

    return unit
