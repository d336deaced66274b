"""The capacity planner's ``--all-gather fp8|mxfp8`` bytes are the runtime's payload bytes."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from torch import nn

from raggedfsdp import MixedPrecisionPolicy, fully_shard
from raggedfsdp.capacity import Group, Mesh, ModelShapes, Settings, estimate
from raggedfsdp.capacity.cli import main
from raggedfsdp.fsdp import Float8Blocks, MXFP8Blocks
from raggedfsdp.fsdp.float8_gather import Float8Gather
from raggedfsdp.fsdp.state import STATE_ATTR

#: 128x128 tiles with partial edges, whole unaligned experts, and tensors kept in bf16 (with
#: MXFP8 every 2-D tensor has rows of whole 1x32 blocks; only the norm stays in bf16).
SHAPES = {
    "up": (384, 256),
    "down": (200, 384),
    "experts.w": (3, 200, 128),
    "norm": (256,),
    "gate": (4, 256),
}


def _runtime_bytes(kind: str) -> dict:
    model = nn.Module()
    model.experts = nn.Module()
    for name, shape in SHAPES.items():
        owner, leaf = (model.experts, "w") if name == "experts.w" else (model, name)
        owner.register_parameter(leaf, nn.Parameter(torch.randn(shape)))
    fmt = Float8Blocks() if kind == "fp8" else MXFP8Blocks()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather=fmt)
    fully_shard(model, mp_policy=policy)
    sent = []
    real_pack = Float8Gather.pack

    def pack(self, master, rank):
        full, mine = real_pack(self, master, rank)
        sent.append((full.numel(), mine.numel()))
        return full, mine

    with mock.patch.object(Float8Gather, "pack", pack):
        model.unshard()
    group = getattr(model, STATE_ATTR).group
    model.reshard()
    return {"sent": sent[0], "segment": group.layout.segment_size}


@pytest.mark.parametrize("kind", ["fp8", "mxfp8"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_planned_bytes_equal_the_runtime_payload(pool, world_size, kind):
    runtime = pool.run(_runtime_bytes, kind)[0]
    shapes = ModelShapes("tiny", "test", (Group("block", 1, tuple(SHAPES.items())),))
    est = estimate(shapes, Settings(Mesh(1, world_size), all_gather=kind))
    plan = est.plans[0]
    assert plan.segment == runtime["segment"]
    assert (world_size * plan.gather_bytes, plan.gather_bytes) == runtime["sent"]
    assert est.float8["payload"] == runtime["sent"][0]
    assert est.traffic["all_gather"] == 2 * (world_size - 1) * plan.gather_bytes


def test_cli_reports_about_half_the_bytes_for_llama3(capsys):
    assert main(["llama3-8b", "-w", "8", "--all-gather", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fp8 = out["float8_all_gather_bytes"]
    assert out["all_gather"] == "fp8" and 0.5 < fp8["ratio"] < 0.501
    assert fp8["payload"] == fp8["codes"] + fp8["scales"] + fp8["kept"] + fp8["padding"]
    assert fp8["scales"] == fp8["codes"] / (128 * 128) * 4
    with pytest.raises(SystemExit, match="2"):  # argparse's status for a bad choice
        main(["llama3-8b", "-w", "8", "--all-gather", "fp4"])


def test_cli_mxfp8_pays_a_thirty_second_more_at_any_world_size(capsys):
    for world in (8, 256):
        assert main(["llama3-8b", "-w", str(world), "--all-gather", "mxfp8", "--json"]) == 0
        fp8 = json.loads(capsys.readouterr().out)["float8_all_gather_bytes"]
        assert fp8["scales"] == fp8["codes"] / 32  # one e8m0 byte per 32 codes
        assert 0.5156 < fp8["ratio"] < 0.52  # 1/2 + 1/64 and a little padding


#: One rank, so every payload byte is content, and every region a multiple of the 16-byte
#: alignment: codes, the scales of a (256, 512) weight, and a norm kept in bf16.
ONE_RANK = {"up": (256, 512), "norm": (256,)}
#: The published formats' bytes for ONE_RANK, counted by hand: DeepSeek-V3's 128x128 tiles
#: with one fp32 scale each, OCP MX's 1x32 blocks with one e8m0 byte each.
BY_HAND = {
    "fp8": 256 * 512 + (256 // 128) * (512 // 128) * 4 + 256 * 2,
    "mxfp8": 256 * 512 + 256 * (512 // 32) * 1 + 256 * 2,
}


def _one_rank_gather(fmt: Float8Blocks | MXFP8Blocks) -> int:
    """Bytes the runtime's group all-gathers once (its own counter), in this process (W = 1)."""
    model = nn.Module()
    for name, shape in ONE_RANK.items():
        model.register_parameter(name, nn.Parameter(torch.randn(shape)))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather=fmt))
    group = getattr(model, STATE_ATTR).group
    model.unshard()
    model.reshard()
    return group.all_gather_bytes


@pytest.mark.parametrize(
    ("kind", "fmt"), [("fp8", Float8Blocks(128)), ("mxfp8", MXFP8Blocks())], ids=["fp8", "mxfp8"]
)
def test_planner_bytes_are_what_the_runtime_gathers_with_the_policy(kind, fmt):
    """The planner's ``--all-gather`` kind against a group gathering with the policy a user
    passes, and both against the format's published geometry: a planner tile or scale that
    differs from the policy's (or from the format's) changes the bytes."""
    shapes = ModelShapes("one", "test", (Group("block", 1, tuple(ONE_RANK.items())),))
    est = estimate(shapes, Settings(Mesh(1, 1), all_gather=kind))
    assert est.float8["payload"] == est.plans[0].gather_bytes == _one_rank_gather(fmt)
    assert est.float8["payload"] == BY_HAND[kind]
