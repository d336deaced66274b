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
forward exchange runs while the rank runs its AdamW groups and orthogonalises its
communication-free matrices. So every mode is bitwise equal to torch's Muon on the full
parameters with the same gradients (for bf16 parameters cut between ranks on CPU, up to one ulp
in a few elements: torch's CPU ``add_`` rounds a call's last elements differently; see
docs/optimizers.md).

Matrices of one shape on one owner (stacked experts, the same projection in every layer) go
through Newton–Schulz together: one ``bmm`` / ``baddbmm`` chain over the stack instead of one
small ``mm`` chain each (``newton_schulz`` takes a stack). On CPU the batched chain gives the
same bits as the per-matrix one in bf16 and fp32 when the matrices' smaller side exceeds
``BATCH_MIN_SIDE`` (tested), so results stay torch's and the same at every world size; smaller
matrices and float64 NS (accuracy runs) keep one chain each; ``batched_ns=False`` keeps one
chain per matrix everywhere.

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

from raggedfsdp.comm.mesh import MeshLike, product_group
from raggedfsdp.optim.adamw import adamw_update, check_betas
from raggedfsdp.optim.base import ShardedOptimizer
from raggedfsdp.optim.contract import Piece, StateSpec
from raggedfsdp.optim.owner_compute import ExchangePlan
from raggedfsdp.optim.pieces import scalar_dtype, unwrap
from raggedfsdp.sharding import resolve_units
from raggedfsdp.sharding.owners import Job, assign_owners, ns_flops
from raggedfsdp.sharding.tp_shard import TPShard, tp_split_of
from raggedfsdp.sharding.units import (
    DEFAULT_MAX_EXTRA_PADDING,
    MuonShardPolicy,
    WholeMatrices,
    check_max_extra_padding,
    is_muon_matrix,
)

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
#: Most elements one batched Newton–Schulz call takes: a batch's temporaries (Gram matrices,
#: updates) grow with it, so larger stacks of one shape are cut into several calls. On CPU a
#: batch that fits in L2 (2**18 bf16 elements: 512 KB) is fastest: a larger one streams every
#: matrix through memory once per matmul (measured: 256 x 256 experts 1.20x the per-matrix
#: chain in one batch of 56, 0.87x in batches of 4; small experts gain either way).
NS_BATCH_ELEMENTS = {"cpu": 1 << 18}
NS_BATCH_ELEMENTS_DEFAULT = 1 << 26
#: Matrices whose smaller side is at most this run one chain each. On CPU, torch multiplies a
#: bf16 product of at most 16**3 multiply-adds with its own GEMM but a batch of them with
#: oneDNN, and the two round differently at near-ties (about 0.4 % of 16 x 16 matrices differ,
#: by up to 3 bf16 ulps): batching them would make the bits depend on how many matrices an owner
#: holds, i.e. on the world size. Above it both run oneDNN and agree bitwise.
BATCH_MIN_SIDE = 16
#: NS dtypes that batch. MKL's batched float64 GEMM rounds some sizes (17, 33, ...) unlike its
#: one-matrix GEMM, and float64 NS is for accuracy checks, where speed does not matter.
BATCHED_DTYPES = (torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- the math
def muon_momentum_(buf: Tensor, grad: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """``buf ← μ·buf + (1-μ)·g`` in place; returns what NS orthogonalises: Nesterov's
    ``(1-μ)·g + μ·buf``, or ``buf`` itself. Element-wise, so it runs on any piece."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def newton_schulz(x: Tensor, coefficients: Sequence[float], steps: int, eps: float) -> Tensor:
    """Orthogonalise ``x`` (m, n), already in the NS dtype, with torch's exact op sequence;
    ``x`` is overwritten. Transposing wide-first keeps the Gram matrix min(m, n) square.

    ``x`` may also be a stack ``(B, m, n)`` of same-shape matrices, each orthogonalised on its
    own by the same sequence batched (a norm per matrix, ``baddbmm`` for ``addmm``): one kernel
    per operation for the whole stack, which is where many small matrices gain.
    """
    a, b, c = coefficients
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x.div_(x.norm().clamp(min=eps))
        mul_add = torch.addmm
    else:
        x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
        mul_add = torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        update = mul_add(gram, gram, gram, beta=b, alpha=c)
        x = mul_add(x, update, x, beta=a)
    return x.mT if tall else x


def adjust_lr(lr: float | Tensor, adjust_lr_fn: str | None, m: int, n: int) -> float | Tensor:
    """torch's ``_adjust_lr`` for an m×n matrix (one expert's for stacked experts)."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, m / n))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(m, n)))
    raise ValueError(
        f"adjust_lr_fn={adjust_lr_fn!r} is not supported; use None, 'original' or 'match_rms_adamw'"
    )


def muon_apply_(
    param: Tensor,
    update: Tensor,
    lr: float | Tensor,
    weight_decay: float,
    adjusted_lr: float | Tensor,
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
    lr: float | Tensor,
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
def check_muon_args(
    lr: Any,
    momentum: float,
    weight_decay: float,
    adjust_lr_fn: str | None,
    ns_steps: int,
    ns_coefficients: Sequence[float],
) -> None:
    """``torch.optim.Muon``'s argument checks, with its messages (so code written against
    torch's errors sees ours), plus the bounds of the Newton–Schulz loop, which torch leaves
    unchecked."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not momentum >= 0.0:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(
            f"Adjust learning rate function {adjust_lr_fn} is not supported "
            f"(adjust_lr_fn={adjust_lr_fn!r}); use None, 'original' or 'match_rms_adamw'"
        )
    if not 0 <= ns_steps < 100 or len(ns_coefficients) != 3:
        raise ValueError(
            f"ns_steps={ns_steps!r}, ns_coefficients={ns_coefficients!r}: ns_steps must be in "
            "[0, 100) and ns_coefficients 3 numbers (a, b, c)"
        )


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
        batched_ns: orthogonalise the matrices of one shape that an owner holds in one batched
            chain (default; matrices with a side of at most ``BATCH_MIN_SIDE`` and float64 NS
            excepted, see ``BATCHED_DTYPES``); False runs one chain per matrix.
        whole_matrices: the drop-in buffers' units (see ``MuonShardPolicy``).
        max_extra_padding: the padding "auto" may add for whole matrices, a fraction of each
            bucket's elements (see ``MuonShardPolicy``; 0: never more than element units).
        mesh: ranks for the drop-in mode.

    After each ``step()``, ``last_step_stats`` holds this rank's ``bytes_sent`` /
    ``bytes_received`` (other ranks only, both exchanges), ``ns_flops`` (this rank's),
    ``ns_flops_max`` / ``ns_flops_mean`` over ranks (from the deterministic plan, no
    communication), ``matrices``, ``matrices_local`` (computed where they lie, no communication,
    over all ranks), ``ns_run`` (names of the matrices this rank orthogonalised) and
    ``ns_calls`` (this rank's Newton–Schulz chains: one per batch of same-shape matrices).

    While an owner exchange is in flight, the ``use_muon=False`` groups that have not stepped
    yet run their AdamW update (groups listed after the Muon groups, as ``split_muon_params``
    orders them), so the exchange hides behind that work.

    Non-finite gradients are not checked (as in torch): a NaN/inf in a matrix's gradient turns
    that matrix's update (and momentum) into NaN; other matrices are unaffected.
    """

    handles_tensor_parallel = True
    handles_multi_dim_tp = True  # EP x TP experts: each expert from its EP rank's TP blocks

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
        batched_ns: bool = True,
        whole_matrices: WholeMatrices = "auto",
        max_extra_padding: float = DEFAULT_MAX_EXTRA_PADDING,
        mesh: MeshLike = None,
    ) -> None:
        check_muon_args(lr, momentum, weight_decay, adjust_lr_fn, ns_steps, ns_coefficients)
        check_max_extra_padding(max_extra_padding)
        check_betas(adamw_betas, "adamw_betas")
        if not adamw_eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {adamw_eps} (adamw_eps)")
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
        self.batched_ns = batched_ns
        self.whole_matrices = whole_matrices
        self.max_extra_padding = max_extra_padding
        self._adamw_early: set[int] = set()  # AdamW groups (ids) stepped during an exchange
        self._adamw_started: set[int] = set()  # and those the runtime stepped in its turn
        self._has_grad: dict[Piece, bool] = {}
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
        policy = self.shard_policy(
            self.whole_matrices,
            is_muon=lambda n, s: True,
            max_extra_padding=self.max_extra_padding,
        )
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
        options = ("lr", "momentum", "weight_decay", "adjust_lr_fn", "ns_steps", "ns_coefficients")
        check_muon_args(*(group[key] for key in options))  # a group may override the defaults
        shape = tuple(piece.param.shape)
        if group["use_muon"] and len(shape) not in (2, 3):
            raise ValueError(
                "Muon only supports 2D parameters (and stacked (E, m, n) experts, one matrix "
                f"per expert): parameter {piece.name!r} has shape {shape}. Put it in a "
                "use_muon=False group (AdamW); split_muon_params(model) does that"
            )
        tp = tp_split_of(piece.spec)
        if group["use_muon"] and tp is not None:
            across = [d for d in tp.dims if not (len(shape) == 3 and d == 0)]
            if len(across) > 1:
                raise ValueError(
                    f"{self._split_by_tp(piece, tp)}: Muon assembles each matrix from blocks "
                    "of its rows or of its columns, not both; split it on one of them, or put "
                    "it in a use_muon=False group (AdamW)"
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
            "ns_calls": 0,
        }
        self._adamw_early, self._adamw_started = set(), set()
        loss = super().step(closure)
        stats = self._stats
        loads = _combined_loads(stats.pop("ns_loads"))
        stats["ns_flops_max"] = max(loads)
        stats["ns_flops_mean"] = sum(loads) / len(loads)
        self.last_step_stats = stats
        return loss

    def _gradient_flags(self) -> dict[Piece, bool]:
        """The runtime's flags, kept so that AdamW groups can step early
        (``_step_adamw_groups``)."""
        self._has_grad = super()._gradient_flags()
        return self._has_grad

    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        if not group["use_muon"]:
            if id(group) not in self._adamw_early:  # else it ran during an exchange
                self._adamw_started.add(id(group))
                adamw_update(_adamw_group(group), pieces, self.state, step)
            return
        by_group: dict[tuple[int, int], list[Piece]] = {}
        for pc in pieces:  # one exchange per data-parallel group (x TP group for TP matrices)
            tp = tp_split_of(pc.spec)
            key = (id(pc.pgroup), 0 if tp is None else id(tp.reduce_group))
            by_group.setdefault(key, []).append(pc)
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
        lr = group["lr"]  # a tensor lr stays one: torch computes the decay factor with it
        if isinstance(lr, Tensor):
            lr = lr.reshape(())
        for pc in pieces:
            local = pc.local()
            adjusted = adjust_lr(lr, group["adjust_lr_fn"], *pc.param.shape[-2:])
            muon_apply_(local, updates[pc].view(local.shape), lr, group["weight_decay"], adjusted)
        self._count(plan)

    def _orthogonalise(
        self, plan: _GroupPlan, updates: dict[Piece, Tensor], group: dict[str, Any]
    ) -> None:
        """Every matrix of ``updates`` to its owner, ``newton_schulz`` there, the result back
        into ``updates``. While the others travel, the AdamW groups step and the matrices held
        whole here are orthogonalised."""
        ex = plan.exchange
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])

        def mine(j: int) -> Tensor:
            mat = plan.matrices[j]
            return updates[mat.piece][mat.lo : mat.hi]

        like = next(iter(updates.values()))
        finish = ex.start_to_owners(mine, like, plan.group) if plan.moved else None
        if finish is not None:
            self._step_adamw_groups()
        self._newton_schulz(plan, [(j, mine(j)) for j in ex.local_jobs], ns)
        if finish is None:
            return
        whole, owned = finish()
        self._newton_schulz(plan, list(zip(ex.owned_jobs, owned, strict=True)), ns)
        for j, piece in ex.to_holders(whole, plan.group).items():
            mine(j).copy_(piece)

    def _newton_schulz(
        self, plan: _GroupPlan, jobs: list[tuple[int, Tensor]], ns: tuple[Any, ...]
    ) -> None:
        """``newton_schulz`` on each job's flat matrix, in place: one batched chain per shape
        (in batches of at most ``NS_BATCH_ELEMENTS`` for the device) or one chain per matrix (with
        ``batched_ns=False``, a side of at most ``BATCH_MIN_SIDE``, or float64 NS)."""
        by_shape: dict[tuple[int, int], list[Tensor]] = {}
        write_back = []  # (job's flat buffer, its matrix copy) of TP column-split matrices
        for j, flat in jobs:
            mat = plan.matrices[j]
            whole = mat.assemble(flat)
            if whole.data_ptr() != flat.data_ptr():
                write_back.append((mat, flat, whole))
            by_shape.setdefault(mat.shape, []).append(whole)
            self._stats["ns_run"].append(mat.name)
        for shape, mats in by_shape.items():
            device = mats[0].device.type
            cap = NS_BATCH_ELEMENTS.get(device, NS_BATCH_ELEMENTS_DEFAULT)
            batched = (
                self.batched_ns and self.ns_dtype in BATCHED_DTYPES and min(shape) > BATCH_MIN_SIDE
            )
            size = max(1, cap // math.prod(shape)) if batched else 1
            for i in range(0, len(mats), size):
                batch = mats[i : i + size]
                stack = batch[0] if len(batch) == 1 else _stack_view(batch)
                if stack is not None:
                    stack.copy_(newton_schulz(stack, *ns))
                else:
                    for mat, out in zip(batch, newton_schulz(torch.stack(batch), *ns), strict=True):
                        mat.copy_(out)
                self._stats["ns_calls"] += 1
        for mat, flat, whole in write_back:
            mat.scatter(whole, flat)

    def _step_adamw_groups(self) -> None:
        """Step the AdamW groups that have not stepped yet, as the runtime would (its gradient
        flags, allocation and shared step counters), so that they run while an exchange is in
        flight; the runtime's own calls for them later do nothing (``_update``)."""
        for group in self.param_groups:
            gid = id(group)
            if group["use_muon"] or gid in self._adamw_early or gid in self._adamw_started:
                continue
            self._adamw_early.add(gid)
            pieces = [self._pieces[p] for p in group["params"]]
            stepping = [pc for pc in pieces if self._has_grad.get(pc)]
            if not stepping:
                continue
            self._allocate([pc for pc in stepping if pc.param not in self.state])
            for step, members in self._lockstep(pieces, stepping):
                adamw_update(_adamw_group(group), members, self.state, step)

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


def _combined_loads(plans: Sequence[Sequence[float]]) -> list[float]:
    """NS FLOPs per rank over every plan of a step. Plans over data parallel x TP have
    ``T`` times the ranks of those over one TP coordinate's dp ranks (rank ``d * T + t``);
    the latter are the same on every TP coordinate, so dp rank ``d``'s load is each of
    ``d * T .. d * T + T - 1``'s."""
    world = max((len(loads) for loads in plans), default=1)
    total = [0.0] * world
    for loads in plans:
        repeat = world // len(loads)
        for r in range(world):
            total[r] += loads[r // repeat]
    return total


def _stack_view(mats: Sequence[Tensor]) -> Tensor | None:
    """``mats`` as one ``(B, m, n)`` view where they lie back to back in one buffer from a
    64-byte aligned start (the experts of one stacked parameter in its flat NS input): the
    layout ``torch.stack`` would give, without the copy in and the copy per matrix back.
    None otherwise."""
    first = mats[0]
    numel, start = first.numel(), first.data_ptr()
    if start % 64 or not all(m.is_contiguous() for m in mats):
        return None
    step = numel * first.element_size()
    if any(m.data_ptr() != start + i * step for i, m in enumerate(mats)):
        return None
    if any(m.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for m in mats):
        return None
    return first.as_strided((len(mats), *first.shape), (numel, *first.stride()))


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
    in the piece's local flat view.

    A tensor-parallel matrix arrives at its owner as its ``tp_parts`` TP blocks one after the
    other (each block's data-parallel pieces in dp order); ``Shard(0)`` blocks (rows) are the
    matrix's own flat order, column blocks (``RowwiseParallel``'s ``Shard(1)``) are put side by
    side by ``assemble`` and cut apart again by ``scatter``."""

    piece: Piece
    name: str
    shape: tuple[int, int]
    lo: int  # this rank's part: [lo, hi) of the piece's local view
    hi: int
    tp_parts: int = 1  # TP blocks the job's flat buffer holds
    column_blocks: bool = False  # the blocks split columns (else rows, or there is one)

    def _blocks(self, flat: Tensor) -> Tensor:
        m, n = self.shape
        return flat.view(self.tp_parts, m, n // self.tp_parts)

    def assemble(self, flat: Tensor) -> Tensor:
        """The m x n matrix of the job's flat buffer: a view, or for column blocks a copy."""
        if not self.column_blocks:
            return flat.view(self.shape)
        return self._blocks(flat).permute(1, 0, 2).reshape(self.shape)

    def scatter(self, whole: Tensor, flat: Tensor) -> None:
        """``assemble`` backwards: the matrix into the job's flat buffer (column blocks)."""
        m, n = self.shape
        self._blocks(flat).copy_(whole.view(m, self.tp_parts, n // self.tp_parts).transpose(0, 1))


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
    and the exchange that takes it there and back; the same on every rank.

    TP-split matrices are planned over data parallel x TP (``product_group``: rank
    ``d * T + t`` for dp rank ``d`` and TP rank ``t``), so each whole matrix is assembled on
    one owner from every rank holding a piece of it, in one exchange."""
    first = pieces[0]
    world = 1 if first.spec is None else first.spec.world_size
    group, rank, tp = first.pgroup, first.rank, tp_split_of(first.spec)
    if tp is not None:
        group = tp.reduce_group if world == 1 else product_group(first.pgroup, tp.reduce_group)
        rank, world = first.rank * tp.size + tp.rank, world * tp.size
    matrices, jobs = [], []
    for pc in pieces:
        for mat, job in _matrices(pc, steps):
            matrices.append(mat)
            jobs.append(job)
    owners = assign_owners(jobs, world)
    loads = [0.0] * world
    for job, owner in zip(jobs, owners, strict=True):
        loads[owner] += job.cost
    exchange = ExchangePlan(jobs, owners, rank, world)
    moved = any(j.sole_holder != o for j, o in zip(jobs, owners, strict=True))
    free = sum(j.sole_holder == o for j, o in zip(jobs, owners, strict=True))
    return _GroupPlan(matrices, exchange, group, moved, loads, free)


def _matrices(pc: Piece, steps: int) -> Iterator[tuple[_Matrix, Job]]:
    """The matrices of one piece's parameter (one per expert of a stacked tensor), each with
    its job: which ranks hold how much of it, and its NS cost.

    Under TP the piece is cut from this TP rank's block: a matrix is held by every TP rank
    (rows or columns split), or by one when TP splits the experts of a stacked tensor; each
    holder's dp pieces of its block become the job's pieces, TP rank after TP rank."""
    shape, tp = tuple(pc.param.shape), tp_split_of(pc.spec)
    local = shape if tp is None else tp.local_shape
    count, (m, n) = (shape[0], shape[1:]) if len(shape) == 3 else (1, shape)
    size = math.prod(local[-2:])
    tp_rank = 0 if tp is None else tp.rank
    # the TP blocks' expert ranges (their offset on dim 0 of a stacked tensor) in rank order
    starts = _expert_starts(tp, len(shape))
    bounds = None if pc.spec is None else pc.spec.bounds
    base = 0 if bounds is None else bounds[pc.rank]
    cost = float(ns_flops(m, n, steps))
    for e in range(count):
        # (TP rank, matrix in its block) of each TP block holding part of matrix e
        holders = [(t, e - s) for t, s in enumerate(starts) if 0 <= e - s < local[0]]
        if len(shape) != 3:
            holders = [(t, e) for t in range(len(starts))]
        pieces, lo, hi = [], 0, 0
        for t, block_e in holders:
            start, stop = block_e * size, (block_e + 1) * size
            if bounds is None:
                held = ((0, size),)
            else:
                held = Job.spanning(start, stop, bounds, cost).pieces
            pieces += [(d * len(starts) + t, k) for d, k in held]
            if t == tp_rank:
                lo = max(start - base, 0)
                hi = max(min(stop - base, pc.numel), lo)
        name = pc.name if count == 1 else f"{pc.name}[{e}]"
        columns = len(holders) > 1 and tp.dim == len(shape) - 1  # (the matrix's split dim)
        matrix = _Matrix(pc, name, (m, n), lo, hi, len(holders), columns)
        yield matrix, Job(tuple(pieces), cost)


def _expert_starts(tp: TPShard | None, ndim: int) -> list[int]:
    """Per TP rank (``tp.rank`` order): the first matrix its block holds along dim 0 of a
    stacked ``(E, m, n)`` tensor (0 for all when dim 0 is not split, or for a matrix).

    Under EP x TP (``Shard(0)`` over ``ep``, ``Shard(1)`` or ``Shard(2)`` over ``tp``) an
    expert is held by the TP ranks of one EP rank, its rows or columns split among them in
    rank order; ``_check_piece`` refuses a matrix whose rows and columns are both split."""
    if tp is None:
        return [0]
    sizes = [tp.mesh.size(i) for i, _ in tp.splits]
    starts = []
    for t in range(tp.size):
        coordinate, index, start = [], t, 0
        for size in reversed(sizes):
            coordinate.append(index % size)
            index //= size
        for (_, d), c in zip(tp.splits, reversed(coordinate), strict=True):
            if ndim == 3 and d == 0:
                start = c * tp.local_shape[0]
        starts.append(start)
    return starts
