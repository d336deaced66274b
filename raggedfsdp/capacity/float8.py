"""``--all-gather fp8|mxfp8``: the planner's view of the block-wise FP8 all-gathers.

It re-derives nothing: the units come from ``float8_block_policy`` combined with the group's
policy (as ``fully_shard`` does with ``MixedPrecisionPolicy(all_gather=Float8Blocks(128))`` or
``MXFP8Blocks()``) and the bytes per rank from ``Float8Payload``, the plan the runtime packs and
gathers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from raggedfsdp.sharding.float8_payload import (
    FP8_BLOCK,
    MX_BLOCK,
    MX_SCALE_BYTES,
    SCALE_BYTES,
    Float8Payload,
    eligible_tiles,
)
from raggedfsdp.sharding.planner import Layout
from raggedfsdp.sharding.units import ShardPolicy, combine, float8_block_policy

__all__ = [
    "ALL_GATHER_KINDS",
    "FORMATS",
    "FP8_BLOCK",
    "GatherFormat",
    "float8_summary",
    "gather_policy",
    "payload",
]


@dataclass(frozen=True)
class GatherFormat:
    """What one ``--all-gather`` kind sends per quantized weight, and the report's words for it."""

    tile: tuple[int, int]  # (rows, cols) of one tile
    scale_bytes: int  # bytes of one tile's scale
    geometry: str  # tiles and scales, for the report's heading
    units: str  # the units ``float8_block_policy`` gives a tiled weight
    scales: str  # the report's name for the scales


FORMATS = {
    "fp8": GatherFormat(
        (FP8_BLOCK, FP8_BLOCK),
        SCALE_BYTES,
        f"{FP8_BLOCK}x{FP8_BLOCK} tiles, fp32 scales",
        f"{FP8_BLOCK}-row units",
        "fp32 tile",
    ),
    "mxfp8": GatherFormat(
        (1, MX_BLOCK),
        MX_SCALE_BYTES,
        f"1x{MX_BLOCK} blocks, e8m0 scales",
        "1-row units",
        "e8m0 block",
    ),
}
ALL_GATHER_KINDS = ("param", *FORMATS)


def gather_policy(policy: ShardPolicy, all_gather: str) -> ShardPolicy:
    """The group's policy with every FP8 tile kept on one rank when the gather is FP8."""
    if all_gather not in FORMATS:
        return policy
    return combine(policy, float8_block_policy(FORMATS[all_gather].tile))


def payload(layout: Layout, param_bytes: int, kind: str = "fp8") -> Float8Payload:
    """The ``kind`` gather's payload plan of one group (tensors that cannot be tiled travel in
    the ``param_bytes``-byte compute dtype)."""
    fmt = FORMATS[kind]
    eligible = eligible_tiles(layout, fmt.tile)
    return Float8Payload(layout, eligible, fmt.tile, param_bytes, scale_bytes=fmt.scale_bytes)


def float8_summary(plans: Iterable[Any], param_bytes: int, kind: str = "fp8") -> dict[str, float]:
    """Bytes of one all-gather of every group (repeats counted), the FP8 payload split into
    codes, scales, tensors kept in the compute dtype and padding, beside the compute-dtype
    gather of the same layout; ``plans`` are ``GroupPlan``-like (``layout``, ``instances``)."""
    out = dict.fromkeys(("payload", "codes", "scales", "kept", "padding", "param_gather"), 0.0)
    for plan in plans:
        fp8, n = payload(plan.layout, param_bytes, kind), plan.instances
        scales = sum(p.num_scales for pieces in fp8.pieces for p in pieces) * fp8.scale_bytes
        codes = fp8.quantized_numel
        out["payload"] += n * fp8.buffer_bytes
        out["codes"] += n * codes
        out["scales"] += n * scales
        out["kept"] += n * (plan.layout.numel - codes) * param_bytes
        out["param_gather"] += n * plan.layout.buffer_numel * param_bytes
    out["padding"] = out["payload"] - out["codes"] - out["scales"] - out["kept"]
    out["ratio"] = out["payload"] / max(out["param_gather"], 1.0)
    return out
