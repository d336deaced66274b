"""Collectives and process-group plumbing for ragged flat buffers (gloo and NCCL).

See :mod:`raggedfsdp.comm.collectives` for the backend notes and :mod:`raggedfsdp.comm.handle`
for how async handles and communication streams keep CUDA memory safe without ``record_stream``.
"""

from raggedfsdp.comm.collectives import (
    GATHER_TAG,
    REDUCE_TAG,
    ReduceKind,
    all_gather_flat,
    all_reduce_flat,
    all_to_all_uneven,
    reduce_scatter_flat,
)
from raggedfsdp.comm.errors import CollectiveError, failing_as
from raggedfsdp.comm.handle import CommHandle
from raggedfsdp.comm.mesh import (
    ShardMesh,
    group_rank,
    group_size,
    product_group,
    resolve_group,
    resolve_mesh,
    shard_subgroup,
)

__all__ = [
    "GATHER_TAG",
    "REDUCE_TAG",
    "CollectiveError",
    "CommHandle",
    "ReduceKind",
    "ShardMesh",
    "all_gather_flat",
    "all_reduce_flat",
    "all_to_all_uneven",
    "failing_as",
    "group_rank",
    "group_size",
    "product_group",
    "reduce_scatter_flat",
    "resolve_group",
    "resolve_mesh",
    "shard_subgroup",
]
