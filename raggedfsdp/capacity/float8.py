"""``--all-gather fp8``: the planner's view of the block-wise FP8 all-gather.

It re-derives nothing: the units come from ``float8_block_policy`` combined with the group's
policy (as ``fully_shard`` does with ``MixedPrecisionPolicy(all_gather=Float8Blocks(128))``) and
the bytes per rank from ``Float8Payload``, the plan the runtime packs and gathers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from raggedfsdp.sharding.float8_payload import SCALE_BYTES, Float8Payload
from raggedfsdp.sharding.planner import Layout
from raggedfsdp.sharding.units import ShardPolicy, combine, float8_block_policy, float8_tiles

__all__ = ["ALL_GATHER_KINDS", "FP8_BLOCK", "float8_summary", "gather_policy", "payload"]

ALL_GATHER_KINDS = ("param", "fp8")
FP8_BLOCK = 128  # DeepSeek-V3's tiles, what Float8Blocks() defaults to


def gather_policy(policy: ShardPolicy, all_gather: str) -> ShardPolicy:
    """The group's policy with every FP8 tile kept on one rank when the gather is FP8."""
    return combine(policy, float8_block_policy(FP8_BLOCK)) if all_gather == "fp8" else policy


def payload(layout: Layout, param_bytes: int) -> Float8Payload:
    """The FP8 gather's payload plan of one group (tensors that cannot be tiled travel in the
    ``param_bytes``-byte compute dtype)."""
    tiles = {t.name: float8_tiles(t.name, t.shape, FP8_BLOCK) for t in layout.tensors}
    return Float8Payload(
        layout, {n: t for n, t in tiles.items() if t is not None}, FP8_BLOCK, param_bytes
    )


def float8_summary(plans: Iterable[Any], param_bytes: int) -> dict[str, float]:
    """Bytes of one all-gather of every group (repeats counted), the FP8 payload split into
    codes, scales, tensors kept in the compute dtype and padding, beside the compute-dtype
    gather of the same layout; ``plans`` are ``GroupPlan``-like (``layout``, ``instances``)."""
    out = dict.fromkeys(("payload", "codes", "scales", "kept", "padding", "param_gather"), 0.0)
    for plan in plans:
        fp8, n = payload(plan.layout, param_bytes), plan.instances
        scales = sum(p.num_scales for pieces in fp8.pieces for p in pieces) * SCALE_BYTES
        codes = fp8.quantized_numel
        out["payload"] += n * fp8.buffer_bytes
        out["codes"] += n * codes
        out["scales"] += n * scales
        out["kept"] += n * (plan.layout.numel - codes) * param_bytes
        out["param_gather"] += n * plan.layout.buffer_numel * param_bytes
    out["padding"] = out["payload"] - out["codes"] - out["scales"] - out["kept"]
    out["ratio"] = out["payload"] / max(out["param_gather"], 1.0)
    return out
