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

* HSDP x EP: ``ep_meshes(ep, replicate=R)`` puts ``dp_replicate`` first; the experts shard
  over ``expert_dp_mesh`` (``(dp_replicate, dp_shard_mod_ep)``), the dense weights over the
  2-D ``(dp_replicate, dp_shard)``.
* FSDP2 x EP, for parity: ``shard_ep_block_fsdp2`` is the same wrapping with torch's
  ``fully_shard`` (torchtitan's), ``fsdp2_clip_grad_norm_`` the clipping torch's
  ``clip_grad_norm_`` refuses over DTensors on two meshes.
* ``take_all_to_all_bytes`` reads what the dispatch's all-to-alls sent (the recipe's
  ``all_to_all_mib``).

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

from raggedfsdp.sharding.ep_split import check_ep, ep_complement, expert_range

__all__ = [
    "check_ep",
    "dispatch",
    "distribute_experts",
    "ep_meshes",
    "expert_dp_mesh",
    "fsdp2_clip_grad_norm_",
    "shard_ep_block",
    "shard_ep_block_fsdp2",
    "take_all_to_all_bytes",
]

EXPERT_PARAMS = ("w1", "w2", "w3")


def ep_meshes(
    ep: int, device_type: str = "cpu", world: int | None = None, replicate: int = 1, tp: int = 1
) -> tuple[DeviceMesh, DeviceMesh]:
    """``(mesh, dp_mesh)``: the ``("dp_shard_mod_ep", "ep")`` mesh and its two dims flattened
    into ``"dp_shard"`` (every rank, rank ``i * ep + j`` at (i, j)), the dense parameters'
    fully_shard mesh and the batch's data-parallel split. With ``replicate`` above 1 (HSDP x
    EP) a ``"dp_replicate"`` dim comes first: ``mesh`` is ``(dp_replicate, dp_shard_mod_ep,
    ep)`` and ``dp_mesh`` the 2-D ``(dp_replicate, dp_shard)`` HSDP mesh; the experts shard
    over ``expert_dp_mesh(mesh)``, ``(dp_replicate, dp_shard_mod_ep)``. With ``tp`` above 1
    (EP x TP, torchtitan's layout) a ``"tp"`` dim comes last, so that a TP group is
    neighbouring ranks: ``dp_shard`` (every rank of one TP coordinate) is what EP splits, and
    the experts are DTensors on ``mesh["ep", "tp"]``."""
    world = dist.get_world_size() if world is None else world
    if ep < 1 or replicate < 1 or tp < 1 or world % (ep * replicate * tp):
        rep = f" x dp_replicate={replicate}" if replicate != 1 else ""
        tps = f" x tp={tp}" if tp != 1 else ""
        raise ValueError(
            f"expert parallelism: ep={ep}{rep}{tps} does not divide the world size {world}; the "
            f"mesh is ({'dp_replicate, ' if rep else ''}dp_shard_mod_ep, ep{', tp' if tps else ''})"
            f": launch a multiple of {ep * max(replicate, 1) * max(tp, 1)} processes"
        )
    shard = world // (replicate * tp)
    shape, names = (ep_complement(shard, ep), ep), ("dp_shard_mod_ep", "ep")
    if replicate == 1 and tp == 1:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        return mesh, mesh._flatten("dp_shard")
    # the data-parallel mesh first, then dp_shard unflattened: slicing dp_shard out of a mesh
    # after flattening would be the slice of a flattened dim torch deprecates
    dims = [("dp_replicate", replicate)] if replicate > 1 else []
    dims += [("dp_shard", shard)] + ([("tp", tp)] if tp > 1 else [])
    base = init_device_mesh(
        device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims)
    )
    dp = base["dp_replicate", "dp_shard"] if replicate > 1 else base["dp_shard"]
    return base._unflatten("dp_shard", shape, names), dp


def expert_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The experts' data-parallel mesh in ``ep_meshes``' ``mesh``: ``dp_shard_mod_ep``, with
    ``dp_replicate`` before it under HSDP x EP (a 2-D HSDP mesh: reduce-scatter over the
    EP-complement shard group, all-reduce over the replicas)."""
    if "dp_replicate" in (mesh.mesh_dim_names or ()):
        return mesh["dp_replicate", "dp_shard_mod_ep"]
    return mesh["dp_shard_mod_ep"]


def distribute_experts(module: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Make the fused experts of every MoE block in ``module`` ``Shard(0)`` DTensors over the
    ``ep`` dim of ``ep_mesh`` (each EP rank keeps its ``E / ep`` experts of the tensor it has,
    no communication: the weights must already be the same on every rank, as the recipe's
    seeded initialisation makes them, or on the meta device). ``ep_mesh`` is the 1-D ``ep``
    mesh, or ``mesh["ep", "tp"]`` for EP x TP, where the experts are already the TP plan's
    ``Shard(d)`` DTensors on ``tp`` (``apply_tp_to_moe``: ``d_ff`` split) and become
    ``(Shard(0), Shard(d))`` DTensors on both dims. Returns the number of blocks."""
    names = ep_mesh.mesh_dim_names or ()
    if (ep_mesh.ndim == 2 and names != ("ep", "tp")) or ep_mesh.ndim > 2:
        raise ValueError(
            f"distribute_experts: expected the 1-D 'ep' mesh or mesh['ep', 'tp'], got {ep_mesh}"
        )
    ep_dim = ep_mesh["ep"] if ep_mesh.ndim == 2 else ep_mesh
    ep, index = ep_dim.size(), ep_dim.get_local_rank()
    blocks = {n: m for n, m in module.named_modules() if _is_moe(m)}
    for block, moe in blocks.items():  # every check before anything changes
        check_ep(moe.n_experts, ep)
        for name in EXPERT_PARAMS:
            _check_expert_param(getattr(moe.experts, name), f"{block}.experts.{name}", moe, ep_mesh)
    for moe in blocks.values():
        experts = moe.experts
        held = expert_range(moe.n_experts, ep, index)
        for name in EXPERT_PARAMS:
            p = getattr(experts, name)
            tp_placements = tuple(p.placements) if isinstance(p, DTensor) else ()
            whole = p.to_local() if isinstance(p, DTensor) else p
            local = whole.detach()[held.start : held.stop].clone()
            placements = (Shard(0), *tp_placements)
            d = DTensor.from_local(local, ep_mesh, placements, run_check=False)
            setattr(experts, name, nn.Parameter(d, requires_grad=p.requires_grad))
        experts.ep_mesh = ep_dim
        experts.all_to_all_sent = 0  # bytes, read by take_all_to_all_bytes
    return len(blocks)


def _check_expert_param(p: torch.Tensor, where: str, moe: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Refuse what ``distribute_experts`` cannot split: a tensor that is not fused ``(E, m,
    n)``, a DTensor on the 1-D path (distributed twice), and under EP x TP one that is not the
    TP plan's ``Shard(1|2)`` on ``tp``."""
    where = where.lstrip(".")
    if ep_mesh.ndim == 1 and isinstance(p, DTensor):
        raise ValueError(f"{where} is already a DTensor ({p.placements}): distribute once")
    if ep_mesh.ndim == 2:
        tp_ok = isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("tp",)
        if not tp_ok or not (isinstance(p.placements[0], Shard) and p.placements[0].dim > 0):
            placed = f"{p.placements} on {p.device_mesh}" if isinstance(p, DTensor) else "plain"
            raise ValueError(
                f"{where} is {placed}: EP x TP takes the experts as the TP plan leaves them "
                "(apply_tp_to_block on mesh['tp'] first: Shard(1) or Shard(2) on 'tp')"
            )
    if p.dim() != 3 or p.shape[0] != moe.n_experts:
        raise ValueError(
            f"{where} has shape {tuple(p.shape)}, not a fused ({moe.n_experts}, m, n) "
            "expert tensor: expert parallelism splits the experts' dim 0"
        )


def shard_ep_block(block: nn.Module, mesh: DeviceMesh, dp_mesh: DeviceMesh, **kwargs) -> None:
    """``fully_shard`` one block whose experts ``distribute_experts`` split over ``mesh["ep"]``:
    the experts over ``expert_dp_mesh(mesh)`` (``dp_shard_mod_ep``, HSDP with
    ``dp_replicate``; gradients divided by the whole dp degree: each EP rank's already sums its
    ``ep`` group's tokens), then the block over ``dp_mesh``. ``kwargs`` go to both calls."""
    import raggedfsdp

    for moe in (m for m in block.modules() if _is_moe(m)):
        raggedfsdp.fully_shard(moe.experts, mesh=expert_dp_mesh(mesh), **kwargs)
        moe.experts.set_gradient_divide_factor(dp_mesh.size())
    raggedfsdp.fully_shard(block, mesh=dp_mesh, **kwargs)


def shard_ep_block_fsdp2(block: nn.Module, mesh: DeviceMesh, dp_mesh: DeviceMesh, **kwargs) -> None:
    """torch's FSDP2 ``fully_shard`` on one block whose experts ``distribute_experts`` split
    over ``mesh["ep"]``, as torchtitan's ``apply_fsdp`` does it: a separate call on each
    ``experts`` module over ``mesh["dp_shard_mod_ep"]`` (FSDP2 takes the ``Shard(0)``-over-ep
    DTensors as parameters on another dim of the same root mesh and shards their local experts),
    gradients divided by the whole dp degree (each EP rank's sums its ``ep`` group's tokens),
    then ``fully_shard(block, mesh=dp_mesh)`` for the dense rest. Where ``dp_shard_mod_ep`` has
    more ranks than an EP rank has experts, FSDP2's even dim-0 split would pad whole experts, so
    the experts shard their dim 1 instead (torchtitan's rule). On gloo, which has no
    ``PREMUL_SUM``, the experts reduce with ``SUM`` and divide after (where there is a
    reduce-scatter: with one ``dp_shard_mod_ep`` rank torch 2.13 would divide twice).
    ``kwargs`` (``mp_policy``, ``reshard_after_forward``, ...) go to both calls. Public, with a
    stable signature: the FSDP2 x EP side of ``benchmarks/moe_vs_fsdp2.py --ep`` builds with
    it."""
    from torch.distributed.fsdp import fully_shard

    dp_mod_ep, experts_mesh = mesh["dp_shard_mod_ep"], expert_dp_mesh(mesh)
    for moe in (m for m in block.modules() if _is_moe(m)):
        local_experts = moe.n_experts // mesh["ep"].size()
        placement = {}
        if dp_mod_ep.size() > local_experts:
            placement = {"shard_placement_fn": lambda _: Shard(1)}
        fully_shard(moe.experts, mesh=experts_mesh, **placement, **kwargs)
        moe.experts.set_gradient_divide_factor(float(dp_mesh.size()))
        # gloo has no PREMUL_SUM: SUM, then divide (not at size 1, where torch 2.13 divides twice)
        if dp_mod_ep.size() > 1 and dist.get_backend(dp_mod_ep.get_group()) == "gloo":
            moe.experts.set_force_sum_reduction_for_comms(True)
    fully_shard(block, mesh=dp_mesh, **kwargs)


@torch.no_grad()
def fsdp2_clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for FSDP2 x EP, whose gradients are DTensors on two
    meshes (the experts' ``(dp_shard_mod_ep, ep)``, the dense ``dp_shard``): torch stacks the
    per-tensor norms and refuses mixed meshes. The 2-norm is taken per mesh (each a full
    reduction over its mesh), the per-mesh norms combined, and every gradient scaled by
    ``min(1, max_norm / (norm + 1e-6))`` as torch does. Returns the total norm (plain)."""
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in by_mesh.values():
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coef.to(local.device, local.dtype))
    return total


def _is_moe(module: nn.Module) -> bool:
    """Whether ``module`` is a MoE block (``recipes.llama.moe.MoEFeedForward``: a router and
    fused ``experts``), told by its parts: that module imports this one, not the reverse."""
    return hasattr(module, "experts") and hasattr(module, "n_experts") and hasattr(module, "route")


def _count_sent(experts: nn.Module | None, x: torch.Tensor, in_splits: list[int], group) -> None:
    """Add the bytes this rank sends to the other EP ranks (its own slot stays local) to
    ``experts.all_to_all_sent`` (``None``: not counted)."""
    if experts is not None:
        rows = sum(in_splits) - in_splits[dist.get_rank(group)]
        experts.all_to_all_sent += rows * (x.numel() // max(x.shape[0], 1)) * x.element_size()


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward sends the gradient back.
    ``experts`` (or ``None``) counts the bytes sent both ways."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, experts):
        ctx.splits, ctx.group, ctx.experts = (out_splits, in_splits), group, experts
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        _count_sent(experts, x, in_splits, group)
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        _count_sent(ctx.experts, grad, out_splits, ctx.group)
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None, None


def take_all_to_all_bytes(module: nn.Module) -> int:
    """The bytes this rank sent to other EP ranks in ``module``'s MoE all-to-alls since the
    last call (forward, backward and an activation-checkpointing recompute: every dispatch with
    gradients enabled; evaluation under ``no_grad`` is not counted), and restart the count.
    0 without expert parallelism."""
    sent = 0
    for experts in (m.experts for m in module.modules() if _is_moe(m)):
        sent += getattr(experts, "all_to_all_sent", 0)
        if hasattr(experts, "all_to_all_sent"):
            experts.all_to_all_sent = 0
    return sent


def dispatch(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The routed experts' outputs for ``rows`` (sorted by global expert, ``counts[e]`` rows
    for expert ``e``), each computed on the EP rank holding its expert; the same rows in the
    same order as ``experts(rows, counts)`` on one process."""
    mesh: DeviceMesh = experts.ep_mesh
    group, ep = mesh.get_group(), mesh.size()
    n_local = counts.numel() // ep
    counter = experts if torch.is_grad_enabled() else None
    # counts first: recv[s, e] = rows EP rank s sends to this rank's local expert e
    recv = torch.empty_like(counts)
    _count_sent(counter, counts.view(ep, n_local), [1] * ep, group)
    dist.all_to_all_single(recv, counts.contiguous(), group=group)
    recv = recv.view(ep, n_local)
    send_splits = counts.view(ep, n_local).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    received = _AllToAll.apply(rows, recv_splits, send_splits, group, counter)
    # arrived by (source rank, local expert): regroup by local expert, stable in the source
    expert_of_row = torch.arange(n_local, device=rows.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(recv.flatten().to(rows.device))
    order = expert_of_row.argsort(stable=True)
    out = experts(received[order], recv.sum(0))
    out = out[order.argsort()]
    return _AllToAll.apply(out, send_splits, recv_splits, group, counter)
