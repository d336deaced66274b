"""``--tp N``: torchtitan's Llama tensor-parallel plan for the recipe's model, and its checks.

TP runs inside the data-parallel mesh: ``init_device_mesh`` lays the ranks out with ``tp`` as the
last (fastest) dim, so the N ranks of one TP group are neighbours (one node on a cluster), and
``fully_shard(..., mesh=mesh["dp_shard"])`` (raggedfsdp or FSDP2) shards the TP-local tensors over
data parallel. The plan is torchtitan's ``apply_tp``, loss parallel optional: in every block
``wq``/``wk``/``wv`` and ``w1``/``w3`` column-wise (weights ``Shard(0)``: each rank computes
``n_heads / N`` heads and ``1/N`` of the SwiGLU width), ``wo`` and ``w2`` row-wise (``Shard(1)``,
outputs reduce-scattered along the sequence), the norms sequence-parallel (replicated weights,
activations sharded along the sequence between the blocks); the embedding row-wise (vocabulary
rows) and the head column-wise with replicated logits, so the loss is the plain one. With
``--loss-parallel`` the head keeps its logits vocabulary-sharded (``Shard(-1)`` DTensors) and
the cross-entropy runs under ``loss_context``, torch's ``loss_parallel`` (torchtitan's), so no
rank holds the full-vocabulary logits or their gradient.

MoE blocks (``apply_tp_to_moe``, ``moe_tp_forward``): attention and norms as above; the
feed-forward gathers the sequence-parallel tokens over TP, routes them with a replicated router
(every TP rank routes identically), runs every expert on a ``1/N`` slice of its ``d_ff``
(``w1``/``w3`` ``Shard(1)``, ``w2`` ``Shard(2)``) and the shared expert as the dense SwiGLU,
and reduce-scatters the summed partial outputs back along the sequence. With ``--ep`` as well
(EP x TP) ``expert_parallel.distribute_experts`` then keeps this EP rank's experts of each TP
block, DTensors on ``mesh["ep", "tp"]``, and the routed rows travel to them by the EP
all-to-all between the gather and the reduce-scatter (``MoEFeedForward.routed``).

Every dim the plan splits must divide by N: ``config.check_tp`` says which do not and which
degrees would work while the command line is parsed, ``parallel.check_world`` that N divides
the processes, before the process group is touched.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

__all__ = [
    "apply_tp_to_block",
    "apply_tp_to_moe",
    "apply_tp_to_root",
    "loss_context",
    "moe_tp_forward",
]


def _sequence_to_whole(extra: int) -> PrepareModuleInput:
    """Gather the sequence-sharded activation (the first input) before the column-wise layers;
    ``extra`` inputs after it (the RoPE table) pass through untouched."""
    return PrepareModuleInput(
        input_layouts=(Shard(1), *[None] * extra),
        desired_input_layouts=(Replicate(), *[None] * extra),
    )


def apply_tp_to_block(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """torchtitan's per-block plan on a materialized ``model.Block`` (its weights become
    DTensors on ``tp_mesh``). Attention reshapes with ``-1`` heads, so each rank computes its
    ``n_heads / N`` query and ``n_kv_heads / N`` key/value heads, as torchtitan's does. A MoE
    block's feed-forward gets ``apply_tp_to_moe`` instead of the dense SwiGLU plan."""
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": _sequence_to_whole(extra=1),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    moe = _moe_of(block)
    if moe is None:
        plan.update(
            {
                "feed_forward": _sequence_to_whole(extra=0),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            }
        )
    parallelize_module(block, tp_mesh, plan)
    if moe is not None:
        apply_tp_to_moe(moe, tp_mesh)


def apply_tp_to_root(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = False) -> None:
    """The embedding row-wise (its output reduce-scattered along the sequence), the final norm
    sequence-parallel and the head column-wise on the norm's sequence-sharded output. Its
    logits are all-gathered into plain full-vocabulary tensors, or, with ``loss_parallel``,
    stay ``Shard(-1)`` DTensors (each rank's ``vocab_size / N`` columns) for a loss computed
    under ``loss_context``. The head's weight is ``Shard(0)`` either way, so checkpoints do
    not depend on the choice."""
    logits = Shard(-1) if loss_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=logits, use_local_output=not loss_parallel
        ),
    }
    parallelize_module(model, tp_mesh, plan)


def loss_context(enabled: bool) -> AbstractContextManager[None]:
    """torch's ``loss_parallel()`` where ``--loss-parallel`` is on (a no-op context otherwise):
    ``F.cross_entropy`` on vocabulary-sharded DTensor logits then reduces the softmax over TP
    instead of gathering the logits. The loss's backward must run inside it too."""
    return torch_loss_parallel() if enabled else contextlib.nullcontext()


def _moe_of(block: nn.Module) -> nn.Module | None:
    """The block's MoE feed-forward (``recipes.llama.moe.MoEFeedForward``), told by its parts
    (that module imports this one), or ``None`` for a dense block."""
    ffn = block.feed_forward
    return ffn if hasattr(ffn, "experts") and hasattr(ffn, "route") else None


def apply_tp_to_moe(moe: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The TP plan of a MoE feed-forward (its forward is then ``moe_tp_forward``).

    * The router weight is ``Replicate()`` (a hook hands it the gathered tokens as a replicated
      DTensor and returns the local logits), so every TP rank routes every token identically
      and its load-balancing counts are taken once (on TP rank 0; ``balance_routers`` sums
      them over the world).
    * The fused experts are split on ``d_ff``: ``w1``/``w3`` ``(E, d_ff, d)`` ``Shard(1)``,
      ``w2`` ``(E, d, d_ff)`` ``Shard(2)``, so each rank computes ``1/N`` of every expert's
      SwiGLU width and a partial sum of its output (``Experts.local_weights`` computes with
      the local tensors).
    * The shared expert is the dense SwiGLU plan on the gathered tokens: ``w1``/``w3``
      column-wise, ``w2`` row-wise reduce-scattered along the sequence."""
    experts = moe.experts
    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        p = getattr(experts, name)
        local = p.detach().chunk(tp_mesh.size(), dim)[tp_mesh.get_local_rank()].clone()
        d = DTensor.from_local(local, tp_mesh, [Shard(dim)], run_check=False)
        setattr(experts, name, nn.Parameter(d, requires_grad=p.requires_grad))
    distribute_module(
        moe.router,
        tp_mesh,
        input_fn=lambda _, inputs, mesh: (
            DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False),
        ),
        output_fn=lambda _, out, __: out.to_local(),
    )
    if moe.shared is not None:
        shared_plan = {
            "w1": ColwiseParallel(),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
            "w3": ColwiseParallel(),
        }
        parallelize_module(moe.shared, tp_mesh, shared_plan)
    moe.tp_mesh = tp_mesh
    moe.counts_tokens = tp_mesh.get_local_rank() == 0


def moe_tp_forward(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MoE feed-forward under TP, on local tensors: ``x`` is this rank's ``1/N`` of the
    sequence; the result is too.

    The tokens are all-gathered along the sequence first (torchtitan's choice too), so router,
    top-k and dispatch see every token on every TP rank and agree; each rank's routed output is
    a partial sum over the ``d_ff`` split, reduce-scattered back along the sequence once. The
    gradients: the reduce-scatter's backward all-gathers the output's gradient, so every rank
    back-propagates the same one; what leaves the split experts (the rows' gradient, and the
    routing weights', which multiply partial outputs) is partial, so those two tensors enter
    through ``_SumGradOverTP`` (identity forward, all-reduce backward; Megatron's ``f``), the
    shared expert's column-wise layers do the same, and the gathered tokens' gradient is then
    the same full one on every rank: the gather's backward keeps this rank's slice, as one
    process's gradient would be."""
    group = moe.tp_mesh.get_group()
    if isinstance(x, DTensor):  # the sequence-parallel norm's output: Shard(1) over tp
        x = x.to_local()
    full = _GatherSequence.apply(x, group)
    flat = full.reshape(-1, full.shape[-1])
    routed = moe.routed(flat, enter=lambda t: _SumGradOverTP.apply(t, group))
    out = _ReduceScatterSequence.apply(routed.reshape(full.shape), group)
    return out if moe.shared is None else out + moe.shared(full)


class _SumGradOverTP(torch.autograd.Function):
    """Identity; backward all-reduces the gradient over the TP group (it is a partial sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(batch, seq / N, ...)`` on each rank -> ``(batch, seq, ...)``, rank order."""
    n = dist.get_world_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # the ranks' tensors one after another
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out.unflatten(0, (n, x.shape[0])).movedim(0, 1).flatten(1, 2)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence; backward keeps this rank's slice of the gradient, which
    ``moe_tp_forward`` makes the same full one on every TP rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.length = group, x.shape[1]
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = dist.get_rank(ctx.group) * ctx.length
        return grad.narrow(1, start, ctx.length).contiguous(), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sum over the TP group, each rank keeping its ``1/N`` of the sequence; backward
    all-gathers the gradient (every rank's partial sum enters the total with weight one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        chunks = x.unflatten(1, (n, x.shape[1] // n)).movedim(1, 0).flatten(0, 1).contiguous()
        out = x.new_empty((x.shape[0], x.shape[1] // n, *x.shape[2:]))
        dist.reduce_scatter_single(out, chunks, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_sequence(grad, ctx.group), None
