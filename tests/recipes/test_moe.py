"""The MoE model family of the recipe: fused experts, routing and balancing, the two expert
compute paths, real shapes on the meta device, bad input, and training under fully_shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import raggedfsdp
from raggedfsdp.sharding.units import is_muon_matrix
from recipes.llama.config import ConfigError
from recipes.llama.moe import MoEFeedForward, MoETransformer, balance_routers, router_load
from recipes.llama.moe_config import MoEConfig, moe_preset
from tests.support.fsdp_training import my_rows, shard_blocks

SHAPES = Path(raggedfsdp.__file__).parent / "data" / "model_shapes.json"
SEQ = 32


def _tiny(**overrides: object) -> MoETransformer:
    model = MoETransformer(moe_preset("moe_tiny", **overrides), SEQ)
    model.init_weights(0)
    return model


def _tokens(rows: int = 6) -> torch.Tensor:
    return torch.randint(0, 256, (rows, SEQ + 1), generator=torch.Generator().manual_seed(1))


def test_experts_are_fused_muon_matrices():
    model = _tiny()
    cfg = model.cfg
    params = dict(model.named_parameters())
    assert [type(b).__name__ for b in model.layers] == ["Block", "MoEBlock", "MoEBlock"]
    for layer in (1, 2):
        prefix = f"layers.{layer}.feed_forward"
        e, h, d = cfg.n_experts, cfg.moe_hidden, cfg.dim
        assert params[f"{prefix}.experts.w1"].shape == (e, h, d)
        assert params[f"{prefix}.experts.w3"].shape == (e, h, d)
        assert params[f"{prefix}.experts.w2"].shape == (e, d, h)
        for name in ("w1", "w2", "w3"):
            fqn = f"{prefix}.experts.{name}"
            assert is_muon_matrix(fqn, params[fqn].shape)
        assert f"{prefix}.expert_bias" not in params  # a buffer: the optimizer never sees it


def test_meta_build_materialized_block_by_block_equals_the_eager_model():
    eager = _tiny()
    with torch.device("meta"):
        lazy = MoETransformer(moe_preset("moe_tiny"), SEQ)
    for index in range(len(lazy.layers)):
        lazy.materialize_block(index, torch.device("cpu"), seed=0)
    lazy.materialize_root(torch.device("cpu"), seed=0)
    lazy_state = lazy.state_dict()
    assert lazy_state.keys() == eager.state_dict().keys()
    for name, tensor in eager.state_dict().items():
        assert torch.equal(lazy_state[name], tensor), name


def test_grouped_mm_and_loop_give_the_same_results():
    results = []
    for impl in ("loop", "grouped_mm"):
        model = _tiny(expert_impl=impl)
        tokens = _tokens()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=1e-6)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[name], rtol=1e-5, atol=1e-7, msg=name)


def test_bias_chooses_experts_but_does_not_weight_them():
    cfg = moe_preset("moe_tiny", score_func="sigmoid")
    ffn = MoEFeedForward(cfg)
    nn.init.normal_(ffn.router.weight, std=0.02)
    x = torch.randn(10, cfg.dim)
    ids, _ = ffn.route(x)
    ffn.expert_bias[3] = 100.0  # every token now picks expert 3 among its top-k
    biased_ids, biased_weights = ffn.route(x)
    assert (biased_ids == 3).any(-1).all() and not (ids == 3).any(-1).all()
    torch.testing.assert_close(biased_weights.sum(-1), torch.ones(10))
    scores = ffn.router(x).float().sigmoid().gather(-1, biased_ids)
    torch.testing.assert_close(biased_weights, scores / scores.sum(-1, keepdim=True))


def test_balance_routers_moves_bias_towards_the_mean_load():
    model = _tiny()
    model.train()
    model(_tokens()[:, :-1])
    load = router_load(model)
    assert set(load) == {"layers.1.feed_forward", "layers.2.feed_forward"}
    assert all(int(c.sum()) == 6 * SEQ * model.cfg.top_k for c in load.values())
    balance_routers(model, rate=0.5)
    for name, counts in load.items():
        bias = model.get_submodule(name).expert_bias
        torch.testing.assert_close(bias, 0.5 * torch.sign(counts.mean() - counts))
        assert not model.get_submodule(name).tokens_per_expert.any()


def _mlp_weights(model: str) -> int:
    """Elements of the MoE block's feed-forward weights (no biases) in model_shapes.json."""
    (entry,) = (m for m in json.loads(SHAPES.read_text())["models"] if m["name"] == model)
    group = next(g for g in entry["groups"] if "moe" in g["name"] or g["name"] == "layer")
    return sum(
        torch.Size(shape).numel()
        for name, shape in group["tensors"]
        if name.startswith("mlp.") and not name.endswith("bias")
    )


@pytest.mark.parametrize(
    ("model", "dim", "experts", "top_k", "hidden", "shared"),
    [
        ("qwen3-30b-a3b", 2048, 128, 8, 768, 0),
        ("deepseek-v3", 7168, 256, 8, 2048, 1),
        ("gpt-oss-120b", 2880, 128, 4, 2880, 0),
    ],
)
def test_real_moe_feed_forward_shapes_match_model_shapes(
    model, dim, experts, top_k, hidden, shared
):
    cfg = MoEConfig(
        dim=dim, n_experts=experts, top_k=top_k, moe_hidden=hidden, n_shared_experts=shared
    )
    with torch.device("meta"):
        ffn = MoEFeedForward(cfg)
    assert sum(p.numel() for p in ffn.parameters()) == _mlp_weights(model)


def test_mixtral_8x7b_has_its_public_parameter_count():
    with torch.device("meta"):
        model = MoETransformer(moe_preset("mixtral_8x7b"), SEQ)
    assert sum(p.numel() for p in model.parameters()) == 46_702_792_704


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: moe_preset("moe_tiyn"), "no MoE preset 'moe_tiyn'; did you mean 'moe_tiny'?"),
        (lambda: moe_preset("moe_tiny", top_k=7), "model.top_k=7 must be in [1, n_experts=6]"),
        (lambda: moe_preset("moe_tiny", n_dense_layers=4), "model.n_dense_layers=4 must be"),
    ],
)
def test_bad_config_is_refused_in_one_line(make, message):
    with pytest.raises(ConfigError) as err:
        make()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_router_or_expert_shape_not_matching_n_experts_is_refused():
    model = _tiny()
    ffn = model.layers[1].feed_forward
    ffn.router = nn.Linear(model.cfg.dim, 5, bias=False)
    with pytest.raises(ValueError, match=r"router\.weight has 5 experts in dim 0 but n_experts=6"):
        model.check_shapes()
    ffn.router = nn.Linear(model.cfg.dim, 6, bias=False)
    ffn.experts.w2 = nn.Parameter(torch.zeros(4, model.cfg.dim, model.cfg.moe_hidden))
    with pytest.raises(ValueError, match=r"experts\.w2 has 4 experts"):
        model.check_shapes()


def _train_moe(steps: int) -> tuple[list[float], torch.Tensor]:
    """moe_tiny under fully_shard (each block, then the root) with AdamW and the bias update:
    the losses (mean over ranks) and the last block's router bias."""
    torch.manual_seed(0)
    model = _tiny()
    model.check_shapes()  # before any collective
    shard_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = my_rows(_tokens())
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        balance_routers(model, model.cfg.bias_update_rate)
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses, model.layers[2].feed_forward.expert_bias.clone()


def test_moe_tiny_trains_under_fully_shard_at_1_and_3(dist_pool):
    (single, bias_1), *_ = dist_pool(1).run(_train_moe, 12)
    assert single[-1] < 0.8 * single[0]
    per_rank = dist_pool(3).run(_train_moe, 12)
    for losses, bias in per_rank:
        torch.testing.assert_close(bias, per_rank[0][1], rtol=0, atol=0)  # equal on all ranks
        assert max(abs(a - b) for a, b in zip(losses, single, strict=True)) < 1e-4
    torch.testing.assert_close(per_rank[0][1], bias_1, rtol=0, atol=0)
