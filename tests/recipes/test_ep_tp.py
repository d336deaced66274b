"""``--tp`` for the MoE model (recipes/llama/tensor_parallel.py ``apply_tp_to_moe``): a MoE
block with the TP plan at tp 2 against the same block in one process (outputs, input and
parameter gradients, the load counts), the recipe at (dp 2 x tp 2) against its tp 1 run with
AdamW, a checkpoint saved at tp 2 resuming at tp 1, and EP x TP refused in one line."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from recipes.llama.config import ConfigError, parse_args
from recipes.llama.model import rope_table
from recipes.llama.model_config import MoEConfig
from recipes.llama.moe import MoEBlock
from recipes.llama.tensor_parallel import apply_tp_to_block
from tests.support.recipe_runs import args, run_train

TP = 2
BATCH, SEQ, DIM = 3, 8, 32
# TP sums each expert's d_ff halves, and the row-wise layers' partial products, in another
# order than one process: the dense TP recipe's bound
TP_TOLERANCE = 1e-5


def _cfg(n_shared_experts: int) -> MoEConfig:
    return MoEConfig(
        dim=DIM,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        n_experts=6,
        top_k=2,
        moe_hidden=24,
        n_shared_experts=n_shared_experts,
        n_dense_layers=0,
        expert_impl="loop",
    )


def _block(n_shared_experts: int) -> MoEBlock:
    block = MoEBlock(_cfg(n_shared_experts))
    with torch.no_grad():
        for i, p in enumerate(block.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.2)
    block.train()
    return block


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(BATCH, SEQ, DIM, generator=gen), torch.randn(BATCH, SEQ, DIM, generator=gen)


def _run_block(block: MoEBlock, x: torch.Tensor, target: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    out = block(x, rope_table(DIM // 4, SEQ, 10000.0))
    (out * target).sum().backward()
    grads = {}
    for name, p in block.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = g
    return {"out": out.detach(), "x": x.grad, "load": block.feed_forward.tokens_per_expert, **grads}


def _block_on_tp(n_shared_experts: int) -> dict:
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    block = _block(n_shared_experts)
    apply_tp_to_block(block, mesh)
    x, target = _inputs()
    rank = mesh.get_local_rank()
    got = _run_block(block, x.chunk(TP, 1)[rank], target.chunk(TP, 1)[rank])
    dist.all_reduce(got["load"])  # TP rank 0 alone counts: the sum is one process's count
    got["routers"] = [p.to_local().clone() for p in block.feed_forward.router.parameters()]
    return got


@pytest.mark.parametrize("n_shared_experts", [0, 1], ids=["routed", "shared"])
def test_a_moe_block_at_tp2_matches_one_process(dist_pool, n_shared_experts):
    want = _run_block(_block(n_shared_experts), *_inputs())
    for rank, got in enumerate(dist_pool(TP).run(_block_on_tp, n_shared_experts)):
        assert torch.equal(got["load"], want["load"]), (got["load"], want["load"])
        for key, expected in want.items():
            if key == "load":
                continue
            if key in ("out", "x"):  # this rank's half of the sequence
                expected = expected.chunk(TP, 1)[rank]
            diff = (got[key] - expected).abs().max().item()
            assert diff <= TP_TOLERANCE * max(1.0, expected.abs().max().item()), (key, diff)


# ----------------------------------------------------------------------------- the recipe
def _moe_args(data_dir: str, run_dir, *extra: str) -> list[str]:
    return args(data_dir, run_dir, "--config", "moe_tiny", "--steps", "4", *extra)


@pytest.mark.slow  # ~90 s: four 4-step runs at W=4 and W=2 on 2 cores
def test_moe_tiny_at_dp2_tp2_trains_as_tp1_and_resumes_at_tp1(dist_pool, data_dir, tmp_path):
    """moe_tiny (a dense block, two MoE blocks with a shared expert) with AdamW: (dp 2 x tp 2)
    with raggedfsdp and with FSDP2 against the tp 1 run at W=2 (the same dp 2 batches), then
    the raggedfsdp run's step-2 checkpoint resumed at tp 1."""
    plain = dist_pool(2).run(run_train, _moe_args(data_dir, tmp_path / "plain"), timeout=180)
    tp = dist_pool(4).run(
        run_train,
        _moe_args(data_dir, tmp_path / "tp", "--tp", "2", "--checkpoint-every", "2"),
        timeout=240,
    )
    losses = tp[0].losses
    assert all(r.losses == losses for r in tp)  # every rank logs the agreed loss
    assert list(losses) == [1, 2, 3, 4] and losses[4] < losses[1] - 0.3, losses
    fsdp2 = (
        dist_pool(4)
        .run(
            run_train,
            _moe_args(data_dir, tmp_path / "fsdp2", "--tp", "2", "--fsdp", "fsdp2"),
            timeout=240,
        )[0]
        .losses
    )
    for step, loss in losses.items():
        assert abs(loss - plain[0].losses[step]) < TP_TOLERANCE, (step, loss, plain[0].losses)
        assert abs(fsdp2[step] - plain[0].losses[step]) < TP_TOLERANCE, (step, fsdp2)
    saved = tmp_path / "step2"
    shutil.copytree(tmp_path / "tp" / "checkpoints" / "step_00000002", saved)
    resumed = dist_pool(2).run(
        run_train, _moe_args(data_dir, tmp_path / "tp1", "--resume", str(saved)), timeout=180
    )[0]
    assert resumed.resumed_from == str(saved) and list(resumed.losses) == [3, 4]
    for step, loss in resumed.losses.items():
        assert abs(loss - losses[step]) < TP_TOLERANCE, (step, loss, losses[step])


def test_ep_with_tp_is_refused_while_parsing(data_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_args(args(data_dir, tmp_path, "--config", "moe_tiny", "--ep", "2", "--tp", "2"))
    assert str(err.value) == (
        "--ep 2 with --tp 2: EP x TP is not supported yet (the experts would be DTensors on two "
        "mesh dims, which fully_shard does not take); use --tp 1, or --ep 1 (--tp alone splits "
        "every expert's d_ff)"
    )
