"""``Muon``: torch's Muon on ragged shards, each matrix orthogonalised by one owner rank.

The first screen is Muon itself: :func:`muon_update` is one step of one whole matrix, the op
sequence of ``torch.optim.Muon`` (torch 2.13), built from three functions in the order of the
algorithm — :func:`muon_momentum_`, :func:`newton_schulz`, :func:`muon_apply_`.

The optimizer below runs those same three functions, on shards. Momentum and the final step are
element-wise, so they run on this rank's pieces where they lie. Newton–Schulz (NS) needs the
*whole* matrix, so every matrix (every expert matrix of a stacked ``(E, m, n)`` tensor) is an
owner-compute job (``raggedfsdp.sharding.owners``): a matrix that lies whole on one rank is
orthogonalised there with no communication; the others are balanced over ranks by NS cost, their
pieces travel to the owner already cast to the NS dtype (bf16: half the bytes of fp32; the cast is
element-wise, so nothing changes bitwise), and the bf16 update comes back the same way. The
forward exchange runs while the rank orthogonalises its communication-free matrices. So every
mode is bitwise equal to torch's Muon on the full parameters with the same gradients.

Parameter groups with ``use_muon=False`` (embeddings, head, norms, biases; see
``split_muon_params``) get torch's AdamW instead (:func:`~raggedfsdp.optim.adamw.adamw_update`),
as in Moonlight and Keller Jordan's ``MuonWithAuxAdam``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.adamw import adamw_update, check_adam_args
from raggedfsdp.optim.base import ShardedOptimizer
from raggedfsdp.optim.contract import Piece, StateSpec
from raggedfsdp.optim.owner_compute import ExchangePlan
from raggedfsdp.optim.pieces import scalar_dtype, unwrap
from raggedfsdp.sharding import resolve_units
from raggedfsdp.sharding.owners import Job, assign_owners, ns_flops
from raggedfsdp.sharding.units import MuonShardPolicy, WholeMatrices, is_muon_matrix

__all__ = [
    "Muon",
    "MuonShardPolicy",
    "muon_apply_",
    "muon_momentum_",
    "muon_update",
    "newton_schulz",
    "ns_flops",
    "split_muon_params",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


# ----------------------------------------------------------------------------- the math
def muon_momentum_(buf: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """``buf ← μ·buf + (1-μ)·g`` in place; returns what NS orthogonalises: Nesterov's
    ``(1-μ)·g + μ·buf``, or ``buf`` itself. Element-wise, so it runs on any piece."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def newton_schulz(x: Tensor, coefficients: Sequence[float], steps: int, eps: float) -> Tensor:
    """Orthogonalise ``x`` (m, n), already in the NS dtype, with torch's exact op sequence;
    ``x`` is overwritten. Transposing wide-first keeps the Gram matrix min(m, n) square."""
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def adjust_lr(lr: float, adjust_lr_fn: str | None, m: int, n: int) -> float:
    """torch's ``_adjust_lr`` for an m×n matrix (one expert's for stacked experts)."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, m / n))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(m, n)))
    raise ValueError(
        f"adjust_lr_fn={adjust_lr_fn!r} is not supported; use None, 'original' or 'match_rms_adamw'"
    )


def muon_apply_(
    param: Tensor, update: Tensor, lr: float, weight_decay: float, adjusted_lr: float
) -> None:
    """Decoupled weight decay, then the orthogonalised step scaled by ``adjusted_lr``; in
    place and element-wise, so it runs on any piece."""
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-adjusted_lr)


def muon_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr_fn: str | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """One Muon step of one whole m×n matrix, in place (``torch.optim.Muon``'s, bitwise).

    ``Muon.step`` runs exactly these three calls; it only splits them over ranks: the first and
    the last on each rank's pieces, the middle one on the matrix's owner.
    """
    update = muon_momentum_(momentum_buffer, grad, momentum, nesterov).to(ns_dtype, copy=True)
    update = newton_schulz(update, ns_coefficients, ns_steps, eps)
    muon_apply_(param, update, lr, weight_decay, adjust_lr(lr, adjust_lr_fn, *param.shape))


# ----------------------------------------------------------------------------- model helpers
def split_muon_params(model: nn.Module, **adamw_options: Any) -> list[dict[str, Any]]:
    """Two named parameter groups for ``Muon``: the Muon matrices (``is_muon_matrix``: hidden
    2-D matrices and stacked ``(E, m, n)`` experts) that are not ``nn.Embedding`` weights
    (``use_muon=True``), and everything else — embeddings, output heads, norms, biases, 1-D —
    for AdamW (``use_muon=False``, plus ``adamw_options``, e.g. ``lr`` or ``weight_decay`` for
    that group)."""
    embedding = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    muon, other = [], []
    for name, p in model.named_parameters():
        if id(p) not in embedding and is_muon_matrix(name, p.shape):
            muon.append((name, p))
        else:
            other.append((name, p))
    groups = [{"params": muon, "use_muon": True}, {"params": other, "use_muon": False}]
    groups[1].update(adamw_options)
    return [g for g in groups if g["params"]]


# ----------------------------------------------------------------------------- the optimizer
class Muon(ShardedOptimizer):
    """``torch.optim.Muon`` with sharded state and owner-computed Newton–Schulz, plus AdamW for
    ``use_muon=False`` groups.

    Args:
        params: parameters or groups (``split_muon_params(model)`` gives the usual split). Muon
            groups take 2-D matrices and stacked ``(E, m, n)`` experts (each expert is its own
            matrix: NS, lr adjustment); other shapes raise.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as
            ``torch.optim.Muon``; AdamW groups use ``lr`` (or ``adamw_lr``) and ``weight_decay``.
        adamw_betas, adamw_eps, adamw_lr: AdamW options for ``use_muon=False`` groups
            (``adamw_lr=None``: the group's ``lr``).
        ns_dtype: dtype of the NS iterations and of the pieces exchanged (torch: bf16); float32
            or float64 for accuracy tests.
        whole_matrices: the drop-in buffers' units (see ``MuonShardPolicy``).
        mesh: ranks for the drop-in mode.

    After each ``step()``, ``last_step_stats`` holds this rank's ``bytes_sent`` /
    ``bytes_received`` (other ranks only, both exchanges), ``ns_flops`` (this rank's),
    ``ns_flops_max`` / ``ns_flops_mean`` over ranks (from the deterministic plan, no
    communication), ``matrices``, ``matrices_local`` (computed where they lie, no communication,
    over all ranks) and ``ns_run`` (names of the matrices this rank orthogonalised).

    Non-finite gradients are not checked (as in torch): a NaN/inf in a matrix's gradient turns
    that matrix's update (and momentum) into NaN; other matrices are unaffected.
    """

    _state_keys_depend_on = ("use_muon",)

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_lr: float | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        whole_matrices: WholeMatrices = "auto",
        mesh: MeshLike = None,
    ) -> None:
        if not momentum >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        check_adam_args(lr, adamw_betas, adamw_eps, weight_decay)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": True,
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
            "adamw_lr": adamw_lr,
        }
        self.ns_dtype = ns_dtype
        self.whole_matrices = whole_matrices
        self._plans: dict[tuple[int, ...], _GroupPlan] = {}
        self.last_step_stats: dict[str, Any] = {}
        super().__init__(params, defaults, mesh=mesh)

    # ----------------------------------------------------------------------------- policy
    @classmethod
    def shard_policy(
        cls, whole_matrices: WholeMatrices = "auto", **options: Any
    ) -> MuonShardPolicy:
        """Whole-matrix units for Muon matrices (see ``MuonShardPolicy``)."""
        return MuonShardPolicy(whole_matrices, **options)

    def _policy(self) -> Callable[[str, Any], int]:
        """Units planned per parameter group (the drop-in buffers are planned per group)."""
        policy = self.shard_policy(self.whole_matrices, is_muon=lambda n, s: True)
        units: dict[str, int] = {}
        for gi, group in enumerate(self.param_groups):
            if group.get("use_muon", True):
                named = [
                    (self._name(gi, i), tuple(p.shape), p.dtype)
                    for i, p in enumerate(group["params"])
                ]
                units |= resolve_units(policy, named, self._mesh.shard_size)
        return lambda name, param: units.get(name, 1)

    # ----------------------------------------------------------------------------- state
    def _check_piece(self, piece: Piece, group: dict[str, Any]) -> None:
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(
                f"adjust_lr_fn={group['adjust_lr_fn']!r} is not supported; use None, 'original' "
                "or 'match_rms_adamw'"
            )
        if not 0 <= group["ns_steps"] < 100 or len(group["ns_coefficients"]) != 3:
            raise ValueError("ns_steps must be in [0, 100) and ns_coefficients 3 numbers")
        shape = tuple(piece.param.shape)
        if group["use_muon"] and len(shape) not in (2, 3):
            raise ValueError(
                f"parameter {piece.name!r} has shape {shape}: Muon orthogonalises 2-D matrices "
                "(or stacked (E, m, n) experts, one matrix per expert). Put it in a "
                "use_muon=False group (AdamW); split_muon_params(model) does that"
            )

    def _state_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        keys = ["momentum_buffer"] if group["use_muon"] else ["exp_avg", "exp_avg_sq"]
        return {key: StateSpec(piece.numel, piece.param.dtype) for key in keys}

    def _new_step(self, group: dict[str, Any], device: torch.device) -> Tensor:
        return torch.tensor(0.0, dtype=scalar_dtype())

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._stats: dict[str, Any] = {
            "bytes_sent": 0,
            "bytes_received": 0,
            "ns_flops": 0.0,
            "ns_loads": [],
            "matrices": 0,
            "matrices_local": 0,
            "ns_run": [],
        }
        loss = super().step(closure)
        stats = self._stats
        loads = [sum(x) for x in zip(*stats.pop("ns_loads"), strict=True)] or [0.0]
        stats["ns_flops_max"] = max(loads)
        stats["ns_flops_mean"] = sum(loads) / len(loads)
        self.last_step_stats = stats
        return loss

    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        if not group["use_muon"]:
            adamw_update(_adamw_group(group), pieces, self.state, step)
            return
        by_group: dict[int, list[Piece]] = {}
        for pc in pieces:
            by_group.setdefault(id(pc.pgroup), []).append(pc)
        for members in by_group.values():
            self._muon(group, members)

    def _muon(self, group: dict[str, Any], pieces: Sequence[Piece]) -> None:
        """``muon_update`` on the pieces of one process group: momentum where the pieces lie,
        NS on each matrix's owner, then the step where the pieces lie."""
        key = tuple(id(pc) for pc in pieces)
        if key not in self._plans:
            self._plans[key] = _plan(pieces, group["ns_steps"])
        plan = self._plans[key]
        updates = {}  # this rank's flat NS inputs, then (in place) its NS outputs
        for pc in pieces:
            buf = unwrap(self.state[pc.param]["momentum_buffer"])
            update = muon_momentum_(buf, pc.local_grad(), group["momentum"], group["nesterov"])
            updates[pc] = update.to(self.ns_dtype, copy=True).reshape(-1)
        self._orthogonalise(plan, updates, group)
        lr = float(group["lr"])
        for pc in pieces:
            local = pc.local()
            adjusted = adjust_lr(lr, group["adjust_lr_fn"], *pc.param.shape[-2:])
            muon_apply_(local, updates[pc].view(local.shape), lr, group["weight_decay"], adjusted)
        self._count(plan)

    def _orthogonalise(
        self, plan: _GroupPlan, updates: dict[Piece, Tensor], group: dict[str, Any]
    ) -> None:
        """Every matrix of ``updates`` to its owner, ``newton_schulz`` there, the result back
        into ``updates``. The matrices held whole here are orthogonalised while the others
        travel."""
        ex = plan.exchange
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])

        def mine(j: int) -> Tensor:
            mat = plan.matrices[j]
            return updates[mat.piece][mat.lo : mat.hi]

        def orthogonalise(j: int, flat: Tensor) -> None:
            mat = plan.matrices[j]
            flat.view(mat.shape).copy_(newton_schulz(flat.view(mat.shape), *ns))
            self._stats["ns_run"].append(mat.name)

        like = next(iter(updates.values()))
        finish = ex.start_to_owners(mine, like, plan.group) if plan.moved else None
        for j in ex.local_jobs:
            orthogonalise(j, mine(j))
        if finish is None:
            return
        whole, owned = finish()
        for j, flat in zip(ex.owned_jobs, owned, strict=True):
            orthogonalise(j, flat)
        for j, piece in ex.to_holders(whole, plan.group).items():
            mine(j).copy_(piece)

    def _count(self, plan: _GroupPlan) -> None:
        ex, stats = plan.exchange, self._stats
        size = torch.empty(0, dtype=self.ns_dtype).element_size()
        moved = (ex.elements_sent + ex.elements_received) * size if plan.moved else 0
        stats["bytes_sent"] += moved
        stats["bytes_received"] += moved
        stats["ns_flops"] += plan.loads[ex.rank]
        stats["ns_loads"].append(plan.loads)
        stats["matrices"] += len(plan.matrices)
        stats["matrices_local"] += plan.free


def _adamw_group(group: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters ``adamw_update`` reads, from a ``use_muon=False`` group."""
    return {
        "amsgrad": False,
        "betas": group["adamw_betas"],
        "eps": group["adamw_eps"],
        "lr": group["lr"] if group["adamw_lr"] is None else group["adamw_lr"],
        "weight_decay": group["weight_decay"],
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "fused": None,
    }


# ----------------------------------------------------------------------------- owner plan
@dataclass
class _Matrix:
    """One NS job: a matrix (or one expert) of a piece, and where this rank's part of it lies
    in the piece's local flat view."""

    piece: Piece
    name: str
    shape: tuple[int, int]
    lo: int  # this rank's part: [lo, hi) of the piece's local view
    hi: int


@dataclass
class _GroupPlan:
    """What one group's NS work looks like; fixed while the shards are (so it is cached)."""

    matrices: list[_Matrix]
    exchange: ExchangePlan
    group: Any
    moved: bool  # any job changes rank (then every rank joins the exchange)
    loads: list[float]  # NS FLOPs per rank
    free: int  # jobs computed without communication (over all ranks)


def _plan(pieces: Sequence[Piece], steps: int) -> _GroupPlan:
    """Every matrix of one process group's pieces, its owner (``assign_owners`` on NS cost)
    and the exchange that takes it there and back; the same on every rank."""
    first = pieces[0]
    world = 1 if first.spec is None else first.spec.world_size
    matrices, jobs = [], []
    for pc in pieces:
        for mat, job in _matrices(pc, steps):
            matrices.append(mat)
            jobs.append(job)
    owners = assign_owners(jobs, world)
    loads = [0.0] * world
    for job, owner in zip(jobs, owners, strict=True):
        loads[owner] += job.cost
    exchange = ExchangePlan(jobs, owners, first.rank, world)
    moved = any(j.sole_holder != o for j, o in zip(jobs, owners, strict=True))
    free = sum(j.sole_holder == o for j, o in zip(jobs, owners, strict=True))
    return _GroupPlan(matrices, exchange, first.pgroup, moved, loads, free)


def _matrices(pc: Piece, steps: int) -> Iterator[tuple[_Matrix, Job]]:
    """The matrices of one piece's parameter (one per expert of a stacked tensor), each with
    its job: which ranks hold how much of it, and its NS cost."""
    shape = tuple(pc.param.shape)
    count, (m, n) = (shape[0], shape[1:]) if len(shape) == 3 else (1, shape)
    bounds = None if pc.spec is None else pc.spec.bounds
    base = 0 if bounds is None else bounds[pc.rank]
    cost = float(ns_flops(m, n, steps))
    for e in range(count):
        start, stop = e * m * n, (e + 1) * m * n
        if bounds is None:
            job = Job(((0, stop - start),), cost)
        else:
            job = Job.spanning(start, stop, bounds, cost)
        lo = max(start - base, 0)
        hi = max(min(stop - base, pc.numel), lo)
        name = pc.name if count == 1 else f"{pc.name}[{e}]"
        yield _Matrix(pc, name, (m, n), lo, hi), job
