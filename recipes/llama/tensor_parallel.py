"""``--tp N``: torchtitan's Llama tensor-parallel plan for the recipe's model, and its checks.

TP runs inside the data-parallel mesh: ``init_device_mesh`` lays the ranks out with ``tp`` as the
last (fastest) dim, so the N ranks of one TP group are neighbours (one node on a cluster), and
``fully_shard(..., mesh=mesh["dp_shard"])`` (raggedfsdp or FSDP2) shards the TP-local tensors over
data parallel. The plan is torchtitan's ``apply_tp`` without loss parallel: in every block
``wq``/``wk``/``wv`` and ``w1``/``w3`` column-wise (weights ``Shard(0)``: each rank computes
``n_heads / N`` heads and ``1/N`` of the SwiGLU width), ``wo`` and ``w2`` row-wise (``Shard(1)``,
outputs reduce-scattered along the sequence), the norms sequence-parallel (replicated weights,
activations sharded along the sequence between the blocks); the embedding row-wise (vocabulary
rows) and the head column-wise with replicated logits, so the loss is the plain one.

Every dim the plan splits must divide by N: ``config.check_tp`` says which do not and which
degrees would work while the command line is parsed, ``parallel.check_world`` that N divides
the processes, before the process group is touched.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["apply_tp_to_block", "apply_tp_to_root"]


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
    ``n_heads / N`` query and ``n_kv_heads / N`` key/value heads, as torchtitan's does."""
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": _sequence_to_whole(extra=1),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": _sequence_to_whole(extra=0),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    parallelize_module(block, tp_mesh, plan)


def apply_tp_to_root(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The embedding row-wise (its output reduce-scattered along the sequence), the final norm
    sequence-parallel and the head column-wise with replicated logits (no loss parallel)."""
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, plan)
