"""Expert parallelism (EP) for the MoE recipe: experts split across an ``ep`` mesh dim, tokens
dispatched to them by all-to-all, FSDP over the data-parallel ranks EP leaves.

The mesh is torchtitan's (``ParallelDims`` without CP and TP): a 2-D ``("dp_shard_mod_ep",
"ep")`` device mesh; the dense parameters shard over both dims flattened (``"dp_shard"``, every
rank), the experts over ``"dp_shard_mod_ep"`` alone (``ep_meshes``).

* ``distribute_experts`` makes each MoE block's fused experts ``experts.w1`` / ``w3`` ``(E, d_ff,
  d)`` and ``w2`` ``(E, d, d_ff)`` ``Shard(0)`` DTensors over ``ep``: ``E / ep`` whole experts per
  EP rank. ``fully_shard`` takes them as tensor-parallel parameters on another mesh dim
  (``raggedfsdp/fsdp/tensor_parallel.py``): each EP rank's local experts are planned and sharded
  over ``dp_shard_mod_ep``, and their gradients are reduce-scattered there alone.
* ``shard_ep_block`` wraps a block as torchtitan's ``apply_fsdp`` did: ``fully_shard(experts,
  mesh=mesh["dp_shard_mod_ep"])`` with a gradient divide factor of the whole dp degree (an EP
  rank's expert gradient already sums the tokens of its ``ep`` group), then ``fully_shard(block,
  mesh=<dp_shard>)`` for the rest.
* ``dispatch`` is the MoE layer's routed compute under EP (``MoEFeedForward.forward`` calls it
  when ``experts.ep_mesh`` is set): the rows, sorted by global expert, go to the EP rank holding
  their expert by ``all_to_all_single`` with uneven splits (the per-expert counts exchanged
  first), are regrouped by local expert, go through the local experts (the recipe's own
  ``Experts.forward``: the loop on CPU, ``grouped_mm`` on CUDA) and come back by the inverse
  all-to-all. Both all-to-alls are differentiable (``_AllToAll``: its backward is the inverse
  exchange), so the layer's output and gradients are the non-EP layer's.

The router and its load-balancing bias are dense: the router weight is sharded over every rank
like the other dense parameters, and ``balance_routers`` all-reduces the token counts over the
world before moving the bias, so every rank keeps the same bias under EP too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["check_ep", "dispatch", "distribute_experts", "ep_meshes", "shard_ep_block"]

EXPERT_PARAMS = ("w1", "w2", "w3")


def check_ep(n_experts: int, ep: int) -> None:
    """Refuse, in one line and before any collective, an ``ep`` that does not split the
    experts evenly."""
    if ep < 1 or n_experts % ep:
        raise ValueError(
            f"expert parallelism: ep={ep} does not divide n_experts={n_experts}; each EP rank "
            f"holds n_experts / ep whole experts: pick ep from the divisors of {n_experts}"
        )


def ep_meshes(
    ep: int, device_type: str = "cpu", world: int | None = None
) -> tuple[DeviceMesh, DeviceMesh]:
    """``(mesh, dp_mesh)``: the 2-D ``("dp_shard_mod_ep", "ep")`` mesh and its two dims
    flattened into ``"dp_shard"`` (every rank, rank ``i * ep + j`` at (i, j)), the dense
    parameters' fully_shard mesh and the batch's data-parallel split."""
    world = dist.get_world_size() if world is None else world
    if ep < 1 or world % ep:
        raise ValueError(
            f"expert parallelism: ep={ep} does not divide the world size {world}; the mesh is "
            f"(dp_shard_mod_ep=world/ep, ep): launch a multiple of {ep} processes"
        )
    mesh = init_device_mesh(
        device_type, (world // ep, ep), mesh_dim_names=("dp_shard_mod_ep", "ep")
    )
    return mesh, mesh._flatten("dp_shard")


def distribute_experts(module: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Make the fused experts of every MoE block in ``module`` ``Shard(0)`` DTensors over the
    1-D ``ep_mesh`` (each EP rank keeps its ``E / ep`` experts of the tensor it has, no
    communication: the weights must already be the same on every rank, as the recipe's seeded
    initialisation makes them, or on the meta device). Returns the number of blocks."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"distribute_experts: expected the 1-D 'ep' mesh, got {ep_mesh}")
    ep, index = ep_mesh.size(), ep_mesh.get_local_rank()
    blocks = {n: m for n, m in module.named_modules() if _is_moe(m)}
    for block, moe in blocks.items():  # every check before anything changes
        check_ep(moe.n_experts, ep)
        for name in EXPERT_PARAMS:
            p = getattr(moe.experts, name)
            where = f"{block}.experts.{name}".lstrip(".")
            if isinstance(p, DTensor):
                raise ValueError(f"{where} is already a DTensor ({p.placements}): distribute once")
            if p.dim() != 3 or p.shape[0] != moe.n_experts:
                raise ValueError(
                    f"{where} has shape {tuple(p.shape)}, not a fused ({moe.n_experts}, m, n) "
                    "expert tensor: expert parallelism splits the experts' dim 0"
                )
    for moe in blocks.values():
        experts = moe.experts
        for name in EXPERT_PARAMS:
            p = getattr(experts, name)
            local = p.detach().chunk(ep)[index].clone()
            d = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(d, requires_grad=p.requires_grad))
        experts.ep_mesh = ep_mesh
    return len(blocks)


def shard_ep_block(block: nn.Module, mesh: DeviceMesh, dp_mesh: DeviceMesh, **kwargs) -> None:
    """``fully_shard`` one block whose experts ``distribute_experts`` split over ``mesh["ep"]``:
    the experts over ``mesh["dp_shard_mod_ep"]`` (gradients divided by the whole dp degree:
    each EP rank's already sums its ``ep`` group's tokens), then the block over ``dp_mesh``.
    ``kwargs`` go to both calls."""
    import raggedfsdp

    for moe in (m for m in block.modules() if _is_moe(m)):
        raggedfsdp.fully_shard(moe.experts, mesh=mesh["dp_shard_mod_ep"], **kwargs)
        moe.experts.set_gradient_divide_factor(dp_mesh.size())
    raggedfsdp.fully_shard(block, mesh=dp_mesh, **kwargs)


def _is_moe(module: nn.Module) -> bool:
    """Whether ``module`` is a MoE block (``recipes.llama.moe.MoEFeedForward``: a router and
    fused ``experts``), told by its parts: that module imports this one, not the reverse."""
    return hasattr(module, "experts") and hasattr(module, "n_experts") and hasattr(module, "route")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def dispatch(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The routed experts' outputs for ``rows`` (sorted by global expert, ``counts[e]`` rows
    for expert ``e``), each computed on the EP rank holding its expert; the same rows in the
    same order as ``experts(rows, counts)`` on one process."""
    mesh: DeviceMesh = experts.ep_mesh
    group, ep = mesh.get_group(), mesh.size()
    n_local = counts.numel() // ep
    # counts first: recv[s, e] = rows EP rank s sends to this rank's local expert e
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts.contiguous(), group=group)
    recv = recv.view(ep, n_local)
    send_splits = counts.view(ep, n_local).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    received = _AllToAll.apply(rows, recv_splits, send_splits, group)
    # arrived by (source rank, local expert): regroup by local expert, stable in the source
    expert_of_row = torch.arange(n_local, device=rows.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(recv.flatten().to(rows.device))
    order = expert_of_row.argsort(stable=True)
    out = experts(received[order], recv.sum(0))
    out = out[order.argsort()]
    return _AllToAll.apply(out, send_splits, recv_splits, group)
