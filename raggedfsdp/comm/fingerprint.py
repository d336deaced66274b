"""Cross-rank fingerprints: catch ranks that built different models or optimizers.

Ranks that disagree about the parameter list (different model code, a conditionally created
module, a different param-group split, another shard policy) would plan different layouts and
then exchange the wrong bytes, or hang. One all-reduce of one 64-bit hash per parameter,
compared as max against min, catches it before the first real collective, and the error names
the first parameter that differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from raggedfsdp.comm.mesh import ShardMesh

__all__ = ["check_fingerprint", "collective_device"]


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small control tensor must live for ``group``'s backend (NCCL needs CUDA)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hash64(text: str) -> int:
    # Python's hash() of a str differs between processes; a real digest does not.
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _groups(mesh: ShardMesh) -> list[dist.ProcessGroup]:
    dims = ((mesh.shard_group, mesh.shard_size), (mesh.replicate_group, mesh.replicate_size))
    return [g for g, size in dims if g is not None and size > 1]


def check_fingerprint(
    mesh: ShardMesh, signatures: Sequence[tuple[str, str]], what: str = "optimizer parameter"
) -> None:
    """Raise if the ranks of ``mesh`` do not hold the same parameters in the same order.

    ``signatures`` are ``(name, description)`` per parameter; the description (group, shape,
    dtype, sharding, hyper-parameters) is what must agree; ``what`` names them in the error.
    Two all-reduces: the counts, then the hashes (max and min at once, as ``[h, -h]``).
    """
    for group in _groups(mesh):
        device = collective_device(group)
        count = torch.tensor([len(signatures), -len(signatures)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        most, fewest = int(count[0]), -int(count[1])
        if most != fewest:
            raise RuntimeError(
                f"ranks hold different numbers of {what}s ({fewest} to {most}; this rank "
                f"{len(signatures)}): every rank must build the same model and optimizer, over "
                "the same parameters in the same order"
            )
        hashes = torch.tensor([_hash64(d) for _, d in signatures], dtype=torch.int64)
        both = torch.cat([hashes, -hashes]).to(device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        n = len(signatures)
        differs = (both[:n] != -both[n:]).nonzero()
        if differs.numel():
            i = int(differs[0])
            name, description = signatures[i]
            raise RuntimeError(
                f"{what} #{i} ({name!r}) differs across ranks; this rank has {description}. "
                "Every rank must build the same model and optimizer (names, shapes, dtypes, "
                "sharding, param groups and hyper-parameters) in the same order"
            )
