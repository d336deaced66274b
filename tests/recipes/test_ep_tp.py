"""``--tp`` for the MoE model (recipes/llama/tensor_parallel.py ``apply_tp_to_moe``): a MoE
block with the TP plan at tp 2 against the same block in one process (outputs, input and
parameter gradients, the load counts), the recipe at (dp 2 x tp 2) against its tp 1 run with
AdamW, a checkpoint saved at tp 2 resuming at tp 1; EP x TP: the block at (ep 2 x tp 2) with
an EP rank whose experts get no token against one process, and the recipe at ``--ep 2 --tp 2``
against one process (every optimizer trains or refuses in one line, a checkpoint resumes in
one process, FSDP2 and activation checkpointing)."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from recipes.llama.config import parse_args
from recipes.llama.expert_parallel import distribute_experts, ep_meshes
from recipes.llama.model import rope_table
from recipes.llama.model_config import MoEConfig
from recipes.llama.moe import MoEBlock, MoETransformer
from recipes.llama.parallel import distributed
from recipes.llama.tensor_parallel import apply_tp_to_block
from recipes.llama.train import train
from tests.support.recipe_runs import args, run_main, run_train

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


# ----------------------------------------------------------------------------- EP x TP block
EP, DP_BATCH = 2, 2  # (dp_shard_mod_ep 1 x ep 2 x tp 2) at W=4: two dp ranks of 2 sequences


def _starved_block(n_shared_experts: int) -> MoEBlock:
    """The block with the experts of EP rank 1 (3, 4, 5 of 6) never chosen."""
    block = _block(n_shared_experts)
    with torch.no_grad():
        block.feed_forward.expert_bias[3:] = -1e4
    return block


def _ep_tp_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    shape = (EP * DP_BATCH, SEQ, DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _block_on_ep_tp(n_shared_experts: int) -> dict:
    """Rank (e, t) runs dp rank e's sequences, sequence half t; the experts' gradients are
    each rank's slice of the whole batch's (the all-to-all brings every dp rank's rows), the
    dense ones summed over the dp ranks here (fully_shard's reduction)."""
    mesh, _ = ep_meshes(EP, tp=TP)
    block = _starved_block(n_shared_experts)
    apply_tp_to_block(block, mesh["tp"])
    distribute_experts(block, mesh["ep", "tp"])
    e, t = mesh["ep"].get_local_rank(), mesh["tp"].get_local_rank()
    x, target = (v.chunk(EP)[e].chunk(TP, 1)[t] for v in _ep_tp_inputs())
    got = _run_block(block, x, target)
    ep_group = mesh["ep"].get_group()
    for name in list(got):
        if name not in ("out", "x", "load") and ".experts." not in name:
            dist.all_reduce(got[name], group=ep_group)
    dist.all_reduce(got["load"])  # TP rank 0 of each dp rank counts its tokens
    return got


@pytest.mark.parametrize("n_shared_experts", [0, 1], ids=["routed", "shared"])
def test_a_moe_block_at_ep2_tp2_matches_one_process(dist_pool, n_shared_experts):
    """Outputs, input and parameter gradients within 1e-5, load counts equal, while EP rank
    1's experts receive no token (their gradients zero, as in one process)."""
    want = _run_block(_starved_block(n_shared_experts), *_ep_tp_inputs())
    assert want["load"][3:].sum() == 0 and want["load"][:3].sum() > 0
    for rank, got in enumerate(dist_pool(4).run(_block_on_ep_tp, n_shared_experts)):
        e, t = divmod(rank, TP)
        assert torch.equal(got["load"], want["load"]), (got["load"], want["load"])
        for key, expected in want.items():
            if key == "load":
                continue
            if key in ("out", "x"):  # this rank's sequences, its half of each
                expected = expected.chunk(EP)[e].chunk(TP, 1)[t]
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


# ----------------------------------------------------------------------------- EP x TP
def _train_losses(argv: list[str]) -> dict:
    """Losses, gradient norms and the banner's mesh of one run on this rank."""
    cfg = parse_args(argv)
    norms: dict[int, float] = {}
    with distributed(cfg) as env:
        result = train(cfg, env, on_step=lambda step, m: norms.update({step: m["grad_norm"]}))
        return {"losses": result.losses, "norms": norms, "mesh": env.mesh_shape()}


def test_moe_tiny_at_ep2_tp2_trains_as_one_process_and_resumes_there(dist_pool, data_dir, tmp_path):
    """moe_tiny with AdamW at (ep 2 x tp 2), W=4: the experts DTensors on (ep, tp), the dense
    weights TP over tp and sharded over dp_shard (2 ranks): 10 steps within 1e-5 of one
    process, losses and gradient norms (clip_grad_norm_ over every dim); its step-8 checkpoint
    (model and optimizer state in global coordinates) resumed in one process (ep 1, tp 1)
    goes on as the EP x TP run did."""
    extra = ["--steps", "10", "--eval-every", "0"]
    plain = dist_pool(1).run(
        _train_losses, _moe_args(data_dir, tmp_path / "one", *extra, "--checkpoint-every", "0")
    )[0]
    argv = _moe_args(data_dir, tmp_path / "eptp", "--ep", "2", "--tp", "2", *extra)
    ours = dist_pool(4).run(_train_losses, [*argv, "--checkpoint-every", "8"], timeout=240)
    assert ours[0]["mesh"] == {"dp_shard_mod_ep": 1, "ep": 2, "tp": 2}
    losses = ours[0]["losses"]
    assert all(r["losses"] == losses for r in ours)
    assert list(losses) == list(range(1, 11)) and losses[10] < losses[1] - 0.3, losses
    for step, loss in losses.items():
        assert abs(loss - plain["losses"][step]) < TP_TOLERANCE, (step, loss, plain["losses"])
        norm, ref_norm = ours[0]["norms"][step], plain["norms"][step]
        assert abs(norm - ref_norm) < TP_TOLERANCE * max(1.0, ref_norm), (step, norm, ref_norm)
    saved = tmp_path / "step8"
    shutil.copytree(tmp_path / "eptp" / "checkpoints" / "step_00000008", saved)
    resume = [*extra, "--checkpoint-every", "0", "--resume", str(saved)]
    resumed = dist_pool(1).run(_train_losses, _moe_args(data_dir, tmp_path / "back", *resume))[0]
    assert list(resumed["losses"]) == [9, 10]
    for step, loss in resumed["losses"].items():
        assert abs(loss - losses[step]) < TP_TOLERANCE, (step, loss, losses[step])


@pytest.mark.slow  # ~25 s on 2 cores: two 4-step runs at W=4 and one at W=1
def test_fsdp2_and_activation_checkpointing_at_ep2_tp2_train_as_one_process(
    dist_pool, data_dir, tmp_path
):
    """``--fsdp fsdp2`` (torch's fully_shard on the (ep, tp) experts over dp_shard_mod_ep,
    torchtitan's) and raggedfsdp with ``--activation-checkpointing`` (the recompute runs the
    all-to-alls again) at ``--ep 2 --tp 2``: 4 steps within 1e-5 of one process."""
    extra = ["--steps", "4", "--checkpoint-every", "0", "--eval-every", "0"]
    plain = dist_pool(1).run(_train_losses, _moe_args(data_dir, tmp_path / "one", *extra))[0]
    for name, options in {
        "fsdp2": ["--fsdp", "fsdp2"],
        "ac": ["--activation-checkpointing"],
    }.items():
        argv = _moe_args(data_dir, tmp_path / name, "--ep", "2", "--tp", "2", *options, *extra)
        ours = dist_pool(4).run(_train_losses, argv, timeout=240)[0]
        for step, loss in ours["losses"].items():
            assert abs(loss - plain["losses"][step]) < TP_TOLERANCE, (name, step, loss)
            norm, ref_norm = ours["norms"][step], plain["norms"][step]
            assert abs(norm - ref_norm) < TP_TOLERANCE * max(1.0, ref_norm), (name, step, norm)


@pytest.mark.parametrize("optimizer", ["muon", "adamw8bit", "shampoo", "soap"])
def test_every_optimizer_trains_or_refuses_at_ep2_tp2(dist_pool, data_dir, tmp_path, optimizer):
    """Muon (each expert assembled from its EP rank's TP blocks), Shampoo and SOAP (each
    global slab on an owner over ep x tp) train; AdamW8bit refuses, while it is built, a
    dense TP weight whose split cuts its blocks or experts whose d_ff split interleaves them:
    one line from rank 0 naming the fix."""
    extra = ["--ep", "2", "--tp", "2", "--optimizer", optimizer, "--steps", "2"]
    extra += ["--checkpoint-every", "0", "--eval-every", "0", "--preconditioner-dim", "8"]
    results = dist_pool(4).run(run_main, _moe_args(data_dir, tmp_path / optimizer, *extra))
    if optimizer != "adamw8bit":
        assert [r[0] for r in results] == [0] * 4, results
        return
    err = results[0][2]
    assert [r[0] for r in results] == [2] * 4 and results[1][1:] == ("", ""), results
    assert err.startswith(f"error: --optimizer {optimizer}: parameter ") and err.count("\n") == 1
    # the first parameter refused: a dense TP one whose split cuts 8-bit blocks, or experts
    assert " split over the 'tp' mesh dim " in err or "'ep' x 'tp' mesh dims" in err, err
    assert "AdamW" in err, err  # the fix: give it to AdamW (or Muon), or change the split


# ----------------------------------------------------------------------------- HSDP x EP x TP
# (dp_replicate 2 x dp_shard_mod_ep 1 x ep 2 x tp 2) needs 8 ranks: W=4 holds no layout with
# all three above 1, so it runs as each of 8 ranks on the fake process group (a dry run).
HSDP_EP_TP = ["--dp-replicate", "2", "--ep", "2", "--tp", "2"]
TINY_STEP = ["--seq-len", "16", "--micro-batch-size", "1"]  # a dry run's step: set-up dominates


def _dry_run(argv: list[str], rank: int, world: int) -> dict:
    """moe_tiny's dry run as ``rank`` of ``world`` (two steps: the report's is the steady
    second, without the first's one-off checks): its report, its mesh's groups, every
    parameter's piece (TP block shape, local elements, shard group size) and the element
    count of every group's gradient segment."""
    from unittest import mock

    from recipes.llama import dry_run, parallel
    from recipes.llama.expert_parallel import expert_dp_mesh

    built: dict = {}
    build_model = parallel.build_model

    def capture(cfg, env, policy):  # inside the fake world: the mesh can be read
        mesh = env.ep_mesh
        built["groups"] = {
            "coordinate": tuple(mesh.get_coordinate()),
            "shape": env.mesh_shape(),
            "dp": env.mesh.mesh.tolist(),
            "experts_dp": expert_dp_mesh(mesh).mesh.tolist(),
            "ep_tp": mesh["ep", "tp"].mesh.tolist(),
        }
        built["model"] = build_model(cfg, env, policy)
        return built["model"]

    cfg = parse_args(["--config", "moe_tiny", "--run-dir", "/tmp/moe-tiny-dry-run", *argv])
    with mock.patch.object(parallel, "build_model", capture):
        report = dataclasses.asdict(dry_run.run(cfg, dry_run.DryRun(rank, world, "fake")))
    model, groups = built["model"], built["groups"]
    pieces = {
        name: (p.ragged_shard.shape, p.local.numel(), len(p.ragged_shard.units_per_rank))
        for name, p in model.named_parameters()
    }
    groups_once = {id(g): g for m in model.modules() for g in _groups_of(m)}  # shared states
    segments = [g.layout.segment_size for g in groups_once.values()]
    return {"report": report, "groups": groups, "pieces": pieces, "segments": segments}


def _groups_of(module: torch.nn.Module) -> list:
    """The fully_shard parameter groups ``module`` owns (none if it is not wrapped)."""
    return module._fsdp_state().groups if hasattr(module, "_fsdp_state") else []


@pytest.mark.slow  # ~10-20 s on 2 shared cores: eight dry runs, about 1-3 s each
def test_moe_tiny_at_hsdp2_ep2_tp2_dry_runs_as_its_ranks() -> None:
    """Ranks of (dp_replicate 2 x dp_shard_mod_ep 1 x ep 2 x tp 2) build and step: the first
    replica's four (every (ep, tp) coordinate) and two of the second's (4 and 7, opposite
    corners); rank r at (r // 4, 0, r // 2 % 2, r % 2); each expert tensor's (E / ep,
    d_ff / tp) block held whole (total / (ep * tp * dp_shard_mod_ep)); each dense TP block
    (norms and router replicated on tp) split over the 2 dp_shard ranks; the replicas hold the
    same pieces with the same figures; against the same rank at (ep 2 x tp 2), W=4, the same
    parameter, gradient and optimizer bytes and all-gather, reduce-scatter and all-to-all
    bytes, plus the replicas' all-reduce of every group's gradient segment (fp32)."""
    ranks = {r: _dry_run([*HSDP_EP_TP, *TINY_STEP], r, 8) for r in (0, 1, 2, 3, 4, 7)}
    cfg = parse_args(["--config", "moe_tiny"]).model
    ep, tp, experts = 2, 2, cfg.n_experts
    with torch.device("meta"):  # the unsharded model's element counts
        numels = {n: p.numel() for n, p in MoETransformer(cfg, 8).named_parameters()}
    for rank, got in ranks.items():
        rep, e, t = rank // 4, rank // 2 % 2, rank % 2
        assert got["groups"] == {
            "coordinate": (rep, 0, e, t),
            "shape": {"dp_replicate": 2, "dp_shard_mod_ep": 1, "ep": 2, "tp": 2},
            "dp": [[t, 2 + t], [4 + t, 6 + t]],
            "experts_dp": [[rank % 4], [rank % 4 + 4]],
            "ep_tp": [[4 * rep, 4 * rep + 1], [4 * rep + 2, 4 * rep + 3]],
        }, rank
        pair = ranks[(rank ^ 2) % 4]["pieces"]  # the other dp_shard rank's (as in replica 0)
        for name, (block, local, shards) in got["pieces"].items():
            whole = math.prod(block)
            if ".experts." in name:
                hidden = (cfg.moe_hidden // tp, cfg.dim)
                assert block == (experts // ep, *(hidden[::-1] if name.endswith("w2") else hidden))
                assert (local, shards) == (whole, 1), name
                continue
            replicated = name.endswith(("norm.weight", "router.weight"))
            assert shards == 2 and local + pair[name][1] == whole, name
            assert whole * (1 if replicated else tp) == numels[name], name
        report = got["report"]
        assert report["params"] == report["grads"] == 4 * sum(p[1] for p in got["pieces"].values())
        mirror = ranks[rank % 4]  # the same coordinate in the first replica
        assert got["pieces"] == mirror["pieces"], rank
        assert _figures(report) == _figures(mirror["report"]), rank
    for rank in (0, 3):
        hsdp, plain = ranks[rank], _dry_run([*HSDP_EP_TP[2:], *TINY_STEP], rank, 4)
        same = ("params", "grads", "optimizer", "all_gather", "reduce_scatter", "all_to_all")
        assert {k: hsdp["report"][k] for k in same} == {k: plain["report"][k] for k in same}
        added = hsdp["report"]["all_reduce"] - plain["report"]["all_reduce"]
        assert hsdp["segments"] == plain["segments"] and added == 4 * sum(hsdp["segments"]), rank
        assert added == hsdp["report"]["grads"], rank  # no padding: the segments are the shards


def _figures(report: dict) -> dict:
    """A dry run's memory and traffic figures (not its rank or timing)."""
    return {k: v for k, v in report.items() if k not in ("rank", "setup_s")}
