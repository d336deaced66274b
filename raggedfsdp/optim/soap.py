"""``SOAP``: Adam in the eigenbasis of Shampoo's factors (Vyas et al., 2024), sharded by blocks.

The update, per block ``G`` of a preconditioned parameter (``raggedfsdp.optim.soap_blocks``;
by default the ``B × B`` blocks of its matrix view, as ``Shampoo``'s), as the paper's
Algorithm 3 writes it; ``t`` counts Adam steps, and the first call only builds the
preconditioner:

0. First call: ``L = (1-β_s)·G Gᵀ``, ``R = (1-β_s)·Gᵀ G``; ``Q_L``, ``Q_R``: their
   eigenvectors, largest eigenvalue first (``eigh``). Parameters do not move.
1. ``M = β₁·M + (1-β₁)·g`` (the first moment, in the parameter's own basis).
2. Rotate: ``G' = Q_Lᵀ G Q_R``, ``M' = Q_Lᵀ M Q_R``; Adam there: ``V = β₂·V + (1-β₂)·G'²``,
   ``N' = M' / (sqrt(V) + ε)``; rotate back: ``N = Q_L N' Q_Rᵀ``. Tensors that are not
   preconditioned run plain Adam: ``V = β₂·V + (1-β₂)·g²``, ``N = M / (sqrt(V) + ε)``.
3. With ``normalize_grads`` (the authors' option), ``N ← N / (10⁻³⁰ + rms(N))``, the RMS over
   the whole parameter's update. ``p ← p - η·N`` with ``η = lr · sqrt(1-β₂ᵗ) / (1-β₁ᵗ)``
   (``lr`` without bias correction), then ``p ← p - lr·λ·p`` (decoupled weight decay, after
   the step, as the authors' code).
4. ``L = β_s·L + (1-β_s)·G Gᵀ``, ``R = β_s·R + (1-β_s)·Gᵀ G``; every ``precondition_frequency``
   Adam steps, each basis is refreshed by one power iteration and a QR step from the previous
   one, its columns first sorted by the estimated eigenvalues ``diag(Qᵀ L Q)`` (largest
   first), and ``V`` is re-ordered to the new order along that side
   (``raggedfsdp.optim.matrix_roots.refresh_eigenbasis``).

``β_s`` is ``shampoo_beta``, β₂ unless set (the authors' default). A block of N dims
(``tensor_factors="per_dim"``) keeps one factor per dim, ``F_i = β_s·F_i + (1-β_s)·G_(i)
G_(i)ᵀ`` with ``G_(i)`` the mode-``i`` unfolding, and rotates with ``Q_iᵀ`` along every dim
(``G' = G ×₀ Q_0ᵀ ×₁ Q_1ᵀ ⋯``, the matrix case being ``Q_Lᵀ G Q_R``). A dim without a factor
(a vector's second; a dim above ``max_preconditioner_dim`` with ``large_dims="skip"``) is
left as it is.

The authors' code keeps ``M`` in the rotated basis and rotates it back and forth around every
update of the basis; the bases are orthogonal, so that is this ``M`` and the two agree at every
``precondition_frequency`` (tests/support/soap_reference.py keeps ``M`` their way). Ours is
element-wise state split like the parameter.

Sharding is ``Shampoo``'s: ``SOAP.shard_policy()`` keeps every slab (row of blocks) on one rank,
so each rank rotates, updates and refreshes its own blocks and no optimizer byte moves; a forced
layout that cuts slabs sends each cut slab's ``G`` and ``M`` to its owner
(``raggedfsdp.optim.slabs``). Per-slab state (factors and bases per block, ``V`` per slab) is
split by whole slabs, so DCP reshards it. ``rms(N)`` is summed per slab where the slab is
computed and added up in slab order on every rank, so it too is the same at every world size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from raggedfsdp.comm.fingerprint import collective_device
from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.blocked import BLOCK_STATS, BlockedOptimizer
from raggedfsdp.optim.contract import Piece, StateSpec, check_unit_alignment
from raggedfsdp.optim.matrix_roots import descending_eigenbasis, refresh_eigenbasis
from raggedfsdp.optim.pieces import unwrap
from raggedfsdp.optim.slabs import SlabTask, SlabWork
from raggedfsdp.optim.soap_blocks import (
    LargeDims,
    SoapBlocks,
    TensorFactors,
    check_layout_options,
    soap_policy,
)
from raggedfsdp.sharding import ShardPolicy
from raggedfsdp.sharding.tp_shard import tp_split_of
from raggedfsdp.sharding.units import check_preconditioner_dim

__all__ = ["SOAP"]

_STATS = (*BLOCK_STATS, "basis_refreshes")
#: The authors' guard in ``N / (10⁻³⁰ + rms(N))``.
_RMS_GUARD = 1e-30


# ----------------------------------------------------------------------------- the math
def resolve_shampoo_beta(shampoo_beta: float | None, beta2: float) -> float:
    """``β_s``: ``shampoo_beta``, or β₂ when it is None or negative (the authors' ``-1``)."""
    return beta2 if shampoo_beta is None or shampoo_beta < 0 else shampoo_beta


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
        shampoo_beta = resolve_shampoo_beta(group["shampoo_beta"], beta2)
        refresh = t > 0 and t % group["precondition_frequency"] == 0
        return cls(t, beta1, beta2, shampoo_beta, group["eps"], refresh, batching)


@dataclass
class _Block:
    """One block's state, views into its slab's: ``V`` (its rotated second moment, one dim per
    block dim) and per dim a factor and a basis, None for a dim without one (edge blocks use
    the top-left corner of their zero-padded storage)."""

    V: Tensor
    factors: list[Tensor | None]
    bases: list[Tensor | None]

    @classmethod
    def of(
        cls, state: dict[str, Tensor], b: SoapBlocks, k: int, j: int, rows: int
    ) -> tuple[_Block, tuple[slice, ...]]:
        """Block ``j`` of this rank's ``k``-th slab (``rows`` rows), and where it lies in the
        slab viewed ``(rows, *dims[1:])``."""
        where = (slice(0, rows), *b.block_slices(j))
        v = state["exp_avg_sq"][k, :rows].view(rows, *b.dims[1:])[where]
        factors: list[Tensor | None] = [None] * v.dim()
        bases: list[Tensor | None] = [None] * v.dim()
        for dim, key in zip(b.factored_dims, b.keys, strict=True):
            n = v.shape[dim]
            factors[dim] = state[f"factor_{key}"][k, j, :n, :n]
            bases[dim] = state[f"basis_{key}"][k, j, :n, :n]
        return cls(v, factors, bases), where

    def sides(self) -> list[tuple[Tensor, Tensor, int]]:
        """``(factor, basis, dim)`` of every factored dim."""
        return [
            (f, q, dim)
            for dim, (f, q) in enumerate(zip(self.factors, self.bases, strict=True))
            if f is not None and q is not None
        ]


def update_moment_(m: Tensor, g: Tensor, beta1: float) -> None:
    """Step 1: ``M = β₁·M + (1-β₁)·g`` in place."""
    m.mul_(beta1).add_(g, alpha=1 - beta1)


def along(x: Tensor, m: Tensor, dim: int) -> Tensor:
    """The mode product ``X ×_dim m``: ``m`` times every fibre of ``X`` along ``dim`` (``m X``
    for dim 0 and ``X mᵀ`` for the last dim of a matrix)."""
    if dim == 0:
        return (m @ x.reshape(x.shape[0], -1)).view(m.shape[0], *x.shape[1:])
    return (x.movedim(dim, -1) @ m.T).movedim(-1, dim)


def rotate(x: Tensor, block: _Block) -> Tensor:
    """``X ×_i Q_iᵀ`` along every factored dim (``Q_Lᵀ X Q_R`` for a matrix)."""
    for _, q, dim in block.sides():
        x = along(x, q.T, dim)
    return x


def rotate_back(x: Tensor, block: _Block) -> Tensor:
    """``X ×_i Q_i`` along every factored dim (``Q_L X Q_Rᵀ`` for a matrix)."""
    for _, q, dim in block.sides():
        x = along(x, q, dim)
    return x


def gram(g: Tensor, dim: int) -> Tensor:
    """``G_(dim) G_(dim)ᵀ`` of the mode-``dim`` unfolding (``G Gᵀ`` for dim 0 and ``Gᵀ G`` for
    the last dim of a matrix)."""
    if dim == g.dim() - 1:
        u = g.reshape(-1, g.shape[-1])
        return u.T @ u
    u = g.movedim(dim, 0).reshape(g.shape[dim], -1)
    return u @ u.T


def adam_direction_(v: Tensor, g: Tensor, m: Tensor, beta2: float, eps: float) -> Tensor:
    """Step 2's Adam: ``V = β₂·V + (1-β₂)·G²`` in place; returns ``M / (sqrt(V) + ε)``."""
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    return m / (v.sqrt() + eps)


def eigenbasis_direction(block: _Block, g: Tensor, m: Tensor, h: _Hyper) -> Tensor:
    """Step 2 on one block: rotate ``G`` and ``M``, Adam in the eigenbasis, rotate back."""
    n = adam_direction_(block.V, rotate(g, block), rotate(m, block), h.beta2, h.eps)
    return rotate_back(n, block)


def accumulate_factors_(block: _Block, g: Tensor, shampoo_beta: float) -> None:
    """Steps 0 and 4: ``F_i = β_s·F_i + (1-β_s)·G_(i) G_(i)ᵀ`` (``L``: ``G Gᵀ``, ``R``:
    ``Gᵀ G``)."""
    for factor, _, dim in block.sides():
        factor.mul_(shampoo_beta).add_(gram(g, dim), alpha=1 - shampoo_beta)


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


def sum_of_squares(x: Tensor) -> Tensor:
    """``Σ x²`` (step 3's ``rms``), accumulated in fp32 at least, as a float64 scalar."""
    return x.to(torch.promote_types(x.dtype, torch.float32)).square().sum().to(torch.float64)


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
        rows = task.inputs["grad"].shape[0]
        for j in range(b.blocks_per_slab):
            block, index = _Block.of(state, b, task.owned, j, rows)
            blocks.append(block)
            where.append((n, index))
    outs = [torch.zeros_like(task.inputs["grad"]) for task in tasks]
    for block, (n, index) in zip(blocks, where, strict=True):
        shape = (-1, *tasks[n].geometry.blocks.dims[1:])
        # fresh contiguous copies: the matmuls see the same memory layout on every rank
        g = _block_copy(tasks[n].inputs["grad"], shape, index, block.V.dtype)
        if h.t > 0:
            m = _block_copy(tasks[n].inputs["exp_avg"], shape, index, block.V.dtype)
            outs[n].view(shape)[index] = eigenbasis_direction(block, g, m, h)
            stats["blocks"] += 1
        accumulate_factors_(block, g, h.shampoo_beta)
        if h.refresh:
            refresh_bases_(block, stats)
    if h.t == 0:
        first_bases_(blocks, h, stats)
    return outs


def _block_copy(
    x: Tensor, shape: tuple[int, ...], index: tuple[slice, ...], dtype: torch.dtype
) -> Tensor:
    """A block of the slab ``x`` (viewed ``shape``) as a fresh contiguous ``dtype`` tensor."""
    return x.view(shape)[index].to(dtype, copy=True).contiguous()


# ----------------------------------------------------------------------------- the optimizer
class SOAP(BlockedOptimizer):
    """SOAP: Adam in the eigenbasis of Shampoo's factors, on Shampoo's block structure.

    The update is the module docstring's (the paper's Algorithm 3, numbered steps 0–4).
    Defaults are the paper's and the authors' code's: ``betas=(0.95, 0.95)``,
    ``shampoo_beta=None`` (β_s = β₂, the factors' EMA; a negative value means the same, as the
    authors' ``-1``), ``eps=1e-8``, ``weight_decay=0.01``, ``precondition_frequency=10``, bias
    correction on, ``lr=3e-3``, no ``normalize_grads``. ``max_preconditioner_dim=1024`` blocks
    large dims as ``Shampoo`` does; the authors' code instead leaves dims above its
    ``max_precond_dim`` (10,000) unpreconditioned, which ``large_dims="skip"`` does (with ``B``
    at least every dim the rules coincide).

    The authors' configuration is ``SOAP(params, max_preconditioner_dim=10_000,
    large_dims="skip", tensor_factors="per_dim")`` (``merge_dims`` and ``normalize_grads`` as
    theirs); each option is tested against a float64 loop of their algorithm.

    Args:
        params: parameters or named parameters (plain tensors, or ``RaggedTensor`` s for fsdp).
        normalize_grads: divide each parameter's update by its RMS before the step (the
            authors' option). The RMS is summed where each slab is computed, so tensors that
            are not preconditioned must lie whole on one rank: ``shard_policy(...,
            normalize_grads=True)`` keeps them whole, and a layout that cuts one is refused.
        max_preconditioner_dim, merge_dims, precondition_1d: the block structure, as
            ``Shampoo``'s (one value per optimizer: they decide the shard layout).
        large_dims: ``"block"`` (default) cuts dims above ``max_preconditioner_dim`` into
            blocks; ``"skip"`` (the authors') keeps no factor for them and never cuts, so a
            slab is the whole tensor.
        tensor_factors: ``"matrix"`` (default) preconditions a tensor of 3+ dims as its
            ``prod(leading dims) × last dim`` matrix (two factors); ``"per_dim"`` (the authors')
            keeps one factor per dim (of the merged shape with ``merge_dims``: their
            ``merge_dims=True``).
        batch_bases: run equal-size first eigendecompositions as one batched call, as
            ``Shampoo``'s ``batch_roots`` (None: on CPU only, bitwise the per-block results).
        factor_dtype: dtype of the factors, the bases and ``V``; ``None`` = fp32 (fp64 for fp64
            parameters).
        mesh: ranks for the drop-in mode (see ``ShardedOptimizer``).

    State: ``exp_avg`` (``M``, like the parameter); ``exp_avg_sq`` (``V``: like the parameter
    for tensors that are not preconditioned, else per slab ``(slabs, slab rows, cols)`` in the
    rotated basis); per block ``(slabs, blocks per slab, b, b)``, ``factor_L``/``factor_R`` and
    ``basis_L``/``basis_R`` for matrices, ``factor_<i>``/``basis_<i>`` per dim ``i`` for
    ``per_dim`` tensors of 3+ dims (only the dims that keep a factor). ``last_step_stats``:
    ``eigendecompositions``, ``eigh_cost``, ``eigh_batched``, ``fp64_retries``,
    ``root_failures`` (bases left as they were), ``basis_refreshes``, ``blocks``,
    ``owner_slabs``, ``bytes_sent`` / ``bytes_received`` / ``bytes_communicated`` (with
    ``normalize_grads``, including the per-slab sums' all-reduce).
    """

    _state_keys_depend_on = ("max_preconditioner_dim",)

    def __init__(
        self,
        params: Any,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 1024,
        correct_bias: bool = True,
        *,
        normalize_grads: bool = False,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        large_dims: LargeDims = "block",
        tensor_factors: TensorFactors = "matrix",
        batch_bases: bool | None = None,
        factor_dtype: torch.dtype | None = None,
        mesh: MeshLike = None,
    ) -> None:
        _check_args(lr, betas, shampoo_beta, eps, weight_decay, precondition_frequency)
        check_preconditioner_dim(max_preconditioner_dim)
        check_layout_options(large_dims, tensor_factors)
        self.batch_bases = batch_bases
        self.normalize_grads = bool(normalize_grads)
        self.large_dims = large_dims
        self.tensor_factors = tensor_factors
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

    # ----------------------------------------------------------------------------- layout
    @classmethod
    def shard_policy(
        cls,
        max_preconditioner_dim: int = 1024,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        *,
        large_dims: LargeDims = "block",
        tensor_factors: TensorFactors = "matrix",
        normalize_grads: bool = False,
    ) -> ShardPolicy:
        """One slab per unit for preconditioned tensors, so every block is whole on one rank;
        elements for the rest (whole tensors with ``normalize_grads``). Pass the optimizer's
        own layout options."""
        return soap_policy(
            max_preconditioner_dim,
            merge_dims,
            precondition_1d,
            large_dims,
            tensor_factors,
            normalize_grads,
        )

    def _policy(self) -> ShardPolicy:
        return self.shard_policy(
            self.max_preconditioner_dim,
            self.merge_dims,
            self.precondition_1d,
            large_dims=self.large_dims,
            tensor_factors=self.tensor_factors,
            normalize_grads=self.normalize_grads,
        )

    def _blocks_of_shape(self, shape: tuple[int, ...]) -> SoapBlocks | None:
        return SoapBlocks.of(
            shape,
            self.max_preconditioner_dim,
            self.merge_dims,
            self.precondition_1d,
            self.large_dims,
            self.tensor_factors,
        )

    def _check_piece(self, piece: Piece, group: dict[str, Any]) -> None:
        """``BlockedOptimizer``'s checks; with ``normalize_grads``, tensors that are not
        preconditioned whole on one rank (their ``Σ N²`` is one rank's, whatever the world),
        and no TP split (``rms(N)`` of a TP-split tensor would need its TP blocks' sums)."""
        tp = tp_split_of(piece.spec)
        if self.normalize_grads and tp is not None:
            raise ValueError(
                f"{self._split_by_tp(piece, tp)}: SOAP(normalize_grads=True) does not sum "
                "rms(N) over TP yet; use normalize_grads=False for TP parameters"
            )
        super()._check_piece(piece, group)
        if self.normalize_grads and not self._preconditioned(piece):
            why = "the whole tensor that SOAP(normalize_grads=True) sums (it is not preconditioned)"
            check_unit_alignment(piece, max(1, math.prod(piece.param.shape)), why)

    # ----------------------------------------------------------------------------- state
    def _state_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        specs = {"exp_avg": StateSpec(piece.numel, piece.param.dtype)}
        if not self._preconditioned(piece):
            return specs | {"exp_avg_sq": StateSpec(piece.numel, piece.param.dtype)}
        return specs | self._slab_specs(piece, group)

    def _slab_shapes(self, blocks: SoapBlocks, group: dict[str, Any]) -> dict[str, tuple]:
        """``V`` per slab, then factors and bases per block."""
        sides = list(zip(blocks.factored_dims, blocks.keys, strict=True))
        shapes = {"exp_avg_sq": (blocks.num_slabs, blocks.slab_rows, blocks.cols)}
        shapes |= {f"factor_{key}": blocks.factor_shape(dim) for dim, key in sides}
        return shapes | {f"basis_{key}": blocks.factor_shape(dim) for dim, key in sides}

    # ----------------------------------------------------------------------------- update
    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        """Step 1 per piece; 0, 2 and 4 per block where it lies or on its owner; plain Adam's
        step 2 per piece that is not preconditioned; 3 per piece."""
        h = _Hyper.of(group, step, self.batch_bases)
        stats = self._stats(_STATS)
        work = [self._first_moment(pc, h) for pc in pieces]
        slab_sums: dict[tuple[Piece, int], Tensor] = {}
        blocked = [w for w in work if self._preconditioned(w.piece)]
        if blocked:

            def compute(tasks: list[SlabTask]) -> list[Tensor]:
                outs = soap_slabs(tasks, self._slab_state, h, stats)
                if self.normalize_grads and h.t > 0:
                    for task, out in zip(tasks, outs, strict=True):
                        slab_sums[task.piece, task.slab] = sum_of_squares(out)
                return outs

            self._run_slabs(blocked, compute, stats)
        if h.t == 0:
            return
        for w in work:
            if not self._preconditioned(w.piece):
                v = unwrap(self.state[w.piece.param]["exp_avg_sq"]).view(-1)
                w.out = adam_direction_(v, w.inputs["grad"], w.inputs["exp_avg"], h.beta2, h.eps)
        scales = [1.0] * len(work)
        if self.normalize_grads:
            scales = [1 / (_RMS_GUARD + rms) for rms in self._update_rms(work, slab_sums, stats)]
        for w, scale in zip(work, scales, strict=True):
            self._apply(w, group, h, scale)

    def _first_moment(self, pc: Piece, h: _Hyper) -> SlabWork:
        """Step 1 on this rank's piece (not on the first call); the piece's inputs."""
        g = pc.local_grad().view(-1)
        m = unwrap(self.state[pc.param]["exp_avg"]).view(-1)
        if h.t > 0:
            update_moment_(m, g, h.beta1)
        return SlabWork(pc, {"grad": g, "exp_avg": m}, torch.empty_like(m))

    def _update_rms(
        self,
        work: Sequence[SlabWork],
        slab_sums: dict[tuple[Piece, int], Tensor],
        stats: dict[str, int],
    ) -> list[float]:
        """Step 3's ``rms(N)`` of every parameter, the same at every world size: ``Σ N²`` per
        slab (per tensor where it is not preconditioned) on the one rank that computed it, one
        all-reduce per process group (each entry is one rank's value plus zeros, so exact),
        then the entries added in slab order on every rank."""
        parts = []
        for w in work:
            if self._preconditioned(w.piece):
                zero = torch.zeros((), dtype=torch.float64, device=w.out.device)
                slabs = range(self._geometry(w.piece).blocks.num_slabs)
                parts.append(torch.stack([slab_sums.get((w.piece, i), zero) for i in slabs]))
            else:  # whole here, or empty (a sum of zero)
                parts.append(sum_of_squares(w.out).view(1))
        members: dict[int, list[int]] = {}
        for n, w in enumerate(work):
            members.setdefault(id(w.piece.pgroup), []).append(n)
        totals = [0.0] * len(work)
        for ns in members.values():
            flat = torch.cat([parts[n] for n in ns])
            first = work[ns[0]].piece
            pgroup = first.pgroup  # None: the default group (or one process)
            if first.spec is not None and first.spec.world_size > 1:
                flat = flat.to(collective_device(pgroup))
                dist.all_reduce(flat, group=pgroup)
                stats["bytes_sent"] += flat.numel() * flat.element_size()
                stats["bytes_received"] += flat.numel() * flat.element_size()
            chunks = flat.split([parts[n].numel() for n in ns])
            for n, total in zip(ns, torch.stack([c.sum() for c in chunks]).tolist(), strict=True):
                totals[n] = total
        return [
            math.sqrt(total / max(1, math.prod(w.piece.param.shape)))
            for total, w in zip(totals, work, strict=True)
        ]

    def _apply(self, w: SlabWork, group: dict[str, Any], h: _Hyper, scale: float) -> None:
        """Step 3: ``p ← p - η·scale·N`` (``scale`` 1, or ``1 / (10⁻³⁰ + rms(N))`` with
        ``normalize_grads``), then decoupled weight decay."""
        p = w.piece.local().view(-1)
        lr = group["lr"]
        step_size = lr
        if group["correct_bias"]:
            step_size = lr * (1 - h.beta2**h.t) ** 0.5 / (1 - h.beta1**h.t)
        p.add_(w.out.to(p.dtype), alpha=-step_size * scale)
        if group["weight_decay"]:
            p.add_(p, alpha=-lr * group["weight_decay"])


def _check_args(
    lr: float,
    betas: Sequence[float],
    shampoo_beta: float | None,
    eps: float,
    weight_decay: float,
    precondition_frequency: int,
) -> None:
    """Argument checks, each naming the argument and its range."""
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}. Must be >= 0.0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas!r}. Must be (beta1, beta2), each in [0.0, 1.0)")
    if shampoo_beta is not None and not shampoo_beta < 1.0:
        raise ValueError(
            f"Invalid shampoo_beta: {shampoo_beta}. Must be in [0.0, 1.0), or None (or negative) "
            "for betas[1]"
        )
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
