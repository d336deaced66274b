"""raggedfsdp.optim.AdamW8bit: bitwise torchao on one process, bitwise the same at W = 1..4
(FSDP and drop-in, uneven and empty shards, 1-D blocks and 32x32 tiles), bitsandbytes' accuracy
protocol against fp32 AdamW, a short training run, state size, DCP resharding, bad input."""

from __future__ import annotations

import pytest
import torch

from raggedfsdp.optim import AdamW8bit
from raggedfsdp.optim.quant import (
    BlockGrid,
    QuantMap,
    dequantize_,
    dynamic_map,
    nearest_codes,
    quantize_,
)
from raggedfsdp.sharding import RaggedShard, RaggedTensor
from tests.support.optim_helpers import (
    assert_resumes_bitwise,
    exact_grads,
    full_values,
    init_tensors,
    mode_params,
    rank_world,
    set_mode_grads,
    train_checkpointed,
)


@pytest.fixture(scope="module")
def quant_utils():
    """torchao's quantization helpers (the oracle); imported here, not at module level, so the
    worker ranks that import this module for their tasks do not load torchao."""
    return pytest.importorskip("torchao.optim.quant_utils")


# Quantized: whole blocks (emb), a partial last block and partial tiles (w: 7200 elements, 72
# rows = 2 tiles + 8, 100 cols = 3 tiles + 4), a 1-D tensor with a partial block (v). Full
# precision: small and bias (< 4096 elements).
SHAPES = {"emb": (40, 256), "w": (72, 100), "v": (5000,), "small": (17, 9), "bias": (33,)}
TILE = (32, 32)


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao's optimizers, run eagerly. torchao compiles its step with inductor, whose fusions
    round differently from eager (1-2 ulp on ~1% of the parameters, the same 8-bit codes) and
    take ~30 s to build here; its eager code path is the op-by-op reference."""
    optim = pytest.importorskip("torchao.optim")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    return optim


# ----------------------------------------------------------------------------- quantization
def test_dynamic_maps_equal_bitsandbytes_torchao(quant_utils):
    for signed in (True, False):
        theirs = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
        assert torch.equal(dynamic_map(signed), theirs)
        assert (theirs[1:] > theirs[:-1]).all()


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_equals_torchao_including_ties(quant_utils, signed):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(40, 256, generator=gen) * torch.rand(40, 256, generator=gen) ** 6
    qmap = QuantMap.get(signed, torch.device("cpu"))
    mids = (qmap.values[1:] + qmap.values[:-1]) / 2  # exact ties round up
    values[0, :255] = mids
    values[0, 255] = 1.0
    values[1] = 0.0  # an all-zero block: absmax floor
    values = values if signed else values.abs()
    flat = values.reshape(-1)
    scaled, scale = quant_utils.scale_tensor(flat, 256)
    expected = quant_utils.quantize_8bit_with_qmap(scaled, qmap.values)
    codes, absmax = torch.empty_like(flat, dtype=torch.uint8), torch.empty(40)
    grid = BlockGrid(1, flat.numel(), 1, 256)
    quantize_(flat, grid, codes, absmax, qmap)
    assert torch.equal(codes, expected) and torch.equal(absmax, scale)
    out = torch.empty_like(flat)
    dequantize_(out, grid, codes, absmax, qmap)
    assert torch.equal(out, quant_utils.dequant_with_qmap(expected, qmap.values, scale))


@pytest.mark.parametrize("signed", [True, False])
def test_nearest_code_equals_torchao_binary_search_on_every_bucket_edge(quant_utils, signed):
    """The table-driven search must agree with torchao's binary search on the values where it
    could go wrong: both ends of every 16-bit bucket, every map point and half-way point, and
    their fp32 neighbours."""
    qmap = QuantMap.get(signed, torch.device("cpu"))
    keys = torch.arange(1 << 16, dtype=torch.int64) << 16
    edges = torch.cat([keys, keys | 0xFFFF])
    edges = torch.where(edges >= 1 << 31, edges - (1 << 32), edges).to(torch.int32)
    mids = (qmap.values[1:] + qmap.values[:-1]) * 0.5
    points = torch.cat([edges.view(torch.float32), qmap.values, mids])
    up, down = torch.full_like(points, 2.0), torch.full_like(points, -2.0)
    values = torch.cat([points, torch.nextafter(points, up), torch.nextafter(points, down)])
    values = values[values.isfinite() & (values.abs() <= 1)]
    expected = quant_utils.quantize_8bit_with_qmap(values, qmap.values)
    assert torch.equal(nearest_codes(values, qmap).to(torch.uint8), expected)


def test_tiles_use_one_scale_per_tile():
    x = torch.arange(72 * 100, dtype=torch.float32).reshape(72, 100)
    grid = BlockGrid(72, 100, *TILE)
    codes, absmax = torch.empty(7200, dtype=torch.uint8), torch.empty(grid.num_blocks)
    quantize_(x.reshape(-1), grid, codes, absmax, QuantMap.get(False, torch.device("cpu")))
    expected = torch.tensor(
        [[x[r : r + 32, c : c + 32].max() for c in range(0, 100, 32)] for r in range(0, 72, 32)]
    )
    assert torch.equal(absmax.view(3, 4), expected)


# ----------------------------------------------------------------------------- vs torchao
def _torchao_shapes() -> dict[str, tuple[int, ...]]:
    # where torchao quantizes (a multiple of 256, >= 4096) or keeps full precision
    return {"emb": (40, 256), "flat": (4096,), "small": (17, 9), "bias": (33,)}


@pytest.mark.parametrize(
    "config", [{}, {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95), "eps": 1e-6}]
)
def test_single_process_equals_torchao_bitwise(eager_torchao, config):
    shapes = _torchao_shapes()
    init = init_tensors(shapes)
    mine = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    theirs = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = AdamW8bit(list(mine.values()), **config)
    ref = eager_torchao.AdamW8bit(list(theirs.values()), block_size=256, **config)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        for n in shapes:
            g = torch.randn(shapes[n], generator=gen)
            mine[n].grad, theirs[n].grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for n in shapes:
        assert torch.equal(mine[n], theirs[n]), n
    ours, ao = opt.state[mine["emb"]], ref.state[theirs["emb"]]
    for moment in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(ours[f"{moment}_codes"], ao[moment].codes)
        assert torch.equal(ours[f"{moment}_absmax"], ao[moment].scale)
    assert torch.equal(opt.state[mine["small"]]["exp_avg"], ref.state[theirs["small"]]["exp_avg"])


# ----------------------------------------------------------------------------- W invariance
def _train(mode: str, tile: tuple[int, int] | None, steps: int = 3) -> dict[str, torch.Tensor]:
    """Full parameters and states after ``steps`` steps; identical gradients on every rank."""
    world = rank_world()[1]
    params, gbuf = mode_params(init_tensors(SHAPES), AdamW8bit.shard_policy(tile=tile), mode)
    opt = AdamW8bit([(n, p) for n, p in params.items()], lr=0.01, amsgrad=True, tile=tile)
    for step in range(steps):
        grads = {n: g[0] for n, g in exact_grads(SHAPES, step, world, same=True).items()}
        set_mode_grads(params, grads, gbuf)
        opt.step()
    out = full_values(params)
    for i, n in enumerate(params):
        for key, value in opt.state_dict()["state"][i].items():
            full = value.full_tensor() if isinstance(value, RaggedTensor) else value
            out[f"{n}.{key}"] = full.clone()
    return out


@pytest.mark.parametrize("tile", [None, TILE], ids=["blocks", "tiles"])
@pytest.mark.parametrize("mode", ["fsdp", "drop-in"])
def test_results_are_bitwise_identical_at_every_world_size(pool, mode, tile):
    expected = _train("single", tile)
    for rank, result in enumerate(pool.run(_train, mode, tile)):
        assert result.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(result[key], value), (rank, key)


# ----------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("tile", [None, TILE], ids=["blocks", "tiles"])
def test_bitsandbytes_protocol_against_fp32_adamw(tile):
    """Per step, re-synced to the 8-bit result each time (bitsandbytes' test_optimizer8bit):
    dequantized states close to fp32 AdamW's, parameters within the mean errors."""
    gen = torch.Generator().manual_seed(0)
    p8 = torch.nn.Parameter(torch.randn(512, 1024, generator=gen) * 0.1)
    p32 = torch.nn.Parameter(p8.detach().clone())
    opt8, opt32 = AdamW8bit([p8], tile=tile), torch.optim.AdamW([p32])
    grid = BlockGrid(512, 1024, *tile) if tile else BlockGrid(1, p8.numel(), 1, 256)
    for _ in range(20):
        g = torch.randn(512, 1024, generator=gen) * 0.01
        p8.grad, p32.grad = g.clone(), g.clone()
        opt8.step()
        opt32.step()
        err = (p8 - p32).abs()
        assert err.mean() < 6e-5 and (err / (p32.abs() + 1e-9)).mean() < 6e-4
        state8, state32 = opt8.state[p8], opt32.state[p32]
        for moment, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            values = torch.empty(p8.numel())
            dequantize_(
                values,
                grid,
                state8[f"{moment}_codes"].view(-1),
                state8[f"{moment}_absmax"].view(-1),
                QuantMap.get(signed, torch.device("cpu")),
            )
            close = torch.isclose(values, state32[moment].view(-1), atol=3e-3, rtol=1e-3)
            assert (~close).sum() < 20, moment
            state32[moment].copy_(values.view(512, 1024))
        with torch.no_grad():
            p32.copy_(p8)


@pytest.mark.slow
def test_short_training_run_loss_within_2_percent_of_fp32():
    """Online classification with label noise (fresh batches, so the loss plateaus at the noise
    level instead of memorising): the 8-bit run's final loss matches fp32 AdamW's."""

    def run(make_opt) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU()
        )
        model.append(torch.nn.Linear(128, 8))
        gen = torch.Generator().manual_seed(1)
        teacher = torch.randn(32, 8, generator=gen)
        opt = make_opt(model.parameters())
        losses = []
        for _ in range(100):
            x = torch.randn(256, 32, generator=gen)
            y = (x @ teacher + 2 * torch.randn(256, 8, generator=gen)).argmax(1)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < 0.5 * losses[0]  # it did learn
        return sum(losses[-20:]) / 20

    fp32 = run(lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    eight = run(lambda ps: AdamW8bit(ps, lr=3e-3))
    assert abs(eight - fp32) / fp32 < 0.02, (eight, fp32)


# ----------------------------------------------------------------------------- memory
def _state_bytes(tile):
    params = {n: torch.nn.Parameter(t) for n, t in init_tensors(SHAPES).items()}
    opt = AdamW8bit([(n, p) for n, p in params.items()], tile=tile)
    opt.init_state()  # single process: state is otherwise created at the first step, as in torch
    quantized = opt.state_bytes()
    steps = 4 * len({id(s["step"]) for s in opt.state.values()})
    codes = sum(unwrap_len(opt.state[params[n]]["exp_avg_codes"]) for n in ("emb", "w", "v"))
    scales = sum(unwrap_len(opt.state[params[n]]["exp_avg_absmax"]) for n in ("emb", "w", "v"))
    fp32 = sum(unwrap_len(opt.state[params[n]]["exp_avg"]) for n in ("small", "bias"))
    return quantized.state_bytes - steps, codes, scales, fp32


def unwrap_len(t: torch.Tensor) -> int:
    return t.local.numel() if isinstance(t, RaggedTensor) else t.numel()


@pytest.mark.parametrize("tile", [None, TILE], ids=["blocks", "tiles"])
def test_state_is_about_2_bytes_per_element_over_w(pool, tile):
    results = pool.run(_state_bytes, tile)
    quantized = sum(t.numel() for n, t in init_tensors(SHAPES).items() if n in ("emb", "w", "v"))
    assert sum(codes for _, codes, _, _ in results) == quantized
    for state, codes, scales, fp32 in results:
        # two uint8 codes + two fp32 absmax per block, and fp32 moments for the small tensors
        assert state == 2 * codes + 2 * 4 * scales + 2 * 4 * fp32
        assert scales * (TILE[0] * TILE[1] if tile else 256) >= codes
        assert codes <= quantized / pool.world_size + (32 * 256 if tile else 256) * 3


# ----------------------------------------------------------------------------- checkpoints
def _dcp(path: str, mode: str, tile, save: bool) -> dict[str, torch.Tensor]:
    """Save after 2 steps then run 2 more (save=True), or load and run the last 2."""
    init = init_tensors(SHAPES, seed=0 if save else 3)
    params, gbuf = mode_params(init, AdamW8bit.shard_policy(tile=tile), mode)
    opt = AdamW8bit([(n, p) for n, p in params.items()], lr=0.01, tile=tile)
    return train_checkpointed(opt, params, gbuf, SHAPES, path, save, steps=4, at=2)


@pytest.mark.parametrize(("mode", "tile"), [("fsdp", TILE), ("drop-in", None)])
def test_dcp_save_at_4_ranks_resumes_bitwise_at_3(dist_pool, tmp_path, mode, tile):
    assert_resumes_bitwise(dist_pool, _dcp, str(tmp_path / "ckpt"), mode, tile, names=SHAPES)


def test_state_dict_round_trip_single_process():
    init = init_tensors(SHAPES)
    a = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    b = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt_a, opt_b = AdamW8bit(list(a.values())), AdamW8bit(list(b.values()))
    for step in range(4):
        grads = {n: g[0] for n, g in exact_grads(SHAPES, step, 1).items()}
        for n in SHAPES:
            a[n].grad = grads[n].clone()
        opt_a.step()
        if step == 1:
            saved = opt_a.state_dict()
            opt_b.load_state_dict(
                {
                    "state": {
                        i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()
                    },
                    "param_groups": saved["param_groups"],
                }
            )
            with torch.no_grad():
                for n in SHAPES:
                    b[n].copy_(a[n])
        if step > 1:
            for n in SHAPES:
                b[n].grad = grads[n].clone()
            opt_b.step()
    assert all(torch.equal(a[n], b[n]) for n in SHAPES)


# ----------------------------------------------------------------------------- bad input
def test_block_cutting_shard_is_rejected_with_the_fix():
    spec = RaggedShard.even((40, 256), 3, 1, "emb")  # element-wise: cuts 256-element blocks
    p = torch.nn.Parameter(RaggedTensor(torch.zeros(spec.length(1)), spec, 1))
    with pytest.raises(ValueError, match=r"'emb' .* cuts a block of 256 elements.*shard_policy"):
        AdamW8bit([("emb", p)])
    rows = RaggedShard.row_wise((64, 64), 3, rows=16, name="w")  # 16-row units cut 32x32 tiles
    q = torch.nn.Parameter(RaggedTensor(torch.zeros(rows.length(0)), rows, 0))
    with pytest.raises(ValueError, match=r"'w' .* cuts a \(32, 32\) tile slab"):
        AdamW8bit([("w", q)], tile=TILE)
    with pytest.raises(ValueError, match="'t' is not contiguous"):
        AdamW8bit([("t", torch.nn.Parameter(torch.zeros(128, 64).t()))])
    small = torch.nn.Parameter(torch.ones(8, 6).t())  # full-precision state: any layout works
    opt = AdamW8bit([small])
    small.grad = torch.ones(6, 8)
    opt.step()
    assert small.lt(1).all()
