"""``AdamW``: torch's AdamW on whole flat runs of this rank's pieces.

The update is element-wise, so running it on a run of neighbouring parameters at once (or a
whole flat segment) gives every element exactly the bits it would get per parameter; only the
number of kernels changes. To be bitwise torch's AdamW in every mode, and to keep its options
(foreach, fused, tensor lr, amsgrad, maximize, capturable), the math itself is torch's
functional ``torch.optim.adam.adam`` applied to those runs: this class decides *what* to update,
torch's kernels decide *how*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam

from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.base import ShardedOptimizer
from raggedfsdp.optim.contract import Piece, StateSpec
from raggedfsdp.optim.pieces import merge_runs, scalar_dtype, unwrap
from raggedfsdp.optim.runs import RunPlan
from raggedfsdp.sharding import ShardPolicy, element_units

__all__ = ["AdamW", "adamw_update", "check_adam_args", "check_betas"]


def check_adam_args(
    lr: Any,
    betas: Any,
    eps: float,
    weight_decay: float,
    *,
    foreach: bool | None = None,
    capturable: bool = False,
) -> None:
    """``torch.optim.Adam``'s argument checks, with its messages, so code written against
    torch's errors sees ours: a tensor ``lr`` or tensor betas with ``foreach=True`` need
    ``capturable=True`` (the foreach kernels read them on the host), betas are both floats or
    both tensors (the kernels take one kind), and each value is in range."""
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError(
                "lr as a Tensor is not supported for capturable=False and foreach=True: pass "
                "a float, or capturable=True"
            )
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    check_betas(betas, "betas", foreach=foreach, capturable=capturable)
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_betas(
    betas: Any, name: str, *, foreach: bool | None = None, capturable: bool = False
) -> None:
    """torch's rules for Adam's ``(beta1, beta2)``, for the argument called ``name`` (Muon's
    AdamW groups take them as ``adamw_betas``)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{name}={betas!r}: expected two coefficients (beta1, beta2)")
    for i, beta in enumerate(betas):
        if isinstance(beta, Tensor) and beta.numel() != 1:
            raise ValueError(f"Tensor {name}[{i}] must be 1-element")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    floats = all(isinstance(b, float) for b in betas)
    tensors = all(isinstance(b, Tensor) for b in betas)
    if not (floats or tensors):
        raise ValueError(
            f"{name} must be either both floats or both Tensors, got "
            f"({type(betas[0]).__name__}, {type(betas[1]).__name__}): pass e.g. "
            f"{name}=(0.9, 0.999) or {name}=(torch.tensor(0.9), torch.tensor(0.999))"
        )
    if tensors and foreach and not capturable:
        raise ValueError(
            f"{name}[0] as a Tensor is not supported for capturable=False and foreach=True: "
            "pass floats, or capturable=True"
        )


def adamw_update(
    group: Mapping[str, Any],
    pieces: Sequence[Piece],
    state: Mapping[Tensor, Mapping[str, Tensor]],
    step: Tensor,
    plans: dict[Any, RunPlan] | None = None,
) -> None:
    """One AdamW step of ``pieces`` (all with gradients, all at ``step`` before it), with the
    hyper-parameters of ``group`` (``torch.optim.AdamW``'s keys) and the moments in
    ``state[piece.param]`` (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad).

    A plain function, not a method, because two optimizers run it: ``AdamW`` on its groups and
    ``Muon`` on the groups it leaves to AdamW. Neighbouring sharded pieces are merged into runs
    first (element-wise math, so the bits are the same), then torch's own ``adam`` runs. ``step``
    is not modified (the caller's runtime increments it).

    ``plans``: a cache of ``RunPlan`` s that the caller drops whenever it creates or replaces
    state tensors; with it the runs are found once rather than every step.
    """
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
    planned = None if plans is None else _planned_runs(plans, pieces, state, keys, step)
    if planned is not None:
        columns, steps = planned
    else:
        columns = _merged_columns(pieces, state, keys)
        steps = [step.clone() for _ in columns[0]] if columns else []
    if not steps:
        return
    beta1, beta2 = group["betas"]
    adam(
        columns[0],
        columns[1],
        columns[2],
        columns[3],
        columns[4] if group["amsgrad"] else [],
        steps,  # torch increments these; the caller owns `step`
        foreach=group["foreach"],
        capturable=group["capturable"],
        differentiable=False,
        fused=group["fused"],
        has_complex=False,
        decoupled_weight_decay=True,
        amsgrad=group["amsgrad"],
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )


def _merged_columns(
    pieces: Sequence[Piece], state: Mapping[Tensor, Mapping[str, Tensor]], keys: list[str]
) -> list[list[Tensor]]:
    """Parameters, gradients and each moment, one list per column, over the merged runs of
    the sharded pieces and the single ones (found from the addresses, this step)."""
    sharded, single = [], []
    for pc in pieces:
        moments = state[pc.param]
        entry = [pc.local(), pc.local_grad(), *(unwrap(moments[k]) for k in keys)]
        (sharded if pc.sharded else single).append(entry)
    runs = merge_runs(sharded) + single
    return [list(c) for c in zip(*runs, strict=True)]


def _planned_runs(
    plans: dict[Any, RunPlan],
    pieces: Sequence[Piece],
    state: Mapping[Tensor, Mapping[str, Tensor]],
    keys: list[str],
    step: Tensor,
) -> tuple[list[list[Tensor]], list[Tensor]] | None:
    """The columns and step counters from the plan of ``pieces`` (planned now if there is
    none, or if the parameters moved since); None for pieces a plan does not cover (single
    mode) and for gradients that do not form its runs."""
    key = (pieces[0].group_index, id(pieces[0]), len(pieces)) if pieces else None
    plan = plans.get(key)
    if plan is None or plan.pieces != list(pieces) or not plan.current():
        plan = RunPlan.build(pieces, state, keys)
        if plan is None:
            return None
        plans[key] = plan
    grads = plan.gradients()
    if grads is None:
        return None
    if not grads:  # every piece is empty on this rank
        return [], []
    fixed = plan.fixed
    return [fixed[0], grads, *fixed[1:]], plan.step_counters(step)


class AdamW(ShardedOptimizer):
    """AdamW with sharded state; the arguments are ``torch.optim.AdamW``'s.

    Single process: the same results and state dict as ``torch.optim.AdamW`` (bitwise). Drop-in
    (plain parameters under a process group) and fsdp (``RaggedTensor`` parameters): each rank
    keeps the state of its pieces only, 8 bytes per element in fp32 (8 / W per model element),
    and the update equals torch's bitwise given the same (averaged) gradients.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable, fused: as
            ``torch.optim.AdamW``. ``capturable`` works in single and fsdp mode; the drop-in
            mode synchronises with the host each step and cannot be graph-captured.
        differentiable: not supported (raises): sharded state is not part of autograd.
        mesh: ranks for the drop-in mode (a DeviceMesh, 2-D for HSDP, a process group, or None
            for the default group).
    """

    handles_tensor_parallel = True
    handles_multi_dim_tp = True  # element-wise: any split is exact

    _state_keys_depend_on = ("amsgrad",)

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        mesh: MeshLike = None,
    ) -> None:
        check_adam_args(lr, betas, eps, weight_decay, foreach=foreach, capturable=capturable)
        if differentiable:
            raise NotImplementedError(
                "differentiable=True is not supported by raggedfsdp.optim.AdamW (its state is "
                "sharded outside autograd); use torch.optim.AdamW for meta-learning"
            )
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        betas = tuple(b.reshape(()) if isinstance(b, Tensor) else b for b in betas)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": True,
        }
        super().__init__(params, defaults, mesh=mesh)

    @classmethod
    def shard_policy(cls) -> ShardPolicy:
        """Element units: AdamW is element-wise, so any cut is fine, and element units leave the
        planner the most freedom (the least padding). Rows would only add padding."""
        return element_units()

    def _policy(self) -> ShardPolicy:
        return self.shard_policy()

    def _state_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        return {key: StateSpec(piece.numel, piece.param.dtype) for key in keys}

    def _new_step(self, group: dict[str, Any], device: torch.device) -> Tensor:
        # torch keeps the counter on the host unless capturable or fused (see torch.optim.Adam).
        if group["capturable"] or group["fused"]:
            return torch.zeros((), dtype=scalar_dtype(bool(group["fused"])), device=device)
        return torch.tensor(0.0, dtype=scalar_dtype())

    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        adamw_update(group, pieces, self.state, step, self._step_plans)
