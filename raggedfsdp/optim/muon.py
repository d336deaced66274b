"""``Muon``: torch's Muon on ragged shards, each matrix orthogonalised by one owner rank.

Muon's momentum is element-wise, so it runs on this rank's pieces where they lie. Newton–Schulz
(NS) needs the *whole* matrix, so every matrix (every expert matrix of a stacked ``(E, m, n)``
tensor) becomes an owner-compute job (``owner_compute``): a matrix that lies whole on one rank is
orthogonalised there with no communication; the others are balanced over ranks by NS cost, their
pieces travel to the owner already cast to the NS dtype (bf16: half the bytes of fp32; the cast is
element-wise, so nothing changes bitwise), and the bf16 update comes back the same way. The forward
exchange runs asynchronously while the rank works on its communication-free matrices.

The math is ``torch.optim.Muon``'s op sequence (torch 2.13), so every mode is bitwise equal to
torch's Muon on the full parameters with the same gradients. Parameter groups with
``use_muon=False`` (embeddings, head, norms, biases; see ``split_muon_params``) get torch's AdamW
instead, as in Moonlight and Keller Jordan's ``MuonWithAuxAdam``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.adamw import AdamW, check_adam_args
from raggedfsdp.optim.base import ShardedOptimizer, StateSpec
from raggedfsdp.optim.owner_compute import ExchangePlan, Job, assign_owners
from raggedfsdp.optim.pieces import Piece, scalar_dtype, unwrap
from raggedfsdp.sharding import DEFAULT_ALIGNMENT_BYTES, TensorSpec, plan_layout

__all__ = ["Muon", "MuonShardPolicy", "newton_schulz", "ns_flops", "split_muon_params"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
#: Last module names whose 2-D weights are not hidden matrices (they go to AdamW).
ADAMW_MODULES = ("lm_head", "head", "output", "classifier", "wte", "wpe", "embed_tokens")

WholeMatrices = bool | Literal["auto"]


# ----------------------------------------------------------------------------- the math
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


def ns_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` NS iterations on an m×n matrix: with s = min, l = max, each
    iteration is X·Xᵀ (2s²l), A·A (2s³) and B·X (2s²l)."""
    s, big = min(m, n), max(m, n)
    return steps * (4 * s * s * big + 2 * s**3)


def adjust_lr(lr: float, adjust_lr_fn: str | None, m: int, n: int) -> float:
    """torch's ``_adjust_lr`` for an m×n matrix (one expert's for stacked experts)."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, m / n))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(m, n)))
    raise ValueError(
        f"adjust_lr_fn={adjust_lr_fn!r} is not supported; use None, 'original' or 'match_rms_adamw'"
    )


# ----------------------------------------------------------------------------- model helpers
def _is_hidden_matrix(fqn: str, shape: Sequence[int]) -> bool:
    """The usual split: 2-D (or stacked 3-D expert) weights, except embeddings and heads."""
    module = fqn.rsplit(".", 1)[0].rsplit(".", 1)[-1].lower() if "." in fqn else ""
    return len(shape) in (2, 3) and module not in ADAMW_MODULES and "embed" not in fqn.lower()


def split_muon_params(model: nn.Module, **adamw_options: Any) -> list[dict[str, Any]]:
    """Two named parameter groups for ``Muon``: hidden 2-D matrices and stacked ``(E, m, n)``
    experts (``use_muon=True``), and everything else — embeddings (``nn.Embedding`` or a name
    with "embed"), output heads (``lm_head``, ``head``, ``output``, ``classifier``, ``wte``,
    ``wpe``), norms, biases, 1-D — for AdamW (``use_muon=False``, plus ``adamw_options``, e.g.
    ``lr`` or ``weight_decay`` for that group)."""
    embedding = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    muon, other = [], []
    for name, p in model.named_parameters():
        if id(p) not in embedding and _is_hidden_matrix(name, p.shape):
            muon.append((name, p))
        else:
            other.append((name, p))
    groups = [{"params": muon, "use_muon": True}, {"params": other, "use_muon": False}]
    groups[1].update(adamw_options)
    return [g for g in groups if g["params"]]


class MuonShardPolicy:
    """Units for ``fully_shard`` / the drop-in buffers: whole matrices (one expert matrix of a
    stacked tensor) for Muon matrices, elements for the rest.

    ``whole_matrices``: True always keeps Muon matrices whole (no NS communication, at the cost of
    padding); False uses element units (least padding; matrices cut between ranks travel to their
    owner); "auto" keeps a matrix whole only when the group's planned padding does not grow.
    "auto" needs the whole group, so it is decided by ``units_for_group``; called per parameter
    (``fully_shard`` today), "auto" answers element units.
    """

    def __init__(
        self,
        whole_matrices: WholeMatrices = "auto",
        is_muon: Callable[[str, Sequence[int]], bool] = _is_hidden_matrix,
        alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    ) -> None:
        if whole_matrices not in (True, False, "auto"):
            raise ValueError(f"whole_matrices={whole_matrices!r}: use True, False or 'auto'")
        self.whole_matrices = whole_matrices
        self.is_muon = is_muon
        self.alignment_bytes = alignment_bytes

    @staticmethod
    def matrix_unit(shape: Sequence[int]) -> int:
        return math.prod(shape[1:]) if len(shape) == 3 else math.prod(shape)

    def __call__(self, fqn: str, param: Any) -> int:
        shape = tuple(param.shape)
        if self.whole_matrices is True and self.is_muon(fqn, shape):
            return max(1, self.matrix_unit(shape))
        return 1

    def units_for_group(
        self, tensors: Sequence[tuple[str, Sequence[int], Any]], world_size: int
    ) -> dict[str, int]:
        """Units for one group's ``(name, shape, dtype)`` tensors. "auto": start from element
        units and make Muon matrices whole, all at once or else one by one (largest first),
        while the planned padding stays at the element plan's."""
        units = {name: 1 for name, _, _ in tensors}
        candidates = [
            name
            for name, shape, _ in tensors
            if self.is_muon(name, tuple(shape)) and self.matrix_unit(shape) > 1
        ]
        if self.whole_matrices is not True and (self.whole_matrices is False or world_size == 1):
            return units
        shapes = {name: tuple(shape) for name, shape, _ in tensors}
        if self.whole_matrices is True:
            return units | {n: self.matrix_unit(shapes[n]) for n in candidates}
        dtype = str(tensors[0][2]).removeprefix("torch.") if tensors else "float32"

        def padding(trial: dict[str, int]) -> int:
            specs = [TensorSpec(n, shapes[n], dtype, trial[n]) for n, _, _ in tensors]
            layout = plan_layout(specs, world_size, self.alignment_bytes)
            return layout.buffer_numel - layout.numel

        budget = padding(units)
        every = units | {n: self.matrix_unit(shapes[n]) for n in candidates}
        if padding(every) <= budget:
            return every
        for name in sorted(candidates, key=lambda n: -math.prod(shapes[n]))[:32]:
            trial = units | {name: self.matrix_unit(shapes[name])}
            if padding(trial) <= budget:
                units = trial
        return units


# ----------------------------------------------------------------------------- planning
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
    matrices, jobs = [], []
    first = pieces[0]
    world = 1 if first.spec is None else first.spec.world_size
    me = first.rank if first.spec is not None else 0
    for pc in pieces:
        shape = tuple(pc.param.shape)
        count, (m, n) = (shape[0], shape[1:]) if len(shape) == 3 else (1, shape)
        spec = pc.spec
        base = 0 if spec is None else spec.offset(me)
        for e in range(count):
            a, b = e * m * n, (e + 1) * m * n
            if spec is None:
                parts = ((0, b - a),)
            else:
                parts = tuple(
                    (r, min(b, spec.offset(r) + spec.length(r)) - max(a, spec.offset(r)))
                    for r in range(world)
                    if min(b, spec.offset(r) + spec.length(r)) > max(a, spec.offset(r))
                )
            lo = max(a - base, 0)
            hi = max(min(b - base, pc.numel), lo)
            name = pc.name if count == 1 else f"{pc.name}[{e}]"
            matrices.append(_Matrix(pc, name, (m, n), lo, hi))
            jobs.append(Job(parts, float(ns_flops(m, n, steps))))
    owners = assign_owners(jobs, world)
    loads = [0.0] * world
    for job, owner in zip(jobs, owners, strict=True):
        loads[owner] += job.cost
    exchange = ExchangePlan(jobs, owners, me, world)
    moved = any(j.sole_holder != o for j, o in zip(jobs, owners, strict=True))
    free = sum(j.sole_holder == o for j, o in zip(jobs, owners, strict=True))
    return _GroupPlan(matrices, exchange, first.pgroup, moved, loads, free)


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
            named = [
                (self._name(gi, i), tuple(p.shape), p.dtype) for i, p in enumerate(group["params"])
            ]
            if group.get("use_muon", True):
                units |= policy.units_for_group(named, self._mesh.shard_size)
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
            adam_group = {
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
            AdamW._update(self, adam_group, pieces, step)  # type: ignore[arg-type]
            return
        by_group: dict[int, list[Piece]] = {}
        for pc in pieces:
            by_group.setdefault(id(pc.pgroup), []).append(pc)
        for members in by_group.values():
            self._muon(group, members)

    def _muon(self, group: dict[str, Any], pieces: Sequence[Piece]) -> None:
        """Momentum on the local pieces, NS per matrix on its owner, then the update."""
        mu = group["momentum"]
        inputs: dict[Piece, Tensor] = {}  # NS input, then NS output: this rank's flat pieces
        for pc in pieces:
            buf, grad = unwrap(self.state[pc.param]["momentum_buffer"]), pc.local_grad()
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            inputs[pc] = update.to(self.ns_dtype, copy=True).reshape(-1)

        key = tuple(id(pc) for pc in pieces)
        if key not in self._plans:
            self._plans[key] = _plan(pieces, group["ns_steps"])
        plan = self._plans[key]
        ex = plan.exchange
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])

        def orthogonalise(j: int, flat: Tensor) -> None:
            mat = plan.matrices[j]
            flat.view(mat.shape).copy_(newton_schulz(flat.view(mat.shape), *ns))
            self._stats["ns_run"].append(mat.name)

        def mine(j: int) -> Tensor:
            mat = plan.matrices[j]
            return inputs[mat.piece][mat.lo : mat.hi]

        # send pieces to owners; orthogonalise the local matrices meanwhile
        finish = ex.start_to_owners(mine, inputs[pieces[0]], plan.group) if plan.moved else None
        for j in ex.local_jobs:
            orthogonalise(j, mine(j))
        if finish is not None:
            whole, owned = finish()
            for j, flat in zip(ex.owned_jobs, owned, strict=True):
                orthogonalise(j, flat)
            for j, piece in ex.to_holders(whole, plan.group).items():
                mine(j).copy_(piece)

        lr = float(group["lr"])
        for pc in pieces:
            local = pc.local()
            shape = tuple(pc.param.shape)[-2:]
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(
                inputs[pc].view(local.shape), alpha=-adjust_lr(lr, group["adjust_lr_fn"], *shape)
            )

        size = torch.empty(0, dtype=self.ns_dtype).element_size()
        moved = (ex.elements_sent + ex.elements_received) * size if plan.moved else 0
        stats = self._stats
        stats["bytes_sent"] += moved
        stats["bytes_received"] += moved
        stats["ns_flops"] += plan.loads[ex.rank]
        stats["ns_loads"].append(plan.loads)
        stats["matrices"] += len(plan.matrices)
        stats["matrices_local"] += plan.free
