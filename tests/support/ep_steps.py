"""The recipe's MoE model under EP (and EP x TP), stepped with fixed global gradients, for the
expert-parallel tests.

The EP, EP x TP and EP x TP optimizer tests compare a sharded model's step with one process's
given the *same* gradients: each rank copies its piece of every global gradient (``empty_like``
of a sharded parameter is its piece, of a plain one the whole tensor) and steps; the state is
then gathered whole, in global coordinates, to compare with the single-process optimizer's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

import raggedfsdp
from recipes.llama.expert_parallel import distribute_experts, ep_meshes, shard_ep_block
from recipes.llama.moe import MoEBlock, MoEConfig, MoETransformer
from recipes.llama.tensor_parallel import apply_tp_to_block, apply_tp_to_root

__all__ = ["full_state", "is_expert", "set_grads", "step_with", "tiny_moe", "wrap_ep"]

Named = Sequence[tuple[str, torch.Tensor]]


def tiny_moe(experts: int, dim: int = 16, moe_hidden: int = 8) -> MoETransformer:
    """Two MoE blocks (top-2 of ``experts``, one shared expert, the CPU loop), seeded weights:
    the model every EP test steps, small enough for four ranks on two cores."""
    cfg = MoEConfig(
        dim=dim,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        n_experts=experts,
        top_k=2,
        moe_hidden=moe_hidden,
        n_shared_experts=1,
        n_dense_layers=0,
        expert_impl="loop",
    )
    model = MoETransformer(cfg, seq_len=8)
    model.init_weights(seed=3)
    return model


def set_grads(named: Iterable[tuple[str, torch.Tensor]], grads: dict[str, torch.Tensor]) -> None:
    """Give every parameter its piece (or all) of the global gradient ``grads[name]``."""
    for n, p in named:
        p.grad = torch.empty_like(p).copy_(grads[n])


def step_with(named: Named, grads: dict[str, torch.Tensor], opt, steps: int) -> None:
    """``steps`` optimizer steps, each with the same global gradients."""
    for _ in range(steps):
        set_grads(named, grads)
        opt.step()


def full_state(opt, named: Named) -> dict[str, torch.Tensor]:
    """Every state tensor but the step counters, gathered whole (global coordinates), keyed
    ``"{parameter}.{state key}"``."""
    return {
        f"{n}.{key}": value.full_tensor() if hasattr(value, "full_tensor") else value
        for n, p in named
        for key, value in opt.state[p].items()
        if key != "step"
    }


def is_expert(name: str) -> bool:
    """Whether ``name`` is a fused expert tensor (``w1``, ``w2``, ``w3`` of an MoE block)."""
    return ".experts." in name


def wrap_ep(model: MoETransformer, ep: int, tp: int = 1, **kwargs) -> MoETransformer:
    """``model`` as ``recipes/llama/expert_parallel.py`` lays it out: with ``tp`` above 1 the
    TP plan first, the experts on ``mesh["ep", "tp"]``; the experts sharded over
    ``dp_shard_mod_ep``, the rest over ``dp_shard``. ``kwargs`` (a shard policy) go to every
    ``fully_shard`` call."""
    mesh, dp = ep_meshes(ep, tp=tp)
    blocks = list(model.layers)
    assert all(isinstance(block, MoEBlock) for block in blocks)
    if tp > 1:
        for block in blocks:
            apply_tp_to_block(block, mesh["tp"])
        apply_tp_to_root(model, mesh["tp"])
    distribute_experts(model, mesh["ep", "tp"] if tp > 1 else mesh["ep"])
    for block in blocks:
        shard_ep_block(block, mesh, dp, **kwargs)
    raggedfsdp.fully_shard(model, mesh=dp, **kwargs)
    return model
