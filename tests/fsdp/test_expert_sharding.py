"""fully_shard's default keeps fused experts whole on ranks, so Muon moves no bytes.

A tiny module with a dense matrix and one fused ``(E, m, n)`` expert parameter, ``E`` not
divisible by ``W``, sized so that element units cut through experts while whole experts cost
no more padding: with the default shard policy every rank's piece of the experts is whole
experts, the group's notes say so, and a Muon step orthogonalises every expert where it lies;
with plain element units the same step moves expert pieces between ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

#: W -> (E, dense rows): a (rows, 4) matrix, then E experts of 8 x 4, that element units cut
CASES = {3: (8, 6), 4: (6, 14)}


class _Experts(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, 8, 4))


class _TinyMoE(nn.Module):
    def __init__(self, experts: int, rows: int) -> None:
        super().__init__()
        self.gate = nn.Linear(4, rows, bias=False)
        self.experts = _Experts(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = torch.einsum("bn,emn->bem", x, self.experts.w)
        return routed.square().mean() + self.gate(x).square().mean()


def _muon_step(world: int, elements: bool) -> dict:
    from raggedfsdp.fsdp import fully_shard
    from raggedfsdp.optim import Muon
    from raggedfsdp.sharding import element_units

    torch.manual_seed(0)
    model = _TinyMoE(*CASES[world])
    fully_shard(model, shard_policy=element_units() if elements else None)
    group = model._raggedfsdp_state.group
    start, stop = model.experts.w.local_range
    opt = Muon(model.parameters(), lr=0.01)
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        model(x).backward()
        opt.step()
        opt.zero_grad()
    return {"range": (start, stop), "notes": group.notes, "stats": dict(opt.last_step_stats)}


@pytest.mark.parametrize("world_size", [3, 4])
def test_default_policy_gives_whole_experts_and_muon_moves_nothing(pool, world_size):
    for rank, res in enumerate(pool.run(_muon_step, world_size, False)):
        start, stop = res["range"]
        assert start % 32 == 0 and stop % 32 == 0, (rank, res["range"])
        experts = CASES[world_size][0]
        assert f"experts.w ({experts}, 8, 4): whole experts on ranks" in res["notes"], res
        stats = res["stats"]
        assert stats["bytes_sent"] == 0 and stats["bytes_received"] == 0, (rank, stats)
        assert stats["matrices_local"] == stats["matrices"] == experts + 1, stats


@pytest.mark.parametrize("world_size", [3, 4])
def test_plain_element_units_cut_the_same_experts(pool, world_size):
    results = pool.run(_muon_step, world_size, True)
    assert any(res["range"][0] % 32 or res["range"][1] % 32 for res in results), results
    assert sum(res["stats"]["bytes_sent"] for res in results) > 0, results
    assert all("experts cut between ranks" in " ".join(res["notes"]) for res in results)


def _adamw8bit_step(world: int) -> dict:
    from raggedfsdp.fsdp import fully_shard
    from raggedfsdp.optim import AdamW8bit
    from raggedfsdp.sharding import DEFAULT_POLICY, combine

    torch.manual_seed(0)
    model = _TinyMoE(*CASES[world])
    options = {"block_size": 16, "min_8bit_size": 64}
    fully_shard(model, shard_policy=combine(DEFAULT_POLICY, AdamW8bit.shard_policy(**options)))
    opt = AdamW8bit(model.parameters(), lr=0.01, **options)
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(0))).backward()
    opt.step()
    return {
        "range": model.experts.w.local_range,
        "finite": bool(model.experts.w.local.isfinite().all()),
    }


@pytest.mark.parametrize("world_size", [3, 4])
def test_adamw8bit_blocks_stay_inside_whole_experts(pool, world_size):
    # 16-element blocks, 32-element experts: each rank holds whole experts, so whole blocks
    for rank, res in enumerate(pool.run(_adamw8bit_step, world_size)):
        start, stop = res["range"]
        assert start % 32 == 0 and stop % 32 == 0 and res["finite"], (rank, res)
