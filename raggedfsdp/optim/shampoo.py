"""``Shampoo``: blocked Shampoo with Adam grafting whose blocks follow the global shape.

The rule is facebookresearch's DistributedShampoo with its defaults (see ``Shampoo``), with one
structural choice that makes it shard well: blocks are cut from the *global* parameter shape,
never from a rank's shard, so the world size cannot change the math.

A parameter of two or more dims is viewed as a ``rows × cols`` matrix (``cols`` = last dim, as
``row_numel``) and cut into a grid of blocks of at most ``B × B``, ``B = max_preconditioner_dim``.
A *slab* is one row of blocks (``min(B, rows)`` whole rows). ``Shampoo.shard_policy`` declares a
slab as the shard unit, so under ``fully_shard(..., shard_policy=Shampoo.shard_policy())`` and in
the drop-in mode every block lies whole on one rank: factors, inverse roots and preconditioning
are local and no optimizer byte crosses the network; the layout itself spreads the
eigendecompositions over ranks.

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
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.base import ShardedOptimizer, StateSpec
from raggedfsdp.optim.owner_compute import ExchangePlan, Job
from raggedfsdp.optim.pieces import Piece, unwrap
from raggedfsdp.sharding import RaggedShard, ShardPolicy, row_numel

__all__ = ["Shampoo"]

#: Added to the Shampoo direction's norm before grafting, as DistributedShampoo does.
_GRAFT_TINY = 1e-16

_PER_ELEMENT = ("filtered_grad", "grafting_v")
_FACTORS = ("factor_L", "factor_R", "inv_root_L", "inv_root_R")


def _blocked(shape: Sequence[int]) -> bool:
    return len(shape) >= 2 and math.prod(shape) > 0


def _slab_rows(shape: Sequence[int], block: int) -> int:
    return min(block, math.prod(shape) // row_numel(shape))


@dataclass
class _Geometry:
    """Blocks of one parameter and which of them this rank holds and owns."""

    rows: int
    cols: int
    br: int  # rows per slab (block height)
    bc: int  # block width
    num_slabs: int
    col_blocks: int
    lo: int  # this rank's flat range of the parameter
    hi: int
    owners: list[int]  # owner rank of every slab (holder of its first element)
    first_owned: int  # first slab this rank owns (its factors' first index)
    num_owned: int
    factor_shards: dict[str, RaggedShard | None] = field(default_factory=dict)

    @property
    def slab_numel(self) -> int:
        return self.br * self.cols

    def slab_range(self, i: int) -> tuple[int, int]:
        start = i * self.slab_numel
        return start, min(start + self.slab_numel, self.rows * self.cols)

    def is_local(self, i: int) -> bool:
        start, stop = self.slab_range(i)
        return self.lo <= start and stop <= self.hi


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
        self._plans: dict[tuple[str, ...], tuple[ExchangePlan, list[tuple[Piece, int]]]] = {}
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
        _check_block(max_preconditioner_dim)

        def unit(fqn: str, param: Any) -> int:
            shape = tuple(param.shape)
            if not _blocked(shape):
                return 1
            return _slab_rows(shape, max_preconditioner_dim) * row_numel(shape)

        return unit

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

    def _factor_dtype(self, piece: Piece) -> torch.dtype:
        if self.factor_dtype is not None:
            return self.factor_dtype
        return torch.promote_types(piece.param.dtype, torch.float32)

    def _geometry(self, piece: Piece) -> _Geometry:
        """Blocks of a parameter (of ≥ 2 dims), its slab owners and its factor splits."""
        if piece in self._geometries:
            return self._geometries[piece]
        shape = tuple(piece.param.shape)
        cols = row_numel(shape)
        rows = math.prod(shape) // cols
        br, bc = (
            _slab_rows(shape, self.max_preconditioner_dim),
            min(self.max_preconditioner_dim, cols),
        )
        num_slabs, col_blocks = -(-rows // br), -(-cols // bc)
        spec = piece.spec
        world = 1 if spec is None else spec.world_size
        ranges = [(0, rows * cols)] if spec is None else [spec.local_range(r) for r in range(world)]
        owners = []
        for i in range(num_slabs):
            start = i * br * cols
            owners.append(next(r for r, (a, b) in enumerate(ranges) if a <= start < b))
        counts = [owners.count(r) for r in range(world)]
        lo, hi = ranges[piece.rank]
        geo = _Geometry(
            rows,
            cols,
            br,
            bc,
            num_slabs,
            col_blocks,
            lo,
            hi,
            owners,
            sum(counts[: piece.rank]),
            counts[piece.rank],
        )
        for key in _FACTORS:
            side = br if key.endswith("L") else bc
            fshape = (num_slabs, col_blocks, side, side)
            geo.factor_shards[key] = (
                None
                if spec is None
                else RaggedShard.from_counts(
                    fshape, col_blocks * side * side, counts, f"{piece.name}.{key}"
                )
            )
        self._geometries[piece] = geo
        return geo

    # ----------------------------------------------------------------------------- state
    def _state_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        keys = _PER_ELEMENT + (("momentum",) if group["momentum"] else ())
        specs = {key: StateSpec(piece.numel, piece.param.dtype) for key in keys}
        if not _blocked(piece.param.shape):
            return specs
        geo = self._geometry(piece)
        dtype = self._factor_dtype(piece)
        for key in _FACTORS:
            side = geo.br if key.endswith("L") else geo.bc
            shape = (geo.num_slabs, geo.col_blocks, side, side)
            owned = geo.num_owned if piece.sharded else geo.num_slabs
            specs[key] = StateSpec(
                owned * geo.col_blocks * side * side, dtype, shape, geo.factor_shards[key]
            )
        return specs

    def _new_step(self, group: dict[str, Any], device: torch.device) -> Tensor:
        return torch.tensor(0.0, dtype=torch.float32)

    def _factors(self, piece: Piece) -> dict[str, Tensor]:
        """This rank's factor tensors, ``(owned slabs, blocks per slab, b, b)``."""
        geo = self._geometry(piece)
        state = self.state[piece.param]
        out = {}
        for key in _FACTORS:
            side = geo.br if key.endswith("L") else geo.bc
            n = geo.num_owned if piece.sharded else geo.num_slabs
            out[key] = unwrap(state[key]).view(n, geo.col_blocks, side, side)
        return out

    # ----------------------------------------------------------------------------- update
    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        t = int(step.item()) + 1
        beta1, beta2 = group["betas"]
        h = _Hyper(
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
        stats = dict.fromkeys(
            (
                "eigendecompositions",
                "eigh_cost",
                "fp64_retries",
                "root_failures",
                "blocks",
                "owner_slabs",
                "bytes_sent",
                "bytes_received",
            ),
            0,
        )
        wd = group["weight_decay"]
        decoupled = group["use_decoupled_weight_decay"]
        work = []  # (piece, param, grad, f̂, a, d), all 1-D local views / fresh tensors
        for pc in pieces:
            p = pc.local().view(-1)
            g = pc.local_grad().view(-1)
            state = self.state[pc.param]
            if wd and not decoupled:
                g = g + wd * p
            v = unwrap(state["grafting_v"]).view(-1)
            if h.graft_beta2 == 1.0:
                v.addcmul_(g, g)
            else:
                v.mul_(h.graft_beta2).addcmul_(g, g, value=1 - h.graft_beta2)
            if h.beta1:
                f = unwrap(state["filtered_grad"]).view(-1)
                f.mul_(h.beta1).add_(g, alpha=1 - h.beta1)
                f_hat = f / (1 - h.beta1**t) if h.bias_correction else f.clone()
            else:
                f_hat = g.clone()
            v_hat = v / (1 - h.graft_beta2**t) if h.bias_correction and h.graft_beta2 < 1 else v
            a = f_hat / (v_hat.sqrt() + h.graft_eps)
            work.append((pc, p, g, f_hat, a, a.clone()))
        self._precondition(work, h, stats)
        for pc, p, _, _, _, d in work:
            if wd and decoupled:
                d.add_(p, alpha=wd)
            mu = group["momentum"]
            if mu:
                m = unwrap(self.state[pc.param]["momentum"]).view(-1)
                m.mul_(mu).add_(d, alpha=1 - group["dampening"])
                d = d.add(m, alpha=mu) if group["use_nesterov"] else m
            p.add_(d, alpha=-group["lr"])
        stats["bytes_communicated"] = stats["bytes_sent"] + stats["bytes_received"]
        self.last_step_stats = stats

    def _precondition(self, work: list, h: _Hyper, stats: dict[str, int]) -> None:
        """Update factors and overwrite ``d`` with the grafted Shampoo direction on every block:
        locally for whole slabs, through the owners for cut ones."""
        blocked = [w for w in work if _blocked(w[0].param.shape)]
        for pc, _, g, f_hat, a, d in blocked:
            geo = self._geometry(pc)
            facs = self._factors(pc)
            for i in range(geo.num_slabs):
                if not geo.is_local(i):
                    continue
                start, stop = geo.slab_range(i)
                rows = (stop - start) // geo.cols
                sl = slice(start - geo.lo, stop - geo.lo)
                out = self._slab(
                    geo,
                    facs,
                    i - geo.first_owned if pc.sharded else i,
                    *(x[sl].view(rows, geo.cols) for x in (g, f_hat, a)),
                    h,
                    stats,
                )
                d[sl] = out.view(-1)
        self._owner_compute(blocked, h, stats)

    def _owner_compute(self, blocked: list, h: _Hyper, stats: dict[str, int]) -> None:
        """Slabs that a forced layout cut: move ``g``, ``f̂``, ``a`` to the owner, compute there,
        send ``d`` back. Every rank builds the same plan from the global splits."""
        key = tuple(w[0].name for w in blocked)
        if key not in self._plans:
            jobs, slabs, groups = [], [], set()
            for pc, *_ in blocked:
                geo = self._geometry(pc)
                spec = pc.spec
                for i in range(geo.num_slabs):
                    start, stop = geo.slab_range(i)
                    if spec is None or any(
                        a <= start and stop <= b
                        for a, b in (spec.local_range(r) for r in range(spec.world_size))
                    ):
                        continue  # whole on one rank
                    held = []
                    for r in range(spec.world_size):
                        a, b = spec.local_range(r)
                        n = min(b, stop) - max(a, start)
                        if n > 0:
                            held.append((r, n))
                    jobs.append(Job(tuple(held), float(stop - start)))
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
            self._plans[key] = (ExchangePlan(jobs, owners, rank, world), slabs)
        plan, slabs = self._plans[key]
        if not slabs:
            return
        by_piece = {w[0]: w for w in blocked}
        group = slabs[0][0].pgroup
        like = blocked[0][2]

        def local_piece(x: int):
            def piece_of(j: int) -> Tensor:
                pc, i = slabs[j]
                geo = self._geometry(pc)
                start, stop = geo.slab_range(i)
                return by_piece[pc][x][max(start, geo.lo) - geo.lo : min(stop, geo.hi) - geo.lo]

            return piece_of

        received = [plan.to_owners(local_piece(x), like, group) for x in (2, 3, 4)]
        whole_d = received[0][0].new_empty(received[0][0].numel())
        cursor = 0
        for n, j in enumerate(plan.owned_jobs):
            pc, i = slabs[j]
            geo = self._geometry(pc)
            start, stop = geo.slab_range(i)
            rows = (stop - start) // geo.cols
            g, f_hat, a = (received[x][1][n].view(rows, geo.cols) for x in range(3))
            out = self._slab(geo, self._factors(pc), i - geo.first_owned, g, f_hat, a, h, stats)
            whole_d[cursor : cursor + out.numel()] = out.view(-1)
            cursor += out.numel()
            stats["owner_slabs"] += 1
        back = plan.to_holders(whole_d, group)
        for j, piece in back.items():
            pc, i = slabs[j]
            geo = self._geometry(pc)
            start, stop = geo.slab_range(i)
            d = by_piece[pc][5]
            d[max(start, geo.lo) - geo.lo : min(stop, geo.hi) - geo.lo] = piece
        size = like.element_size()
        stats["bytes_sent"] += (3 * plan.elements_sent + plan.elements_received) * size
        stats["bytes_received"] += (3 * plan.elements_received + plan.elements_sent) * size

    def _slab(
        self,
        geo: _Geometry,
        facs: dict[str, Tensor],
        k: int,
        g: Tensor,
        f_hat: Tensor,
        a: Tensor,
        h: _Hyper,
        stats: dict[str, int],
    ) -> Tensor:
        """One slab (``k``: its index in this rank's factors): update each block's factors,
        recompute roots when due, and return the slab's direction (Adam's before
        ``start_preconditioning_step``, grafted Shampoo after)."""
        rows = g.shape[0]
        out = a.clone()
        for j in range(geo.col_blocks):
            c0, c1 = j * geo.bc, min((j + 1) * geo.bc, geo.cols)
            cols = c1 - c0
            L, R = facs["factor_L"][k, j, :rows, :rows], facs["factor_R"][k, j, :cols, :cols]
            L_inv, R_inv = (
                facs["inv_root_L"][k, j, :rows, :rows],
                facs["inv_root_R"][k, j, :cols, :cols],
            )
            # fresh contiguous copies: matmuls see the same memory layout on every rank
            gb = g[:, c0:c1].to(L.dtype, copy=True).contiguous()
            _accumulate(L, gb @ gb.T, h.beta2)
            _accumulate(R, gb.T @ gb, h.beta2)
            if h.compute_roots:
                scale = 1 - h.beta2**h.t if h.bias_correction and h.beta2 < 1 else 1.0
                for factor, root in ((L, L_inv), (R, R_inv)):
                    _inverse_root(factor / scale if scale != 1.0 else factor, h.eps, root, stats)
            if not h.use_shampoo:
                continue
            fb = f_hat[:, c0:c1].to(L.dtype, copy=True).contiguous()
            s = L_inv.contiguous() @ fb @ R_inv.contiguous()
            a_norm = torch.linalg.vector_norm(a[:, c0:c1].to(L.dtype))
            s = s * (a_norm / (torch.linalg.vector_norm(s) + _GRAFT_TINY))
            out[:, c0:c1] = s
            stats["blocks"] += 1
        return out


def _accumulate(factor: Tensor, outer: Tensor, beta2: float) -> None:
    """``factor = β₂·factor + (1-β₂)·outer``, or ``factor += outer`` when ``β₂ = 1``."""
    if beta2 == 1.0:
        factor.add_(outer)
    else:
        factor.mul_(beta2).add_(outer, alpha=1 - beta2)


def _inverse_root(factor: Tensor, eps: float, out: Tensor, stats: dict[str, int]) -> None:
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


def _check_block(max_preconditioner_dim: Any) -> None:
    if (
        not isinstance(max_preconditioner_dim, int)
        or isinstance(max_preconditioner_dim, bool)
        or max_preconditioner_dim < 1
    ):
        raise ValueError(
            f"Invalid max_preconditioner_dim: {max_preconditioner_dim!r}; it is the largest "
            "block side B and must be an int >= 1 (default 1024)"
        )


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
    _check_block(max_preconditioner_dim)
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
