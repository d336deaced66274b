"""``SOAP``: Adam in the eigenbasis of Shampoo's factors (Vyas et al., 2024), sharded by blocks.

The update, per ``B × B`` block ``G`` of a preconditioned parameter (the same block structure as
``Shampoo``: ``raggedfsdp.sharding.blocks.ShampooBlocks``), as the paper's Algorithm 3 writes
it; ``t`` counts Adam steps, and the first call only builds the preconditioner:

0. First call: ``L = (1-β_s)·G Gᵀ``, ``R = (1-β_s)·Gᵀ G``; ``Q_L``, ``Q_R``: their
   eigenvectors, largest eigenvalue first (``eigh``). Parameters do not move.
1. ``M = β₁·M + (1-β₁)·g`` (the first moment, in the parameter's own basis).
2. Rotate: ``G' = Q_Lᵀ G Q_R``, ``M' = Q_Lᵀ M Q_R``; Adam there: ``V = β₂·V + (1-β₂)·G'²``,
   ``N' = M' / (sqrt(V) + ε)``; rotate back: ``N = Q_L N' Q_Rᵀ``. Tensors that are not
   preconditioned run plain Adam: ``V = β₂·V + (1-β₂)·g²``, ``N = M / (sqrt(V) + ε)``.
3. ``p ← p - η·N`` with ``η = lr · sqrt(1-β₂ᵗ) / (1-β₁ᵗ)`` (``lr`` without bias correction),
   then ``p ← p - lr·λ·p`` (decoupled weight decay, after the step, as the authors' code).
4. ``L = β_s·L + (1-β_s)·G Gᵀ``, ``R = β_s·R + (1-β_s)·Gᵀ G``; every ``precondition_frequency``
   Adam steps, each basis is refreshed by one power iteration and a QR step from the previous
   one, its columns first sorted by the estimated eigenvalues ``diag(Qᵀ L Q)`` (largest
   first), and ``V`` is re-ordered to the new order along that side
   (``raggedfsdp.optim.matrix_roots.refresh_eigenbasis``).

Vector blocks (``precondition_1d``) keep ``L`` and ``Q_L`` only. The authors' code keeps ``M``
in the rotated basis instead (the same until the basis is refreshed); we follow the paper, and
our ``M`` is element-wise state split like the parameter.

Sharding is ``Shampoo``'s: ``SOAP.shard_policy()`` keeps every slab (row of blocks) on one rank,
so each rank rotates, updates and refreshes its own blocks and no optimizer byte moves; a forced
layout that cuts slabs sends each cut slab's ``G`` and ``M`` to its owner
(``raggedfsdp.optim.slabs``). Per-slab state (``L``, ``R``, ``Q_L``, ``Q_R`` per block, ``V`` per
slab) is split by whole slabs, so DCP reshards it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.blocked import BLOCK_STATS, BlockedOptimizer
from raggedfsdp.optim.contract import Piece, StateSpec
from raggedfsdp.optim.matrix_roots import descending_eigenbasis, refresh_eigenbasis
from raggedfsdp.optim.pieces import unwrap
from raggedfsdp.optim.slabs import SlabTask, SlabWork
from raggedfsdp.sharding.blocks import ShampooBlocks
from raggedfsdp.sharding.units import check_preconditioner_dim

__all__ = ["SOAP"]

_STATS = (*BLOCK_STATS, "basis_refreshes")


# ----------------------------------------------------------------------------- the math
@dataclass
class _Hyper:
    """One group's hyper-parameters at one step (``t``: Adam steps, 0 on the first call)."""

    t: int
    beta1: float
    beta2: float
    shampoo_beta: float
    eps: float
    refresh: bool
    batching: bool | None

    @classmethod
    def of(cls, group: dict[str, Any], step: Tensor, batching: bool | None) -> _Hyper:
        t = int(step.item())
        beta1, beta2 = group["betas"]
        refresh = t > 0 and t % group["precondition_frequency"] == 0
        return cls(t, beta1, beta2, group["shampoo_beta"], group["eps"], refresh, batching)


@dataclass
class _Block:
    """One block's state: views into its slab's (edge blocks use the top-left corner of their
    zero-padded storage); ``R``/``QR`` are None for vectors; ``V`` its rotated second moment."""

    L: Tensor
    QL: Tensor
    R: Tensor | None
    QR: Tensor | None
    V: Tensor

    @classmethod
    def of(cls, state: dict[str, Tensor], k: int, j: int, rows: int, cols: slice) -> _Block:
        """Block ``j`` (columns ``cols``) of this rank's ``k``-th slab, of ``rows`` rows."""
        v = state["exp_avg_sq"][k, :rows, cols]
        left, right = slice(0, rows), slice(0, v.shape[1])
        one_sided = "factor_R" not in state  # vectors: a left factor only
        return cls(
            state["factor_L"][k, j, left, left],
            state["basis_L"][k, j, left, left],
            None if one_sided else state["factor_R"][k, j, right, right],
            None if one_sided else state["basis_R"][k, j, right, right],
            v,
        )

    def sides(self) -> list[tuple[Tensor, Tensor, int]]:
        """``(factor, basis, dim of V it rotates)`` per side."""
        return [(self.L, self.QL, 0)] + ([(self.R, self.QR, 1)] if self.R is not None else [])


def update_moment_(m: Tensor, g: Tensor, beta1: float) -> None:
    """Step 1: ``M = β₁·M + (1-β₁)·g`` in place."""
    m.mul_(beta1).add_(g, alpha=1 - beta1)


def rotate(x: Tensor, block: _Block) -> Tensor:
    """``Q_Lᵀ X Q_R`` (``Q_Lᵀ X`` for vectors)."""
    out = block.QL.T @ x
    return out @ block.QR if block.QR is not None else out


def rotate_back(x: Tensor, block: _Block) -> Tensor:
    """``Q_L X Q_Rᵀ`` (``Q_L X`` for vectors)."""
    out = block.QL @ x
    return out @ block.QR.T if block.QR is not None else out


def adam_direction_(v: Tensor, g: Tensor, m: Tensor, beta2: float, eps: float) -> Tensor:
    """Step 2's Adam: ``V = β₂·V + (1-β₂)·G²`` in place; returns ``M / (sqrt(V) + ε)``."""
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    return m / (v.sqrt() + eps)


def eigenbasis_direction(block: _Block, g: Tensor, m: Tensor, h: _Hyper) -> Tensor:
    """Step 2 on one block: rotate ``G`` and ``M``, Adam in the eigenbasis, rotate back."""
    n = adam_direction_(block.V, rotate(g, block), rotate(m, block), h.beta2, h.eps)
    return rotate_back(n, block)


def accumulate_factors_(block: _Block, g: Tensor, shampoo_beta: float) -> None:
    """Steps 0 and 4: ``L = β_s·L + (1-β_s)·G Gᵀ`` and ``R = β_s·R + (1-β_s)·Gᵀ G``."""
    for factor, _, dim in block.sides():
        outer = g @ g.T if dim == 0 else g.T @ g
        factor.mul_(shampoo_beta).add_(outer, alpha=1 - shampoo_beta)


def first_bases_(blocks: Sequence[_Block], h: _Hyper, stats: dict[str, int]) -> None:
    """Step 0: every basis from ``eigh`` (equal sizes batched); the identity where it fails."""
    sides = [(factor, basis) for block in blocks for factor, basis, _ in block.sides()]
    found = descending_eigenbasis([f for f, _ in sides], stats, h.batching)
    for (_, basis), q in zip(sides, found, strict=True):
        if q is None:
            stats["root_failures"] += 1
            q = torch.eye(basis.shape[0], dtype=basis.dtype, device=basis.device)
        basis.copy_(q)


def refresh_bases_(block: _Block, stats: dict[str, int]) -> None:
    """Step 4's refresh: power iteration + QR per side, ``V`` re-ordered to match."""
    for factor, basis, dim in block.sides():
        if not bool(torch.isfinite(factor).all()):
            stats["root_failures"] += 1
            continue
        q, order = refresh_eigenbasis(factor, basis)
        block.V.copy_(block.V.index_select(dim, order))
        basis.copy_(q)
        stats["basis_refreshes"] += 1


def soap_slabs(
    tasks: Sequence[SlabTask],
    state_of: Callable[[Piece], dict[str, Tensor]],
    h: _Hyper,
    stats: dict[str, int],
) -> list[Tensor]:
    """Steps 0, 2 and 4 on every block of every slab this rank computes; returns each slab's
    rotated-back Adam direction ``N`` (zeros on the first call)."""
    blocks, where = [], []
    for n, task in enumerate(tasks):
        b = task.geometry.blocks
        state = state_of(task.piece)
        for j in range(b.col_blocks):
            cols = slice(j * b.block_cols, min((j + 1) * b.block_cols, b.cols))
            rows = task.inputs["grad"].shape[0]
            blocks.append(_Block.of(state, task.owned, j, rows, cols))
            where.append((n, cols))
    outs = [torch.zeros_like(task.inputs["grad"]) for task in tasks]
    for block, (n, cols) in zip(blocks, where, strict=True):
        # fresh contiguous copies: the matmuls see the same memory layout on every rank
        g = tasks[n].inputs["grad"][:, cols].to(block.L.dtype, copy=True).contiguous()
        if h.t > 0:
            m = tasks[n].inputs["exp_avg"][:, cols].to(block.L.dtype, copy=True).contiguous()
            outs[n][:, cols] = eigenbasis_direction(block, g, m, h)
            stats["blocks"] += 1
        accumulate_factors_(block, g, h.shampoo_beta)
        if h.refresh:
            refresh_bases_(block, stats)
    if h.t == 0:
        first_bases_(blocks, h, stats)
    return outs


# ----------------------------------------------------------------------------- the optimizer
class SOAP(BlockedOptimizer):
    """SOAP: Adam in the eigenbasis of Shampoo's factors, on Shampoo's block structure.

    The update is the module docstring's (the paper's Algorithm 3, numbered steps 0–4).
    Defaults are the paper's: ``betas=(0.95, 0.95)``, ``shampoo_beta=0.95`` (β_s, the factors'
    EMA), ``eps=1e-8``, ``weight_decay=0.01``, ``precondition_frequency=10``, bias correction
    on; ``lr=3e-3`` is the authors' code's default. ``max_preconditioner_dim=1024`` blocks large
    dims as ``Shampoo`` does (the authors' code leaves dims above 10,000 unpreconditioned
    instead of blocking them; with ``B`` at least every dim the rules coincide).

    Args:
        params: parameters or named parameters (plain tensors, or ``RaggedTensor`` s for fsdp).
        max_preconditioner_dim, merge_dims, precondition_1d: the block structure, as
            ``Shampoo``'s (one value per optimizer: they decide the shard layout).
        batch_bases: run equal-size first eigendecompositions as one batched call, as
            ``Shampoo``'s ``batch_roots`` (None: on CPU only, bitwise the per-block results).
        factor_dtype: dtype of ``L``, ``R``, the bases and ``V``; ``None`` = fp32 (fp64 for fp64
            parameters).
        mesh: ranks for the drop-in mode (see ``ShardedOptimizer``).

    State: ``exp_avg`` (``M``, like the parameter); ``exp_avg_sq`` (``V``: like the parameter
    for tensors that are not preconditioned, else per slab ``(slabs, slab rows, cols)`` in the
    rotated basis); ``factor_L``/``factor_R`` and ``basis_L``/``basis_R`` per block
    ``(slabs, blocks per slab, b, b)``. ``last_step_stats``: ``eigendecompositions``,
    ``eigh_cost``, ``eigh_batched``, ``fp64_retries``, ``root_failures`` (bases left as they
    were), ``basis_refreshes``, ``blocks``, ``owner_slabs``, ``bytes_sent`` /
    ``bytes_received`` / ``bytes_communicated``.
    """

    _state_keys_depend_on = ("max_preconditioner_dim",)

    def __init__(
        self,
        params: Any,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 1024,
        correct_bias: bool = True,
        *,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        batch_bases: bool | None = None,
        factor_dtype: torch.dtype | None = None,
        mesh: MeshLike = None,
    ) -> None:
        _check_args(lr, betas, shampoo_beta, eps, weight_decay, precondition_frequency)
        check_preconditioner_dim(max_preconditioner_dim)
        self.batch_bases = batch_bases
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "shampoo_beta": shampoo_beta,
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "max_preconditioner_dim": max_preconditioner_dim,
            "correct_bias": correct_bias,
        }
        super().__init__(
            params,
            defaults,
            max_preconditioner_dim=max_preconditioner_dim,
            merge_dims=merge_dims,
            precondition_1d=precondition_1d,
            factor_dtype=factor_dtype,
            mesh=mesh,
        )

    # ----------------------------------------------------------------------------- state
    def _state_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        specs = {"exp_avg": StateSpec(piece.numel, piece.param.dtype)}
        if not self._preconditioned(piece):
            return specs | {"exp_avg_sq": StateSpec(piece.numel, piece.param.dtype)}
        return specs | self._slab_specs(piece, group)

    def _slab_shapes(self, blocks: ShampooBlocks, group: dict[str, Any]) -> dict[str, tuple]:
        """``V`` per slab, then factors and bases per block."""
        sides = blocks.factors
        keys = [f"factor_{s}" for s in sides] + [f"basis_{s}" for s in sides]
        shapes = {"exp_avg_sq": (blocks.num_slabs, blocks.slab_rows, blocks.cols)}
        return shapes | {key: blocks.factor_shape(key[-1]) for key in keys}

    # ----------------------------------------------------------------------------- update
    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        """Step 1 per piece; 0, 2 and 4 per block where it lies or on its owner; 3 per piece
        (plain Adam for tensors that are not preconditioned)."""
        h = _Hyper.of(group, step, self.batch_bases)
        stats = self._stats(_STATS)
        work = []
        for pc in pieces:
            g = pc.local_grad().view(-1)
            m = unwrap(self.state[pc.param]["exp_avg"]).view(-1)
            if h.t > 0:
                update_moment_(m, g, h.beta1)
            work.append(SlabWork(pc, {"grad": g, "exp_avg": m}, torch.empty_like(m)))
        blocked = [w for w in work if self._preconditioned(w.piece)]
        if blocked:
            self._runner.run(
                blocked, lambda tasks: soap_slabs(tasks, self._slab_state, h, stats), stats
            )
        if h.t > 0:
            for w in work:
                self._apply(w, group, h)

    def _apply(self, w: SlabWork, group: dict[str, Any], h: _Hyper) -> None:
        """Step 3 (with plain Adam's step 2 for tensors that are not preconditioned)."""
        p = w.piece.local().view(-1)
        n = w.out
        if not self._preconditioned(w.piece):
            v = unwrap(self.state[w.piece.param]["exp_avg_sq"]).view(-1)
            n = adam_direction_(v, w.inputs["grad"], w.inputs["exp_avg"], h.beta2, h.eps)
        lr = group["lr"]
        step_size = lr
        if group["correct_bias"]:
            step_size = lr * (1 - h.beta2**h.t) ** 0.5 / (1 - h.beta1**h.t)
        p.add_(n.to(p.dtype), alpha=-step_size)
        if group["weight_decay"]:
            p.add_(p, alpha=-lr * group["weight_decay"])


def _check_args(
    lr: float,
    betas: Sequence[float],
    shampoo_beta: float,
    eps: float,
    weight_decay: float,
    precondition_frequency: int,
) -> None:
    """Argument checks, each naming the argument and its range."""
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}. Must be >= 0.0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas!r}. Must be (beta1, beta2), each in [0.0, 1.0)")
    if not 0.0 <= shampoo_beta < 1.0:
        raise ValueError(f"Invalid shampoo_beta: {shampoo_beta}. Must be in [0.0, 1.0)")
    if not eps > 0.0:
        raise ValueError(f"Invalid eps: {eps}. Must be > 0.0")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay: {weight_decay}. Must be >= 0.0")
    if (
        not isinstance(precondition_frequency, int)
        or isinstance(precondition_frequency, bool)
        or precondition_frequency < 1
    ):
        raise ValueError(
            f"Invalid precondition_frequency: {precondition_frequency!r}. Must be an int >= 1"
        )
