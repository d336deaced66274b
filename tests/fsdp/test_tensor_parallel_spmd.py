"""fully_shard x tensor parallelism in torch 2.13's SPMD form at W=4: parameters that are
DTensors on the full mesh (``Replicate()`` on the data-parallel dims, ``Shard(d)`` or
``Replicate()`` on the TP dim), ``fully_shard(..., mesh=full_mesh, dp_mesh_dims=...)``, a model
that computes with full-mesh DTensors; against one process, against torch's FSDP2 with the
same ``dp_mesh_dims``, and the refusals."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

import raggedfsdp
from raggedfsdp.optim import AdamW
from raggedfsdp.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

DIM, HIDDEN, OUT, SEQ = 8, 16, 12, 4
ROWS = 8  # global batch rows: divisible by every data-parallel size tested
STEPS = 6
LR = 3e-3
# each parameter's placement on the TP dim: colwise weights and their bias Shard(0), rowwise
# Shard(1), the norm and the input projection replicated
TP_PLACEMENTS = {
    "inp": Replicate(),
    "norm": Replicate(),
    "w1": Shard(0),
    "b1": Shard(0),
    "w2": Shard(1),
    "head": Shard(0),
}
# (mesh shape, dim names, dp_mesh_dims): FSDP x TP, HSDP x TP, and two dp dims flattened
MESHES = {
    "2x2": ((2, 2), ("dp_shard", "tp"), DataParallelMeshDims(shard="dp_shard")),
    "hsdp-2x1x2": (
        (2, 1, 2),
        ("dp_replicate", "dp_shard", "tp"),
        DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate"),
    ),
    "flattened-2x1x2": (
        (2, 1, 2),
        ("dp_replicate", "dp_shard", "tp"),
        DataParallelMeshDims(shard=("dp_replicate", "dp_shard")),
    ),
}


class Block(nn.Module):
    """An RMS-normed MLP written for DTensors and plain tensors alike (no parallel styles:
    in the SPMD form the module computes with DTensors on the full mesh)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(DIM))
        self.w1 = nn.Parameter(torch.randn(HIDDEN, DIM) * DIM**-0.5)
        self.b1 = nn.Parameter(0.1 * torch.randn(HIDDEN))
        self.w2 = nn.Parameter(torch.randn(DIM, HIDDEN) * HIDDEN**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return x + F.silu(h @ self.w1.T + self.b1) @ self.w2.T


class Net(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Parameter(torch.randn(DIM, DIM) * DIM**-0.5)
        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Parameter(torch.randn(OUT, DIM) * DIM**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.inp.T
        for layer in self.layers:
            h = layer(h)
        return h @ self.head.T


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, SEQ, DIM, generator=gen), torch.randn(ROWS, SEQ, OUT, generator=gen)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean over the global batch (a replicated scalar under DTensors)."""
    loss = (model(x) - y).pow(2).mean()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def full_placements(mesh: DeviceMesh, tp: Placement) -> list[Placement]:
    return [tp if name == "tp" else Replicate() for name in mesh.mesh_dim_names]


def spmd_net(mesh: DeviceMesh, seed: int = 0) -> Net:
    """``make_net`` with every parameter a DTensor on the full mesh."""
    net = make_net(seed)
    for module in net.modules():
        for name, p in list(module._parameters.items()):
            placements = full_placements(mesh, TP_PLACEMENTS[name])
            setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return net


def _mesh(case: str) -> tuple[DeviceMesh, DataParallelMeshDims, int, int]:
    """(full mesh, dp_mesh_dims, this rank's dp index, dp size)."""
    shape, names, dims = MESHES[case]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp = [i for i, n in enumerate(names) if n != "tp"]
    index = 0
    for i in dp:
        index = index * shape[i] + mesh.get_local_rank(i)
    return mesh, dims, index, math.prod(shape[i] for i in dp)


def wrapped(case: str, wrap, divide_by: float | None = None) -> tuple[Net, DeviceMesh, int, int]:
    mesh, dims, index, size = _mesh(case)
    net = spmd_net(mesh)
    # FSDP2 wants the very mesh object the parameters are on, and DTensor's dispatch cache can
    # hand back an earlier, equal mesh (from a test before this one in the same rank)
    mesh = net.inp.device_mesh
    for layer in net.layers:
        wrap(layer, mesh=mesh, dp_mesh_dims=dims)
    wrap(net, mesh=mesh, dp_mesh_dims=dims)
    if divide_by is not None:
        for module in net.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(divide_by)
    return net, mesh, index, size


def _inputs(mesh: DeviceMesh, step: int, index: int, size: int) -> tuple[DTensor, DTensor]:
    """This dp rank's rows of the global batch as full-mesh DTensors: sharded over every dp
    dim (row-major, as the dp index), replicated over TP."""
    placements = [Replicate() if n == "tp" else Shard(0) for n in mesh.mesh_dim_names]
    per = ROWS // size
    x, y = (t[index * per : (index + 1) * per] for t in batch(step))
    return tuple(DTensor.from_local(t, mesh, placements, run_check=False) for t in (x, y))


def _train(net: Net, opt, mesh: DeviceMesh, index: int, size: int) -> tuple[list[float], dict]:
    losses, first_grads = [], {}
    for step in range(STEPS):
        loss = loss_of(net, *_inputs(mesh, step, index, size))
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.full_tensor() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first_grads


def _single() -> tuple[list[float], dict, dict, dict]:
    net = make_net()
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, first_grads = [], {}
    for step in range(STEPS):
        loss = loss_of(net, *batch(step))
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, initial, {n: p.detach() for n, p in net.named_parameters()}, first_grads


# ----------------------------------------------------------------------------- one process
def _ours(case: str) -> dict:
    # the loss is the global batch's mean, so the dp partial sums of the gradients are summed,
    # not averaged (as FSDP2 would need too)
    net, mesh, index, size = wrapped(case, raggedfsdp.fully_shard, divide_by=1.0)
    initial = {n: p.full_tensor() for n, p in net.named_parameters()}
    seen = {}

    def record(module, args):
        w = module.w1
        seen["w1"] = (type(w).__name__, tuple(w.placements), w.device_mesh == mesh)
        seen["norm"] = tuple(module.norm.placements)

    net.layers[0].register_forward_pre_hook(record)
    losses, grads = _train(net, AdamW(net.parameters(), lr=LR), mesh, index, size)
    return {
        "losses": losses,
        "grads": grads,
        "initial": initial,
        "final": {n: p.full_tensor() for n, p in net.named_parameters()},
        "types": {type(p).__name__ for p in net.parameters()},
        "shapes": {n: tuple(p.shape) for n, p in net.named_parameters()},
        "seen": seen,
    }


@pytest.mark.parametrize("case", list(MESHES))
def test_spmd_training_matches_one_process(dist_pool, case):
    expected, initial, final, grads = _single()
    for result in dist_pool(4).run(_ours, case):
        assert result["types"] == {"RaggedTensor"}
        for n, value in initial.items():
            assert result["shapes"][n] == tuple(value.shape), n
            assert torch.equal(result["initial"][n], value), n
            # reduced once over dp (a second reduction would scale them, which AdamW's losses
            # would hardly show)
            assert torch.allclose(result["grads"][n], grads[n], atol=1e-6), n
            assert torch.allclose(result["final"][n], final[n], atol=1e-5), n
        assert max(abs(a - b) for a, b in zip(result["losses"], expected, strict=True)) < 1e-5
        # the module computes with the parameters as DTensors on the full mesh
        names = MESHES[case][1]
        dp_replicated = (Replicate(),) * (len(names) - 1)
        assert result["seen"]["w1"] == ("DTensor", (*dp_replicated, Shard(0)), True)
        assert result["seen"]["norm"] == (*dp_replicated, Replicate())


# ----------------------------------------------------------------------------- FSDP2
def _fsdp2_vs_ours(case: str, bf16: bool) -> dict:
    """Losses and first gradients of FSDP2 and of ours with the same dp_mesh_dims, data, mixed
    precision and (FSDP2's default) gradient averaging over data parallel."""
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {}
    theirs_wrap = functools.partial(fsdp2_fully_shard, mp_policy=MixedPrecisionPolicy(**mp))
    theirs, mesh, index, size = wrapped(case, theirs_wrap)
    their_losses, their_grads = _train(
        theirs, torch.optim.AdamW(theirs.parameters(), lr=LR), mesh, index, size
    )
    ours_wrap = functools.partial(
        raggedfsdp.fully_shard, mp_policy=raggedfsdp.MixedPrecisionPolicy(**mp)
    )
    ours, mesh, index, size = wrapped(case, ours_wrap)
    our_losses, our_grads = _train(ours, AdamW(ours.parameters(), lr=LR), mesh, index, size)
    return {
        "losses": max(abs(a - b) for a, b in zip(our_losses, their_losses, strict=True)),
        "grads": max((our_grads[n] - g).abs().max().item() for n, g in their_grads.items()),
        "scale": their_grads["head"].norm().item(),
    }


@pytest.mark.parametrize(
    ("case", "bf16"), [("2x2", False), ("hsdp-2x1x2", False), ("2x2", True)], ids=str
)
def test_spmd_matches_fsdp2_with_the_same_dp_mesh_dims(dist_pool, case, bf16):
    for result in dist_pool(4).run(_fsdp2_vs_ours, case, bf16):
        assert result["scale"] > 1e-3
        assert result["grads"] < 1e-6, result
        assert result["losses"] < 1e-5, result


# ----------------------------------------------------------------------------- state
def _meta_init_and_state_dict() -> dict:
    """Built on the meta device in SPMD form, wrapped, materialized and initialised; then its
    full state dict, and that state dict loaded into a freshly wrapped copy."""
    mesh, dims, _, _ = _mesh("2x2")
    with torch.device("meta"):
        net = spmd_net(mesh)
    for layer in net.layers:
        raggedfsdp.fully_shard(layer, mesh=mesh, dp_mesh_dims=dims)
    raggedfsdp.fully_shard(net, mesh=mesh, dp_mesh_dims=dims)
    net.to_empty(device="cpu")
    torch.manual_seed(5)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.02)
    full = StateDictOptions(full_state_dict=True)
    state = get_model_state_dict(net, options=full)
    fresh, _, _, _ = wrapped("2x2", raggedfsdp.fully_shard)
    set_model_state_dict(fresh, state, options=full)
    return {
        "initialised": {n: p.full_tensor() for n, p in net.named_parameters()},
        "state": state,
        "loaded": {n: p.full_tensor() for n, p in fresh.named_parameters()},
    }


def test_meta_init_and_full_state_dicts_are_global(dist_pool):
    reference = make_net()
    torch.manual_seed(5)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for result in dist_pool(4).run(_meta_init_and_state_dict):
        for n, p in reference.named_parameters():
            assert torch.equal(result["initialised"][n], p.detach()), n
            assert torch.equal(result["state"][n], p.detach()), n
            assert torch.equal(result["loaded"][n], p.detach()), n


# ----------------------------------------------------------------------------- refusals
def _refusal(make, **kwargs) -> str:
    """The one-line error ``fully_shard`` raises for ``make() -> (module, mesh, dims)``, after
    checking that the module's parameters were left as they were."""
    module, mesh, dims = make()
    before = dict(module.named_parameters())
    try:
        raggedfsdp.fully_shard(module, mesh=mesh, dp_mesh_dims=dims, **kwargs)
    except (ValueError, TypeError, NotImplementedError) as error:
        after = dict(module.named_parameters())
        assert all(after[n] is p for n, p in before.items())
        assert not isinstance(module, raggedfsdp.FSDPModule)
        return str(error)
    raise AssertionError("fully_shard accepted it")


def _linear_with(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(4, 4, bias=False)
    linear.weight = nn.Parameter(weight)
    return linear


def _refusals() -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    w = torch.randn(4, 4)
    shard = DataParallelMeshDims(shard="dp_shard")
    good = _linear_with(distribute_tensor(w, mesh, [Replicate(), Shard(0)]))
    return {
        "bad name": _refusal(lambda: (good, mesh, DataParallelMeshDims(shard="dp"))),
        "named twice": _refusal(
            lambda: (good, mesh, DataParallelMeshDims(shard="dp_shard", replicate="dp_shard"))
        ),
        "not dims": _refusal(lambda: (good, mesh, "dp_shard")),
        "no mesh": _refusal(lambda: (good, None, shard)),
        "shard over dp": _refusal(
            lambda: (_linear_with(distribute_tensor(w, mesh, [Shard(0), Shard(1)])), mesh, shard)
        ),
        "two non-dp dims": _refusal(
            lambda: (
                _linear_with(distribute_tensor(w, mesh3, [Replicate(), Replicate(), Shard(0)])),
                mesh3,
                shard,
            )
        ),
        "plain": _refusal(lambda: (_linear_with(w.clone()), mesh, shard)),
        "tp mesh": _refusal(
            lambda: (_linear_with(distribute_tensor(w, mesh["tp"], [Shard(0)])), mesh, shard)
        ),
        "partial tp": _refusal(
            lambda: (
                _linear_with(DTensor.from_local(w, mesh, [Replicate(), Partial()])),
                mesh,
                shard,
            )
        ),
        "replicate only": _refusal(
            lambda: (good, mesh, DataParallelMeshDims(replicate="dp_shard"))
        ),
        "int reshard": _refusal(lambda: (good, mesh, shard), reshard_after_forward=2),
    }


def test_bad_input_is_refused_before_anything_changes(dist_pool):
    expected = {
        "bad name": ("dp_mesh_dims", "'dp' is not one of the mesh's dims", "name the"),
        "named twice": ("dp_mesh_dims", "named twice"),
        "not dims": ("dp_mesh_dims", "DataParallelMeshDims(shard='dp_shard')"),
        "no mesh": ("dp_mesh_dims", "mesh must be the full DeviceMesh", "mesh_dim_names"),
        "shard over dp": ("'weight'", "Replicate() on the data-parallel dim 'dp_shard'"),
        "two non-dp dims": ("dp_mesh_dims", "2 dims besides", "exactly one"),
        "plain": ("'weight'", "plain Parameter", "DTensor on the full mesh", "distribute_tensor"),
        "tp mesh": ("'weight'", "not on the mesh given to fully_shard", "distribute_tensor"),
        "partial tp": ("'weight'", "Partial", "Shard(dim) and Replicate()"),
        "replicate only": ("dp_mesh_dims", "replicate-only", "shard='dp_shard'"),
        "int reshard": ("reshard_after_forward=2", "SPMD form", "True or False"),
    }
    for messages in dist_pool(4).run(_refusals):
        for case, parts in expected.items():
            assert "\n" not in messages[case], case
            for part in parts:
                assert part in messages[case], (case, messages[case])


def test_the_one_d_form_points_at_dp_mesh_dims(dist_pool):
    for message in dist_pool(4).run(_full_mesh_without_dims):
        assert "\n" not in message
        assert "'weight'" in message and "dp_mesh_dims=DataParallelMeshDims" in message


def _full_mesh_without_dims() -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    linear = _linear_with(distribute_tensor(torch.randn(4, 4), mesh, [Replicate(), Shard(0)]))
    try:
        raggedfsdp.fully_shard(linear, mesh=mesh["dp_shard"])
    except ValueError as error:
        dist.barrier()
        return str(error)
    raise AssertionError("fully_shard accepted it")
