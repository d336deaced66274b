"""``Shampoo``: blocked Shampoo with Adam grafting whose blocks follow the global shape.

The rule is facebookresearch's DistributedShampoo with its defaults (see ``Shampoo``, whose
numbered steps are the functions at the top of this file), with one structural choice that makes
it shard well: blocks are cut from the *global* parameter shape, never from a rank's shard, so
the world size cannot change the math.

A parameter of two or more dims is viewed as a ``rows × cols`` matrix (``cols`` = last dim, as
``row_numel``) and cut into a grid of blocks of at most ``B × B``, ``B = max_preconditioner_dim``
(``raggedfsdp.sharding.blocks.ShampooBlocks``). A *slab* is one row of blocks (``min(B, rows)``
whole rows). ``Shampoo.shard_policy`` declares a slab as the shard unit, so under
``fully_shard(..., shard_policy=Shampoo.shard_policy())`` and in the drop-in mode every block lies
whole on one rank: factors, inverse roots and preconditioning are local and no optimizer byte
crosses the network; the layout itself spreads the eigendecompositions over ranks.

If a user forces a layout that cuts slabs (element units, say), the math does not change: each cut
slab is computed by one *owner* (the rank holding its first element), which receives the slab's
pieces through one batched uneven all-to-all (``owner_compute.ExchangePlan``) and sends the
update direction back.

State and checkpoints: per-element state (filtered gradient, Adam grafting second moment,
momentum) is split like the parameter. Per-block state (factors ``L``, ``R`` and their inverse
roots) is stored per parameter as a global tensor of shape ``(slabs, blocks per slab, b, b)``
(``b = min(B, rows)`` for ``L``, ``min(B, cols)`` for ``R``; smaller edge blocks sit zero-padded
in the top-left corner), split by whole slabs: rank ``r`` holds the factors of the slabs whose
first element it holds. That split is a ``RaggedShard`` (consecutive slabs, rank order), so the
factors are ``RaggedTensor`` s that DCP saves and reloads at any other world size or layout, and
in the aligned case they sit exactly where their blocks are.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.base import ShardedOptimizer
from raggedfsdp.optim.contract import Piece, StateSpec
from raggedfsdp.optim.owner_compute import ExchangePlan
from raggedfsdp.optim.pieces import unwrap
from raggedfsdp.sharding import RaggedShard, ShardPolicy
from raggedfsdp.sharding.blocks import ShampooBlocks
from raggedfsdp.sharding.owners import Job
from raggedfsdp.sharding.units import check_preconditioner_dim, shampoo_blocked, shampoo_policy

__all__ = ["Shampoo"]

#: Added to the Shampoo direction's norm before grafting, as DistributedShampoo does.
_GRAFT_TINY = 1e-16

_PER_ELEMENT = ("filtered_grad", "grafting_v")
_FACTORS = ("factor_L", "factor_R", "inv_root_L", "inv_root_R")
#: What a slab's blocks read, and what travels to the owner of a cut slab: g, f̂ and a.
_INPUTS = ("grad", "filtered", "adam")
_STATS = (
    "eigendecompositions",
    "eigh_cost",
    "fp64_retries",
    "root_failures",
    "blocks",
    "owner_slabs",
    "bytes_sent",
    "bytes_received",
)


# ----------------------------------------------------------------------------- the math
@dataclass
class _Hyper:
    """One group's hyper-parameters at one step (``t`` counts from 1)."""

    t: int
    beta1: float
    beta2: float
    eps: float
    graft_beta2: float
    graft_eps: float
    bias_correction: bool
    compute_roots: bool
    use_shampoo: bool

    @classmethod
    def of(cls, group: dict[str, Any], step: Tensor) -> _Hyper:
        t = int(step.item()) + 1
        beta1, beta2 = group["betas"]
        return cls(
            t=t,
            beta1=beta1,
            beta2=beta2,
            eps=group["epsilon"],
            graft_beta2=group["grafting_beta2"],
            graft_eps=group["grafting_epsilon"],
            bias_correction=group["use_bias_correction"],
            compute_roots=t % group["precondition_frequency"] == 0,
            use_shampoo=t >= group["start_preconditioning_step"],
        )


@dataclass
class _Inputs:
    """What a slab's blocks read: the gradient ``g``, the filtered gradient ``f̂`` and the
    Adam direction ``a``, flat for a parameter's piece or ``rows × cols`` for a slab."""

    grad: Tensor
    filtered: Tensor
    adam: Tensor

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.grad, self.filtered, self.adam

    def slab(self, part: slice, cols: int) -> _Inputs:
        """``part`` of each flat tensor as a ``rows × cols`` view: one slab."""
        return _Inputs(*(x[part].view(-1, cols) for x in self.tensors()))


@dataclass
class _Block:
    """One block's factors and inverse roots: views into the slab's state (an edge block uses
    the top-left corner of its zero-padded ``b × b`` storage)."""

    L: Tensor
    R: Tensor
    L_inv: Tensor
    R_inv: Tensor

    @classmethod
    def of(cls, factors: dict[str, Tensor], slab: int, j: int, rows: int, cols: int) -> _Block:
        """Block ``j`` of slab ``slab`` (this rank's factor index) of ``rows × cols``."""
        left, right = slice(0, rows), slice(0, cols)
        return cls(
            factors["factor_L"][slab, j, left, left],
            factors["factor_R"][slab, j, right, right],
            factors["inv_root_L"][slab, j, left, left],
            factors["inv_root_R"][slab, j, right, right],
        )


def add_weight_decay(g: Tensor, p: Tensor, weight_decay: float) -> Tensor:
    """Step 1 (coupled weight decay only): ``g + weight_decay · p``, a new tensor."""
    return g + weight_decay * p


def update_grafting_(v: Tensor, g: Tensor, beta2: float) -> None:
    """Step 2: Adam grafting's ``v = β_g·v + (1-β_g)·g²`` (``v += g²`` when ``β_g = 1``)."""
    if beta2 == 1.0:
        v.addcmul_(g, g)
    else:
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def accumulate_factors_(block: _Block, g: Tensor, beta2: float) -> None:
    """Step 3: ``L = β₂·L + (1-β₂)·G Gᵀ`` and ``R = β₂·R + (1-β₂)·Gᵀ G`` for the block ``G``
    (plain sums when ``β₂ = 1``)."""
    for factor, outer in ((block.L, g @ g.T), (block.R, g.T @ g)):
        if beta2 == 1.0:
            factor.add_(outer)
        else:
            factor.mul_(beta2).add_(outer, alpha=1 - beta2)


def filter_gradient_(f: Tensor, g: Tensor, beta1: float, t: int, bias_correction: bool) -> Tensor:
    """Step 4: ``f = β₁·f + (1-β₁)·g`` in place; returns ``f̂ = f / (1-β₁ᵗ)`` (or a copy of
    ``f`` without bias correction), or a copy of ``g`` when ``β₁ = 0`` (``f`` untouched)."""
    if not beta1:
        return g.clone()
    f.mul_(beta1).add_(g, alpha=1 - beta1)
    return f / (1 - beta1**t) if bias_correction else f.clone()


def adam_direction(
    f_hat: Tensor, v: Tensor, t: int, beta2: float, eps: float, bias_correction: bool
) -> Tensor:
    """Step 5: ``a = f̂ / (sqrt(v / (1-β_gᵗ)) + grafting_epsilon)``."""
    v_hat = v / (1 - beta2**t) if bias_correction and beta2 < 1 else v
    return f_hat / (v_hat.sqrt() + eps)


def inverse_roots_(block: _Block, h: _Hyper, stats: dict[str, int]) -> None:
    """Step 6: ``L̂^{-1/4}`` and ``R̂^{-1/4}`` of the bias-corrected factors into the block's
    roots (``inverse_root_``)."""
    scale = 1 - h.beta2**h.t if h.bias_correction and h.beta2 < 1 else 1.0
    for factor, root in ((block.L, block.L_inv), (block.R, block.R_inv)):
        inverse_root_(factor / scale if scale != 1.0 else factor, h.eps, root, stats)


def inverse_root_(factor: Tensor, eps: float, out: Tensor, stats: dict[str, int]) -> None:
    """``out = factor^{-1/4}`` by eigendecomposition, eigenvalues made non-negative and shifted
    by ``eps``; fp64 retry when eigh fails; on failure ``out`` keeps its previous value."""
    n = factor.shape[0]
    stats["eigendecompositions"] += 1
    stats["eigh_cost"] += n**3
    matrix = factor.contiguous()
    result = None
    if torch.isfinite(matrix).all():
        try:
            lam, q = torch.linalg.eigh(matrix)
        except RuntimeError:
            lam = q = None
            if matrix.dtype != torch.float64:
                stats["fp64_retries"] += 1
                with contextlib.suppress(RuntimeError):
                    lam, q = torch.linalg.eigh(matrix.double())
        if lam is not None:
            lam = lam - torch.clamp(lam.min(), max=0.0) + eps
            root = (q * lam.pow(-0.25).unsqueeze(0)) @ q.T
            if torch.isfinite(root).all():
                result = root.to(out.dtype)
    if result is None:
        stats["root_failures"] += 1
        return
    out.copy_(result)


def precondition(block: _Block, f_hat: Tensor) -> Tensor:
    """Step 7: ``s = L̂^{-1/4} F̂ R̂^{-1/4}`` for the block's filtered gradient ``F̂``."""
    fb = f_hat.to(block.L.dtype, copy=True).contiguous()
    return block.L_inv.contiguous() @ fb @ block.R_inv.contiguous()


def graft(s: Tensor, a: Tensor) -> Tensor:
    """Step 7: ``s`` scaled to the Adam direction's norm, ``s · ‖a‖ / (‖s‖ + 1e-16)``."""
    a_norm = torch.linalg.vector_norm(a.to(s.dtype))
    return s * (a_norm / (torch.linalg.vector_norm(s) + _GRAFT_TINY))


def add_momentum_(
    d: Tensor, m: Tensor, momentum: float, dampening: float, nesterov: bool
) -> Tensor:
    """Step 8: ``m = μ·m + (1-dampening)·d`` in place; returns ``d + μ·m`` (Nesterov) or
    ``m``."""
    m.mul_(momentum).add_(d, alpha=1 - dampening)
    return d.add(m, alpha=momentum) if nesterov else m


def shampoo_block(
    block: _Block, g: Tensor, f_hat: Tensor, a: Tensor, h: _Hyper, stats: dict[str, int]
) -> Tensor | None:
    """Steps 3, 6 and 7 on one block (``g``, ``f̂``, ``a`` its ``rows × cols`` views): update its
    factors, recompute its roots when due, and return its grafted Shampoo direction, or None
    before ``start_preconditioning_step`` (the Adam direction stays)."""
    # a fresh contiguous copy: the matmuls see the same memory layout on every rank
    accumulate_factors_(block, g.to(block.L.dtype, copy=True).contiguous(), h.beta2)
    if h.compute_roots:
        inverse_roots_(block, h, stats)
    if not h.use_shampoo:
        return None
    stats["blocks"] += 1
    return graft(precondition(block, f_hat), a)


def shampoo_slab(
    blocks: ShampooBlocks,
    factors: dict[str, Tensor],
    k: int,
    inputs: _Inputs,
    h: _Hyper,
    stats: dict[str, int],
) -> Tensor:
    """``shampoo_block`` on every block of one slab (``k``: its index in this rank's
    ``factors``; ``inputs`` its ``rows × cols`` views); returns the slab's direction."""
    rows = inputs.grad.shape[0]
    out = inputs.adam.clone()
    for j in range(blocks.col_blocks):
        cols = slice(j * blocks.block_cols, min((j + 1) * blocks.block_cols, blocks.cols))
        block = _Block.of(factors, k, j, rows, cols.stop - cols.start)
        d = shampoo_block(block, *(x[:, cols] for x in inputs.tensors()), h, stats)
        if d is not None:
            out[:, cols] = d
    return out


# ----------------------------------------------------------------------------- bookkeeping
@dataclass
class _Work:
    """One parameter's step on this rank after steps 1–5: ``param`` its flat local values
    (updated in place at step 8), ``direction`` the Adam direction that steps 3–7 overwrite
    with Shampoo's on its blocks."""

    piece: Piece
    param: Tensor
    inputs: _Inputs
    direction: Tensor


@dataclass
class _Geometry:
    """A blocked parameter's ``ShampooBlocks`` and this rank's place in them."""

    blocks: ShampooBlocks
    bounds: list[int]  # rank r holds [bounds[r], bounds[r + 1]) of the flat parameter
    rank: int
    owners: list[int]  # owner rank of every slab (holder of its first element)
    first_owned: int  # first slab this rank owns (its factors' first index)
    num_owned: int
    factor_shards: dict[str, RaggedShard | None] = field(default_factory=dict)

    def held(self, i: int) -> slice:
        """This rank's part of slab ``i``, in its local flat view of the parameter."""
        start, stop = self.blocks.slab_range(i)
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        return slice(max(start, lo) - lo, min(stop, hi) - lo)

    def is_local(self, i: int) -> bool:
        start, stop = self.blocks.slab_range(i)
        return self.bounds[self.rank] <= start and stop <= self.bounds[self.rank + 1]


@dataclass
class _CutSlabs:
    """The slabs of one param group that a forced layout cut, and their exchange."""

    plan: ExchangePlan
    slabs: list[tuple[Piece, int]]  # (piece, slab index) per job


# ----------------------------------------------------------------------------- the optimizer
class Shampoo(ShardedOptimizer):
    """Blocked Shampoo with Adam grafting, the rule of facebookresearch's DistributedShampoo.

    Per step ``t`` (from 1) and parameter ``p`` with gradient ``g``:

    1. (``use_decoupled_weight_decay=False`` only) ``g += weight_decay · p``.
    2. Adam grafting state: ``v = β_g·v + (1-β_g)·g²`` (``v += g²`` when ``β_g = 1``).
    3. For each ``B × B`` block ``G`` of ``g``: ``L = β₂·L + (1-β₂)·G Gᵀ``, ``R = β₂·R +
       (1-β₂)·Gᵀ G`` (plain sums when ``β₂ = 1``, the default).
    4. Filtered gradient ``f = β₁·f + (1-β₁)·g``, bias-corrected ``f̂ = f / (1-β₁ᵗ)``
       (``f̂ = g`` when ``β₁ = 0``).
    5. Adam direction ``a = f̂ / (sqrt(v / (1-β_gᵗ)) + grafting_epsilon)``.
    6. Every ``precondition_frequency`` steps (``t % frequency == 0``): the inverse roots
       ``L̂^{-1/4}``, ``R̂^{-1/4}`` of ``L̂ = L / (1-β₂ᵗ)`` (no correction when ``β₂ = 1``) by
       symmetric eigendecomposition in the factor dtype (fp32, retried in fp64 when it fails);
       eigenvalues ``λ ← λ - min(λ_min, 0) + epsilon`` (made non-negative, then shifted by
       epsilon). A failure in fp64 too, or a non-finite result, keeps the previous roots and is
       counted in ``last_step_stats["root_failures"]``.
    7. From ``t ≥ start_preconditioning_step``: per block ``s = L̂^{-1/4} F̂ R̂^{-1/4}`` scaled to
       the Adam direction's norm, ``d = s · ‖a‖ / (‖s‖ + 1e-16)``; before that (and for
       parameters of fewer than two dims, always) ``d = a``.
    8. ``d += weight_decay · p`` (decoupled), momentum ``m = μ·m + (1-dampening)·d`` and
       ``d = d + μ·m`` (Nesterov) or ``d = m``; ``p -= lr · d``.

    Defaults (DistributedShampoo's): ``lr=1e-2``, ``betas=(0.9, 1.0)``, ``epsilon=1e-12``,
    ``momentum=0``, ``dampening=0``, ``weight_decay=0``, ``max_preconditioner_dim=1024``,
    ``precondition_frequency=1``, ``start_preconditioning_step=-1`` (meaning
    ``precondition_frequency``), ``use_nesterov=False``, ``use_bias_correction=True``,
    ``use_decoupled_weight_decay=True``, Adam grafting with ``grafting_beta2=0.99``,
    ``grafting_epsilon=1e-10`` (``AdamGraftingConfig``'s defaults). Factors and roots are kept in
    ``factor_dtype`` (default fp32, or fp64 for fp64 parameters).

    Differences from the reference, on purpose: dims are **not merged** (the reference merges
    small dims, e.g. a 10×6 matrix into one 60-vector); tensors of 3+ dims are viewed as
    ``prod(leading dims) × last dim`` matrices (the reference keeps one factor per dim); 1-D
    parameters use the grafting method only; the filtered-gradient state always exists.

    Args:
        params: parameters or named parameters (plain tensors, or ``RaggedTensor`` s for fsdp).
        max_preconditioner_dim: ``B``, the largest block side (≥ 1). One value per optimizer,
            since it decides the shard layout.
        factor_dtype: dtype of factors and roots; ``None`` = fp32, fp64 for fp64 parameters.
        mesh: ranks for the drop-in mode (see ``ShardedOptimizer``).

    After each step ``last_step_stats`` holds this rank's counts: ``eigendecompositions``,
    ``eigh_cost`` (Σ n³ over them), ``fp64_retries``, ``root_failures``, ``blocks``
    (preconditioned here), ``owner_slabs`` (cut slabs computed here) and ``bytes_sent`` /
    ``bytes_received`` / ``bytes_communicated`` (optimizer bytes to or from other ranks).
    """

    _state_keys_depend_on = ("max_preconditioner_dim", "momentum")

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int = -1,
        use_nesterov: bool = False,
        use_bias_correction: bool = True,
        use_decoupled_weight_decay: bool = True,
        grafting_beta2: float = 0.99,
        grafting_epsilon: float = 1e-10,
        *,
        factor_dtype: torch.dtype | None = None,
        mesh: MeshLike = None,
    ) -> None:
        _check_args(
            lr,
            betas,
            epsilon,
            momentum,
            dampening,
            weight_decay,
            max_preconditioner_dim,
            precondition_frequency,
            start_preconditioning_step,
            grafting_beta2,
            grafting_epsilon,
        )
        if start_preconditioning_step == -1:
            start_preconditioning_step = precondition_frequency
        if factor_dtype is not None and not factor_dtype.is_floating_point:
            raise ValueError(f"factor_dtype={factor_dtype} must be a floating-point dtype")
        self.max_preconditioner_dim = max_preconditioner_dim
        self.factor_dtype = factor_dtype
        self._geometries: dict[Piece, _Geometry] = {}
        self._cut: dict[tuple[str, ...], _CutSlabs] = {}
        self.last_step_stats: dict[str, int] = {}
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "epsilon": epsilon,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "max_preconditioner_dim": max_preconditioner_dim,
            "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start_preconditioning_step,
            "use_nesterov": use_nesterov,
            "use_bias_correction": use_bias_correction,
            "use_decoupled_weight_decay": use_decoupled_weight_decay,
            "grafting_beta2": grafting_beta2,
            "grafting_epsilon": grafting_epsilon,
        }
        super().__init__(params, defaults, mesh=mesh)

    # ----------------------------------------------------------------------------- layout
    @classmethod
    def shard_policy(cls, max_preconditioner_dim: int = 1024) -> ShardPolicy:
        """One slab (``min(B, rows)`` whole rows) per unit for parameters of two or more dims, so
        every ``B × B`` block is whole on one rank; elements for the rest (Adam-grafted only)."""
        return shampoo_policy(max_preconditioner_dim)

    def _policy(self) -> ShardPolicy:
        return self.shard_policy(self.max_preconditioner_dim)

    def _check_piece(self, piece: Piece, group: dict[str, Any]) -> None:
        if not piece.param.is_floating_point():
            raise ValueError(
                f"parameter {piece.name!r} has dtype {piece.param.dtype}; Shampoo needs floating "
                "point parameters"
            )
        if group["max_preconditioner_dim"] != self.max_preconditioner_dim:
            raise ValueError(
                f"param group of {piece.name!r} sets max_preconditioner_dim="
                f"{group['max_preconditioner_dim']!r}, but it decides the shard layout and must "
                f"be the optimizer's ({self.max_preconditioner_dim})"
            )
        if piece.mode == "single" and not piece.param.is_contiguous():
            raise ValueError(
                f"parameter {piece.name!r} is not contiguous; Shampoo views it as a matrix "
                "(p.data = p.data.contiguous())"
            )

    def _geometry(self, piece: Piece) -> _Geometry:
        """Blocks of a parameter (of ≥ 2 dims), its slab owners and its factor splits."""
        if piece in self._geometries:
            return self._geometries[piece]
        blocks = ShampooBlocks.of(piece.param.shape, self.max_preconditioner_dim)
        spec = piece.spec
        bounds = [0, blocks.rows * blocks.cols] if spec is None else list(spec.bounds)
        counts = [blocks.slabs_starting_in(a, b) for a, b in itertools.pairwise(bounds)]
        geo = _Geometry(
            blocks,
            bounds,
            piece.rank,
            blocks.slab_owners(bounds),
            sum(counts[: piece.rank]),
            counts[piece.rank],
        )
        for key in _FACTORS:
            geo.factor_shards[key] = (
                None
                if spec is None
                else RaggedShard.from_counts(
                    blocks.factor_shape(key[-1]),
                    blocks.factor_numel_per_slab(key[-1]),
                    counts,
                    f"{piece.name}.{key}",
                )
            )
        self._geometries[piece] = geo
        return geo

    # ----------------------------------------------------------------------------- state
    def _factor_dtype(self, piece: Piece) -> torch.dtype:
        if self.factor_dtype is not None:
            return self.factor_dtype
        return torch.promote_types(piece.param.dtype, torch.float32)

    def _state_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        keys = _PER_ELEMENT + (("momentum",) if group["momentum"] else ())
        specs = {key: StateSpec(piece.numel, piece.param.dtype) for key in keys}
        if not shampoo_blocked(piece.param.shape):
            return specs
        geo = self._geometry(piece)
        dtype = self._factor_dtype(piece)
        for key in _FACTORS:
            numel = geo.num_owned * geo.blocks.factor_numel_per_slab(key[-1])
            shape = geo.blocks.factor_shape(key[-1])
            specs[key] = StateSpec(numel, dtype, shape, geo.factor_shards[key])
        return specs

    def _new_step(self, group: dict[str, Any], device: torch.device) -> Tensor:
        return torch.tensor(0.0, dtype=torch.float32)

    def _factors(self, piece: Piece) -> dict[str, Tensor]:
        """This rank's factor tensors, ``(owned slabs, blocks per slab, b, b)``."""
        geo = self._geometry(piece)
        state = self.state[piece.param]
        out = {}
        for key in _FACTORS:
            _, col_blocks, side, _ = geo.blocks.factor_shape(key[-1])
            out[key] = unwrap(state[key]).view(geo.num_owned, col_blocks, side, side)
        return out

    # ----------------------------------------------------------------------------- update
    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        """Steps 1, 2, 4 and 5 per piece; 3, 6 and 7 per block, where the block lies or on
        its owner; 8 per piece."""
        h = _Hyper.of(group, step)
        stats = dict.fromkeys(_STATS, 0)
        work = [self._adam_direction(pc, group, h) for pc in pieces]
        blocked = [w for w in work if shampoo_blocked(w.piece.param.shape)]
        for w in blocked:
            self._whole_slabs(w, h, stats)
        self._cut_slabs(blocked, h, stats)
        for w in work:
            self._apply(w, group)
        stats["bytes_communicated"] = stats["bytes_sent"] + stats["bytes_received"]
        self.last_step_stats = stats

    def _adam_direction(self, pc: Piece, group: dict[str, Any], h: _Hyper) -> _Work:
        """Steps 1, 2, 4 and 5 on this rank's piece (element-wise, flat)."""
        p = pc.local().view(-1)
        g = pc.local_grad().view(-1)
        state = self.state[pc.param]
        if group["weight_decay"] and not group["use_decoupled_weight_decay"]:
            g = add_weight_decay(g, p, group["weight_decay"])
        v = unwrap(state["grafting_v"]).view(-1)
        update_grafting_(v, g, h.graft_beta2)
        f = unwrap(state["filtered_grad"]).view(-1)
        f_hat = filter_gradient_(f, g, h.beta1, h.t, h.bias_correction)
        a = adam_direction(f_hat, v, h.t, h.graft_beta2, h.graft_eps, h.bias_correction)
        return _Work(pc, p, _Inputs(g, f_hat, a), a.clone())

    def _whole_slabs(self, w: _Work, h: _Hyper, stats: dict[str, int]) -> None:
        """Steps 3, 6 and 7 on the slabs that lie whole on this rank."""
        geo = self._geometry(w.piece)
        factors = self._factors(w.piece)
        for i in range(geo.blocks.num_slabs):
            if not geo.is_local(i):
                continue
            held = geo.held(i)
            slab = w.inputs.slab(held, geo.blocks.cols)
            out = shampoo_slab(geo.blocks, factors, i - geo.first_owned, slab, h, stats)
            w.direction[held] = out.view(-1)

    def _cut_slabs(self, blocked: list[_Work], h: _Hyper, stats: dict[str, int]) -> None:
        """Steps 3, 6 and 7 on the slabs that a forced layout cut: ``g``, ``f̂`` and ``a`` go to
        the slab's owner, which runs ``shampoo_slab``, and the direction comes back."""
        cut = self._cut_plan([w.piece for w in blocked])
        if not cut.slabs:
            return
        work = {w.piece: w for w in blocked}
        like = blocked[0].inputs.grad
        group = cut.slabs[0][0].pgroup

        def held(name: str) -> Callable[[int], Tensor]:
            def part(j: int) -> Tensor:
                pc, i = cut.slabs[j]
                return getattr(work[pc].inputs, name)[self._geometry(pc).held(i)]

            return part

        owned = {name: cut.plan.to_owners(held(name), like, group)[1] for name in _INPUTS}
        outs = [self._owned_slab(cut, n, owned, h, stats) for n in range(len(owned["grad"]))]
        back = cut.plan.to_holders(torch.cat(outs) if outs else like.new_empty(0), group)
        for j, part in back.items():
            pc, i = cut.slabs[j]
            work[pc].direction[self._geometry(pc).held(i)] = part
        size = like.element_size()
        ex = cut.plan
        stats["bytes_sent"] += (3 * ex.elements_sent + ex.elements_received) * size
        stats["bytes_received"] += (3 * ex.elements_received + ex.elements_sent) * size

    def _owned_slab(
        self,
        cut: _CutSlabs,
        n: int,
        owned: dict[str, list[Tensor]],
        h: _Hyper,
        stats: dict[str, int],
    ) -> Tensor:
        """The flat direction of the ``n``-th cut slab this rank owns, from its assembled
        ``owned`` inputs."""
        pc, i = cut.slabs[cut.plan.owned_jobs[n]]
        geo = self._geometry(pc)
        inputs = _Inputs(*(owned[name][n] for name in _INPUTS)).slab(slice(None), geo.blocks.cols)
        out = shampoo_slab(geo.blocks, self._factors(pc), i - geo.first_owned, inputs, h, stats)
        stats["owner_slabs"] += 1
        return out.view(-1)

    def _cut_plan(self, pieces: list[Piece]) -> _CutSlabs:
        """Every cut slab of these pieces as an owner-compute job, the same on every rank
        (built from the global splits, then cached)."""
        key = tuple(pc.name for pc in pieces)
        if key in self._cut:
            return self._cut[key]
        jobs, slabs, groups = [], [], set()
        for pc in pieces:
            if pc.spec is None:
                continue  # single mode: every slab is whole
            geo = self._geometry(pc)
            for i in range(geo.blocks.num_slabs):
                start, stop = geo.blocks.slab_range(i)
                job = Job.spanning(start, stop, geo.bounds, float(stop - start))
                if job.sole_holder is None:
                    jobs.append(job)
                    slabs.append((pc, i))
                    groups.add(id(pc.pgroup))
        if len(groups) > 1:
            raise ValueError(
                "Shampoo: parameters whose blocks are cut by their layout must share one "
                "process group in a param group"
            )
        world = slabs[0][0].spec.world_size if slabs else 1
        rank = slabs[0][0].rank if slabs else 0
        owners = [self._geometry(pc).owners[i] for pc, i in slabs]
        self._cut[key] = _CutSlabs(ExchangePlan(jobs, owners, rank, world), slabs)
        return self._cut[key]

    def _apply(self, w: _Work, group: dict[str, Any]) -> None:
        """Step 8: decoupled weight decay, momentum, ``p -= lr · d``."""
        d = w.direction
        if group["weight_decay"] and group["use_decoupled_weight_decay"]:
            d.add_(w.param, alpha=group["weight_decay"])
        if group["momentum"]:
            m = unwrap(self.state[w.piece.param]["momentum"]).view(-1)
            d = add_momentum_(d, m, group["momentum"], group["dampening"], group["use_nesterov"])
        w.param.add_(d, alpha=-group["lr"])


def _check_args(
    lr: float,
    betas: Sequence[float],
    epsilon: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    max_preconditioner_dim: int,
    precondition_frequency: int,
    start_preconditioning_step: int,
    grafting_beta2: float,
    grafting_epsilon: float,
) -> None:
    """DistributedShampoo's argument checks (with the reason in each message)."""
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}. Must be >= 0.0")
    if len(betas) != 2:
        raise ValueError(f"betas={betas!r} must be (beta1, beta2)")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}. Must be in [0.0, 1.0)")
    if not 0.0 < betas[1] <= 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}. Must be in (0.0, 1.0]")
    if not epsilon > 0.0:
        raise ValueError(
            f"Invalid epsilon value: {epsilon}. Must be > 0.0 (it keeps the inverse roots of "
            "rank-deficient factors finite)"
        )
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum parameter: {momentum}. Must be in [0.0, 1.0)")
    if not 0.0 <= dampening < 1.0:
        raise ValueError(f"Invalid dampening parameter: {dampening}. Must be in [0.0, 1.0)")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}. Must be >= 0.0")
    check_preconditioner_dim(max_preconditioner_dim)
    if not isinstance(precondition_frequency, int) or precondition_frequency < 1:
        raise ValueError(
            f"Invalid precondition_frequency: {precondition_frequency!r}. Must be an int >= 1"
        )
    if start_preconditioning_step != -1 and (
        not isinstance(start_preconditioning_step, int)
        or start_preconditioning_step < precondition_frequency
    ):
        raise ValueError(
            f"Invalid start_preconditioning_step: {start_preconditioning_step!r}. Must be -1 "
            f"(= precondition_frequency) or >= precondition_frequency ({precondition_frequency})"
            ", so roots exist when preconditioning starts"
        )
    if not 0.0 < grafting_beta2 <= 1.0:
        raise ValueError(f"Invalid grafting_beta2: {grafting_beta2}. Must be in (0.0, 1.0]")
    if not grafting_epsilon > 0.0:
        raise ValueError(f"Invalid grafting_epsilon: {grafting_epsilon}. Must be > 0.0")
