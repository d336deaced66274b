"""The torch-free rules of expert parallelism (EP), for the runtime and the capacity planner.

Under EP each MoE block's fused experts ``(E, ...)`` are split along dim 0 over an ``ep`` mesh
dim: EP rank ``j`` holds experts ``[j * E / ep, (j + 1) * E / ep)`` whole, and ``fully_shard``
shards those local experts over the data-parallel ranks EP leaves, ``dp_shard_mod_ep =
dp_shard / ep`` (torchtitan's name; EP borrows its ranks from ``dp_shard``). Dense parameters
keep sharding over all of ``dp_shard``. Rank ``i * ep + j`` of ``dp_shard`` is at
``(dp_shard_mod_ep=i, ep=j)``, so an EP group is ``ep`` neighbouring ranks.

The recipe's EP wrapping (``recipes/llama/expert_parallel.py``) and the planner
(``raggedfsdp/capacity/ep_plan.py``) both import these, so which ranks hold an expert, the
complement group's size and the refusals are derived once.
"""

from __future__ import annotations

__all__ = ["check_ep", "divisors", "ep_complement", "ep_coordinates", "expert_range"]


def divisors(n: int) -> list[int]:
    """The degrees that split ``n`` evenly, ascending (the fixes the refusals offer)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_ep(n_experts: int, ep: int) -> None:
    """Refuse, in one line and before any collective, an ``ep`` that does not split the
    experts evenly: each EP rank holds ``n_experts / ep`` whole experts."""
    if ep < 1 or n_experts % ep:
        raise ValueError(
            f"expert parallelism: ep={ep} does not divide n_experts={n_experts}; each EP rank "
            f"holds n_experts / ep whole experts: pick ep from the divisors of {n_experts}"
        )


def ep_complement(dp_shard: int, ep: int) -> int:
    """``dp_shard_mod_ep``: how many ranks shard each EP rank's experts (and so hold the same
    experts in one replica). ``ValueError`` when ``ep`` does not divide ``dp_shard``."""
    if ep < 1 or dp_shard % ep:
        raise ValueError(
            f"expert parallelism: ep={ep} does not divide the {dp_shard} data-parallel shard "
            f"ranks (EP borrows its ranks from dp_shard, leaving dp_shard_mod_ep = dp_shard / "
            f"ep to shard each EP rank's experts): pick ep from {divisors(dp_shard)}"
        )
    return dp_shard // ep


def ep_coordinates(dp_rank: int, ep: int) -> tuple[int, int]:
    """``(dp_shard_mod_ep rank, ep rank)`` of rank ``dp_rank`` of ``dp_shard``."""
    return divmod(dp_rank, ep)


def expert_range(n_experts: int, ep: int, ep_rank: int) -> range:
    """The global indices of the experts EP rank ``ep_rank`` holds (``torch.chunk``'s even
    split of dim 0, which ``check_ep`` guarantees)."""
    check_ep(n_experts, ep)
    if not 0 <= ep_rank < ep:
        raise ValueError(f"expert parallelism: ep rank {ep_rank} is outside [0, {ep})")
    local = n_experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)
