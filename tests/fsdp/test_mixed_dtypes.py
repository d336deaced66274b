"""Several dtypes in one ``fully_shard`` call (issue 31, item 4): fp32 and bf16 weights, both
trainable, beside a frozen int64 permutation and a frozen bool mask. Each dtype is planned into
flat buffers of its own (``raggedfsdp.fsdp.dtype_groups``), so a mixed call must train bitwise as
the same model with every dtype wrapped by a ``fully_shard`` call of its own, and as one process
at W=1 (within rounding of the averaged gradients above that)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

import raggedfsdp
import raggedfsdp.fsdp.param_group as param_group_module
from raggedfsdp import MixedPrecisionPolicy, fully_shard
from raggedfsdp.fsdp.dtype_groups import DtypeGroups
from raggedfsdp.optim import AdamW
from raggedfsdp.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from tests.support.fsdp_training import full_params, my_rows

DIM, ROWS = 6, 12
FROZEN = ("index", "keep")  # the int64 and bool parameters' names


class Permute(nn.Module):
    """A fixed permutation of the features, held as a frozen int64 parameter."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.index = nn.Parameter(torch.randperm(n), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[..., self.index]


class Keep(nn.Module):
    """A fixed feature mask, held as a frozen bool parameter."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.keep = nn.Parameter(torch.rand(n) > 0.3, requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.keep


class Scale(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.gain = nn.Parameter((1 + 0.1 * torch.randn(n)).to(torch.bfloat16))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.gain.to(h.dtype)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)  # fp32
        self.permute = Permute(2 * DIM)  # int64, frozen
        self.mask = Keep(2 * DIM)  # bool, frozen
        self.down = nn.Linear(2 * DIM, DIM, dtype=torch.bfloat16)  # bf16, trainable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mask(self.permute(torch.tanh(self.up(x))))
        return x + self.down(h.to(self.down.weight.dtype)).to(x.dtype)


class MixedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)  # fp32
        self.scale = Scale(DIM)  # bf16: the root is mixed too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.scale(self.head(x))


def make(seed: int = 0, wrap: str | None = "mixed", **kwargs) -> MixedNet:
    """The model, wrapped: ``mixed`` each block, then the root (a call per block holding four
    dtypes); ``separate`` each dtype's modules in calls of their own first."""
    torch.manual_seed(seed)
    model = MixedNet()
    if wrap == "separate":
        for block in model.layers:
            for part in (block.up, block.permute, block.mask, block.down):
                fully_shard(part, **kwargs)
        fully_shard(model.scale, **kwargs)
    if wrap is not None:
        for block in model.layers:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step % 2)
    return torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, DIM, generator=gen)


def loss_of(model: nn.Module, step: int, sharded: bool = True) -> torch.Tensor:
    x, y = data(step)
    if sharded:
        x, y = my_rows(x), my_rows(y)
    x = x.to(model.head.weight.dtype)  # (float64 once cast)
    return (model(x).float() - y).square().mean()


def run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0, **how) -> list:
    """``steps`` optimizer steps; ``how``: ``sharded`` (rows per rank), ``clip`` (the norm
    clipped to it with raggedfsdp's ``clip_grad_norm_``), ``accumulate`` (a first micro-batch
    without gradient sync each step)."""
    sharded, norms = how.get("sharded", True), []
    for step in range(start, start + steps):
        if how.get("accumulate"):
            model.set_requires_gradient_sync(False)
            loss_of(model, step + 1, sharded).backward()
            model.set_requires_gradient_sync(True)
        loss_of(model, step, sharded).backward()
        if how.get("clip") is not None:
            norms.append(raggedfsdp.clip_grad_norm_(model.parameters(), how["clip"]).item())
        opt.step()
        opt.zero_grad()
    return norms


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name: ours (RaggedTensor), FSDP2's (DTensor) or plain."""
    wrapped = isinstance(model, raggedfsdp.FSDPModule) or hasattr(
        next(model.parameters()), "placements"
    )
    full = full_params(model) if wrapped else dict(model.named_parameters())
    return {n: t.detach().clone() for n, t in full.items()}


def assert_same(got: dict, want: dict, why: str = "") -> None:
    assert got.keys() == want.keys()
    for n, value in want.items():
        assert got[n].dtype == value.dtype and torch.equal(got[n], value), (why, n)


# ----------------------------------------------------------------------------- training
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _train(wrap: str, mp: bool, steps: int = 3, **how) -> dict:
    """``how`` as ``run``'s, and ``reshard`` (``reshard_after_forward``), ``offload`` (CPU
    offload), ``hsdp`` (a 2 x 2 mesh) and ``optimizer`` (``"ours"``: raggedfsdp's AdamW;
    torch's by default)."""
    kwargs = {"mp_policy": MP} if mp else {}
    if how.pop("offload", False):
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if how.pop("hsdp", False):
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make(wrap=wrap, reshard_after_forward=how.pop("reshard", None), **kwargs)
    frozen_before = {n: t for n, t in params_of(model).items() if n.endswith(FROZEN)}
    adamw = AdamW if how.pop("optimizer", "torch") == "ours" else torch.optim.AdamW
    opt = adamw(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = run(model, opt, steps, **how)
    group = model.layers[0]._fsdp_state().group
    return {
        "params": params_of(model),
        "norms": norms,
        "frozen_before": frozen_before,
        "parts": [p.name for p in group.parts] if isinstance(group, DtypeGroups) else None,
    }


def _one_process(steps: int = 3) -> dict[str, torch.Tensor]:
    model = make(wrap=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    run(model, opt, steps, sharded=False)
    return params_of(model)


@pytest.mark.parametrize("mp", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_mixed_group_trains_as_separate_calls(dist_pool, world, mp):
    """Bitwise the model with each dtype in a call of its own; the int64 and bool parameters
    are gathered (the forward reads them) and never change; without mixed precision within
    the bf16 layers' rounding of one process (bitwise at W=1)."""
    pool = dist_pool(world)
    separate = pool.run(_train, "separate", mp)[0]
    assert separate["parts"] is None
    for result in pool.run(_train, "mixed", mp):
        assert result["parts"] == [
            f"layers.0 [{d}]" for d in ("float32", "int64", "bool", "bfloat16")
        ]
        assert_same(result["params"], separate["params"])
        for n, value in result["frozen_before"].items():
            assert torch.equal(result["params"][n], value), n
    if not mp:
        reference = _one_process()
        for n, value in reference.items():
            got = separate["params"][n]
            if world == 1:
                assert torch.equal(got, value), n
            else:
                # the bf16 layers' activations round differently on a rank's rows: measured
                # up to 2 bf16 ulps (2e-3) and 5e-4 in fp32, a step's update being 1e-2
                tol = 4e-3 if value.dtype == torch.bfloat16 else 1e-3
                assert torch.allclose(got.float(), value.float(), atol=tol, rtol=0), n


@pytest.mark.parametrize(
    "how",
    [
        {"reshard": False, "clip": 0.05},
        {"accumulate": True},
        pytest.param({"reshard": 2}, marks=pytest.mark.slow),
        pytest.param({"hsdp": True}, marks=pytest.mark.slow),
    ],
    ids=["reshard-false-clip", "accumulate", "reshard-int", "hsdp"],
)
def test_controls_on_a_mixed_group(dist_pool, how):
    """``reshard_after_forward`` (False, an int), ``clip_grad_norm_``, accumulation without
    sync and HSDP: bitwise the separate calls, under mixed precision."""
    world = 4 if how.get("reshard") == 2 or how.get("hsdp") else 2
    pool = dist_pool(world)
    separate = pool.run(_train, "separate", True, 2, **how)[0]
    for result in pool.run(_train, "mixed", True, 2, **how):
        assert_same(result["params"], separate["params"])
        assert result["norms"] == separate["norms"]


def _collectives_per_step() -> dict[str, Counter]:
    """Collectives of one training step of a mixed block, by kind and part dtype."""
    model = make()
    run(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 1)  # warm: order recorded
    block = model.layers[1]._fsdp_state().group
    counts = {"all_gather_flat": Counter(), "reduce_scatter_flat": Counter()}
    originals = {name: getattr(param_group_module, name) for name in counts}

    def counted(name):
        def call(out, inp, *args, **kwargs):
            for part in block.parts:  # a gather's input: the part's segment (no mixed
                # precision); a reduce-scatter's: its full gradient buffer
                if inp is part.master.shard or inp is part.grads.full:
                    counts[name][str(part.orig_dtype).removeprefix("torch.")] += 1
            return originals[name](out, inp, *args, **kwargs)

        return call

    for name in counts:
        setattr(param_group_module, name, counted(name))
    try:
        run(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 1, start=1)
    finally:
        for name, fn in originals.items():
            setattr(param_group_module, name, fn)
    return counts


def test_frozen_parts_are_gathered_never_reduced(dist_pool):
    """Per step each part is gathered for forward and again for backward; only the fp32 and
    bf16 parts, which have trainable parameters, are reduce-scattered."""
    for counts in dist_pool(2).run(_collectives_per_step):
        assert counts["all_gather_flat"] == {
            "float32": 2,
            "int64": 2,
            "bool": 2,
            "bfloat16": 2,
        }
        assert counts["reduce_scatter_flat"] == {"float32": 1, "bfloat16": 1}


@pytest.mark.parametrize(
    "how", [{"optimizer": "ours"}, {"offload": True}], ids=["adamw", "offload"]
)
@pytest.mark.parametrize("world", [2, 3])
def test_our_adamw_and_cpu_offload_on_a_mixed_group(dist_pool, world, how):
    """raggedfsdp's AdamW (its fp32 and bf16 runs, the frozen int64 and bool parameters in its
    param list) is bitwise torch's per parameter; CPU offload trains bitwise as without it."""
    pool = dist_pool(world)
    control = pool.run(_train, "mixed", True)[0]
    for result in pool.run(_train, "mixed", True, **how):
        assert_same(result["params"], control["params"])


# ----------------------------------------------------------------------------- casting
def _cast(after: bool) -> dict:
    """Two steps of the model cast to float64 before or after wrapping (the float parameters
    only, as ``nn.Module.to(dtype)`` casts them), then ``.half()`` after wrapping."""
    model = make(wrap=None).double() if not after else make()
    if not after:
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    else:
        model.to(torch.float64)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run(model, opt, 2)
    trained = params_of(model)
    model.half()
    return {
        "dtypes": dtypes,
        "params": trained,
        "half": {n: p.dtype for n, p in model.named_parameters()},
    }


def test_to_float64_after_wrapping_casts_the_float_parts(dist_pool):
    """As casting before wrapping: the fp32 and bf16 parts become float64 (two float64 parts
    then, where casting first makes one), the int64 and bool ones stay; training is bitwise
    the same (at W=2, where the two layouts' sums are the same sums)."""
    pool = dist_pool(2)
    before = pool.run(_cast, False)[0]
    for result in pool.run(_cast, True):
        assert result["dtypes"] == before["dtypes"]
        assert {result["dtypes"][n] for n in result["dtypes"] if n.endswith("index")} == {
            torch.int64
        }
        assert {result["dtypes"][n] for n in result["dtypes"] if n.endswith("keep")} == {torch.bool}
        assert_same(result["params"], before["params"])
        floats = {n: d for n, d in result["half"].items() if not n.endswith(FROZEN)}
        assert set(floats.values()) == {torch.float16}
        assert result["half"]["layers.0.permute.index"] == torch.int64


# ----------------------------------------------------------------------------- state dicts
def _state_dict_round_trips() -> dict:
    """The sharded state dict loads into a model built from another seed; the full one (raggedfsdp's
    ``get_model_state_dict``) is the unwrapped model's, and loads back."""
    model = make()
    run(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 1)
    trained = params_of(model)
    other = make(seed=1)
    other.load_state_dict(model.state_dict())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    fresh = make(seed=2)
    set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True))
    plain = make(seed=3, wrap=None)
    plain.load_state_dict(full)  # the full tensors fit the unwrapped model
    return {
        "trained": trained,
        "sharded_loaded": params_of(other),
        "full": {n: t.clone() for n, t in full.items()},
        "full_loaded": params_of(fresh),
        "plain": params_of(plain),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_state_dicts_round_trip(dist_pool, world):
    for result in dist_pool(world).run(_state_dict_round_trips):
        for key in ("sharded_loaded", "full", "full_loaded", "plain"):
            assert_same(result[key], result["trained"], key)


def _dcp(path: str, save: bool) -> dict:
    """Save after two steps (model and AdamW state) or load into a model of another seed; the
    full parameters and optimizer state either way."""
    model = make(seed=0 if save else 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if save:
        run(model, opt, 2)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if save:
        dcp.save(state, checkpoint_id=path)
    else:
        run(model, opt, 1)  # (some optimizer state to overwrite)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    options = StateDictOptions(full_state_dict=True)
    optim = get_optimizer_state_dict(model, opt, options=options)["state"]
    return {
        "params": params_of(model),
        "optim": {f"{n}.{k}": v.clone() for n, s in optim.items() for k, v in s.items()},
    }


def test_dcp_saved_at_2_loads_at_3(dist_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = dist_pool(2).run(_dcp, path, True)[0]
    assert any(k.endswith("exp_avg") for k in saved["optim"])
    for result in dist_pool(3).run(_dcp, path, False):
        assert_same(result["params"], saved["params"], "params")
        assert_same(result["optim"], saved["optim"], "optimizer state")


# ----------------------------------------------------------------------------- FSDP2
def _vs_fsdp2(wrap) -> dict[str, torch.Tensor]:
    """FSDP2 takes several dtypes in a group as long as its trainable parameters share one
    (it asserts that): the bf16 layers frozen, three steps."""
    torch.manual_seed(0)
    model = MixedNet()
    for p in model.parameters():
        if p.dtype == torch.bfloat16:
            p.requires_grad_(False)
    for block in model.layers:
        wrap(block)
    wrap(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    run(model, opt, 3)
    return params_of(model)


def test_same_as_fsdp2_where_fsdp2_takes_the_group(dist_pool):
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    pool = dist_pool(2)
    fsdp2 = pool.run(_vs_fsdp2, fsdp2_fully_shard)[0]
    for result in pool.run(_vs_fsdp2, fully_shard):
        assert_same(result, fsdp2)


# ----------------------------------------------------------------------------- errors
def _errors() -> dict[str, str]:
    out = {}
    model = make(wrap=None)
    block = model.layers[0]
    block.down.to("meta")
    original = block.up.weight
    with pytest.raises(ValueError) as devices:
        fully_shard(block)
    out["devices"] = str(devices.value)
    out["untouched"] = block.up.weight is original and type(block).__name__ == "Block"
    # ranks that disagree on a parameter's dtype are told at the first forward, before any
    # collective of the groups
    model = make(wrap=None)
    if dist.get_rank() == 1:
        model.layers[1].down.float()
    for b in model.layers:
        fully_shard(b)
    fully_shard(model)
    with pytest.raises(RuntimeError) as disagree:
        loss_of(model, 0)
    out["disagree"] = str(disagree.value)
    model = make()
    with pytest.raises(TypeError) as to_int:
        model._apply(lambda t: t.to(torch.int32))
    out["to_int"] = str(to_int.value)
    out["kept"] = {p.dtype for p in model.parameters()} == {
        torch.float32,
        torch.bfloat16,
        torch.int64,
        torch.bool,
    }
    return out


def test_errors(dist_pool):
    for out in dist_pool(2).run(_errors):
        assert "'down.weight' is on meta" in out["devices"] and "one device" in out["devices"]
        assert out["untouched"]
        assert "layers.1" in out["disagree"] and "differs across ranks" in out["disagree"]
        assert "cannot become torch.int32" in out["to_int"] and "\n" not in out["to_int"]
        assert out["kept"]
