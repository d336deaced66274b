"""``raggedfsdp plan ... --verify``: the planner's case run by the runtime itself, side by side.

The planner is a model of ``raggedfsdp.fully_shard``; this runs the real thing on the same case
as one rank of the job (``raggedfsdp.dry_run``: torch's fake process group, fake tensors) and
sets each of the planner's per-rank figures beside the one the runtime measures, with the ratio.

The model run is built from the planner's own input, not from a recipe: one module per FSDP
group (repeats included) holding exactly the group's tensors under their names, each wrapped
with ``fully_shard`` (the same mesh, mixed precision and all-gather format, FP8 included,
``reshard_after_forward`` and the unit policy the planner combined with the optimizer's), and
the planner's optimizer with its settings (``make_optimizer``: AdamW, AdamW8bit, Muon, Shampoo
or SOAP). The rank simulated is the one whose optimizer state the planner says is the largest
(``largest_state_rank``), the rank its figures describe. So both sides state the same
assumptions, the planner's: a group's forward reads each of its parameters once through a
matrix product with a one-row input, so backward makes a fresh gradient of every parameter (as
a real layer does) while activations are a few bytes. The planner leaves
activations out on purpose (they depend on batch, sequence length and checkpointing; a recipe's
``--dry-run`` measures them for a real model); here they are nil on both sides.

A tp dim (``--mesh RxSxT``) and an ep dim (``dp_shard=S,ep=E``, tp too) are the runtime's as
the recipes set them up, on the planner's assumptions: the mesh is ``(dp_replicate, dp_shard,
tp)``, tp fastest, and the model is the planner's local one (``local_model``). Every tensor
is placed as the planner places it (``tp_plan.rank_splits``): each one torchtitan's TP plan
splits (``tp_plan.tp_dim``; MoE experts on ``d_ff``, ``apply_tp_to_moe``'s ``Shard(1)`` /
``Shard(2)``) is a ``Shard(dim)`` DTensor on tp holding its TP block (what
``parallelize_module`` leaves), the rest plain, and ``fully_shard(..., mesh=dp)`` shards the
TP-local tensors; the forward reads each DTensor's local block. Under EP ``dp_shard`` is
unflattened into ``(dp_shard_mod_ep, ep)`` (``ep_meshes``' layout, the planner's
``ep_coordinates``), and each MoE group is the planner's two: the block's over ``dp``, and its
experts' (one EP rank's ``E / ep``: ``Shard(0)`` DTensors over ep, or with tp ``(Shard(0),
Shard(1|2))`` on ``mesh["ep", "tp"]``, as ``distribute_experts`` makes them) over
``dp_shard_mod_ep``, gradients divided by the dp degree, as ``shard_ep_block`` wraps them.
Traffic is converted to the planner's ring bytes per collective, over that collective's own
ranks (``RingCounter``). The token all-to-all is not compared: nil activations route no
tokens.

Muon's, Shampoo's and SOAP's owners over ``dp_shard x tp`` are found by an object all-gather
(``product_group``), which ``dry_run.fake_world`` answers as the mesh's members would. Only
what the dry run can simulate is accepted (``check_verifiable``): no root groups. A case the
runtime refuses (AdamW8bit blocks a TP or EP split cuts) the planner refuses first, by the same
rule (``tp_plan.check_quantized_splits``); should the runtime refuse another, it is refused as
the runtime words it. Each is one ``PlanError`` line naming the flag.

The optimizer step's own temporaries (torch's kernels, AdamW8bit's fp32 moments, Muon's
gathered matrices, Shampoo's roots) are not modelled: "peak of the optimizer step" falls short
by them, which matters where the step is the peak (small models at small W). Imports torch:
``cli`` imports this module only for ``--verify``, so the planner itself stays torch-free.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from raggedfsdp.capacity.ep_plan import ep_local_model
from raggedfsdp.capacity.float8 import FP8_BLOCK
from raggedfsdp.capacity.memory import Estimate, estimate
from raggedfsdp.capacity.model_shapes import ModelShapes, PlanError
from raggedfsdp.capacity.policies import OptimizerSpec, shard_policy
from raggedfsdp.capacity.report import format_bytes
from raggedfsdp.capacity.settings import Mesh, Settings
from raggedfsdp.capacity.tp_plan import global_shape, rank_splits, tp_local_model
from raggedfsdp.dry_run.collectives import CollectiveCounter

if TYPE_CHECKING:
    from raggedfsdp.dry_run import StepReport

__all__ = [
    "Comparison",
    "Row",
    "check_verifiable",
    "compare",
    "largest_state_rank",
    "make_optimizer",
    "render_comparison",
    "verify",
]

#: the largest |estimate / runtime - 1| the planner is held to (issue 32's goal)
TOLERANCE = 0.05


def check_verifiable(model: ModelShapes, settings: Settings) -> None:
    """Refuse, in one line naming the flag, a case the dry run cannot simulate: a root group.
    A case the runtime itself refuses (AdamW8bit's blocks cut by a TP split) is its own
    one-line refusal, raised when the optimizer is built (``_optimizer``)."""
    if any(g.root for g in model.groups):
        roots = [g.name for g in model.groups if g.root]
        raise PlanError(
            f"--verify: model {model.name!r} has a root group ({', '.join(roots)}), which it "
            'cannot build yet; mark no group "root" in the shapes file'
        )


#: How a verify tensor is placed: ``None`` (a plain parameter) or the mesh it is split on (the
#: key of ``device_meshes``) and the tensor dim each of its dims splits, ``("tp", (0,))``: a
#: ``Shard(0)`` DTensor on tp; ``("ep_tp", (0, 1))``: ``(Shard(0), Shard(1))`` on (ep, tp).
Placed = Callable[[str, tuple[int, ...]], "tuple[str, tuple[int, ...]] | None"]


class Group(nn.Module):
    """One FSDP group of the planner's model: its tensors as parameters under their names;
    those ``placed`` names a mesh for are ``Shard(dim)`` DTensors on it (``meshes``),
    holding the planner's local block."""

    def __init__(
        self,
        tensors: tuple[tuple[str, tuple[int, ...]], ...],
        dtype: torch.dtype,
        placed: Placed | None = None,
        meshes: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        for name, shape in tensors:
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            where = placed(name, shape) if placed else None
            owner.register_parameter(leaf, nn.Parameter(_tensor(shape, dtype, where, meshes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus a read of every parameter: ``ones(1, rows) @ p`` as a matrix, so its
        gradient is a fresh tensor of the parameter's size and nothing large is saved (a
        DTensor's local block, as a TP layer computes with it: its gradient is a DTensor of
        the same placement, no collective). One ``ones`` row per row count and dtype, and
        one sum at the end: a dry run's time is its op count (DeepSeek-V3's blocks hold 782
        tensors)."""
        from torch.distributed.tensor import DTensor

        rows: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        terms = []
        for p in self.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            matrix = local.reshape(local.shape[0], -1)
            key = (matrix.shape[0], p.dtype)
            if key not in rows:
                rows[key] = torch.ones(1, key[0], dtype=p.dtype, device=p.device)
            terms.append((rows[key] @ matrix).sum().to(x.dtype))
        return x + torch.stack(terms).sum()


def _tensor(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    where: tuple[str, tuple[int, ...]] | None,
    meshes: dict[str, Any] | None,
) -> torch.Tensor:
    """A meta tensor of ``shape``, or with ``where = (mesh, dims)`` the DTensor on that mesh,
    ``Shard(d)`` on its dims in order, whose local block has ``shape`` (the planner's local
    shape)."""
    local = torch.empty(shape, dtype=dtype, device="meta")
    if where is None or meshes is None:
        return local
    from torch.distributed.tensor import DTensor, Shard

    key, dims = where
    return DTensor.from_local(local, meshes[key], [Shard(d) for d in dims], run_check=False)


class Chain(nn.Module):
    """The groups in forward order; backward visits them in reverse, as a model's blocks.

    ``model`` is the planner's local one (``local_model``) for ``mesh``, each tensor placed
    as the planner places it (``rank_splits``): an experts group (``Group.experts`` of the EP
    split) holds one EP rank's experts, ``Shard(0)`` DTensors on ``ep`` (with tp ``(Shard(0),
    Shard(d_ff dim))`` on ``ep_tp``); a tensor torchtitan's TP plan splits holds its TP block,
    ``Shard(tp_dim)`` on ``tp``."""

    def __init__(
        self, model: ModelShapes, dtype: torch.dtype, meshes: dict[str, Any], mesh: Mesh
    ) -> None:
        super().__init__()

        def placed(experts: bool) -> Placed:
            def where(name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]] | None:
                full = global_shape(name, shape, mesh.tp)  # rank_splits takes EP-local shapes
                splits = rank_splits(name, full, experts, mesh)[1]
                if not splits:
                    return None
                return "_".join(m for m, _, _ in splits), tuple(d for _, d, _ in splits)

            return where

        groups = []
        for g in model.groups:
            for _ in range(g.repeat):
                group = Group(g.tensors, dtype, placed(g.experts), meshes)
                group.experts = g.experts
                groups.append(group)
        self.groups = nn.ModuleList(groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            x = group(x)
        return x


def local_model(model: ModelShapes, mesh: Mesh) -> ModelShapes:
    """``model`` as the planner plans one rank of ``mesh``: EP's split (``ep_local_model``),
    then each TP rank's blocks (``tp_local_model``), as ``memory.estimate`` does."""
    return tp_local_model(ep_local_model(model, mesh)[0], mesh)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def device_meshes(mesh: Mesh) -> dict[str, Any]:
    """The runtime's meshes for ``mesh``, laid out as the recipes' (``(dp_replicate,
    dp_shard, tp)``, tp fastest; ``ep_meshes``' unflattening of ``dp_shard`` into
    ``(dp_shard_mod_ep, ep)``, rank ``i * ep + j`` of ``dp_shard`` at ``(i, j)``, the
    planner's ``ep_coordinates``): ``dp`` (``fully_shard``'s for the dense groups), and where
    the dims exist ``tp``, ``ep``, ``ep_tp`` (``mesh["ep", "tp"]``, the EP x TP experts') and
    ``experts_dp`` (the experts' ``dp_shard_mod_ep``, with ``dp_replicate`` under HSDP).
    Made outside fake tensors: a mesh holds rank numbers."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = [("dp_replicate", mesh.replicate)] if mesh.replicate > 1 else []
    dims += [("dp_shard", mesh.shard)] + ([("tp", mesh.tp)] if mesh.tp > 1 else [])
    base = init_device_mesh(
        "cpu", tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims)
    )
    dp = ("dp_replicate", "dp_shard") if mesh.replicate > 1 else ("dp_shard",)
    meshes = {"dp": base[dp]}
    if mesh.tp > 1:
        meshes["tp"] = base["tp"]
    if mesh.ep > 1:
        names = ("dp_shard_mod_ep", "ep")
        full = base._unflatten("dp_shard", (mesh.shard // mesh.ep, mesh.ep), names)
        meshes["ep"] = full["ep"]
        if mesh.tp > 1:  # the EP x TP experts' mesh
            meshes["ep_tp"] = full["ep", "tp"]
        meshes["experts_dp"] = full[(*dp[:-1], "dp_shard_mod_ep")]
    return meshes


def _build(
    model: ModelShapes, settings: Settings
) -> Callable[[Callable[..., Any]], tuple[nn.Module, torch.optim.Optimizer]]:
    """The dry run's ``build``: the chain, each group wrapped as the planner planned it (an
    experts group over ``experts_dp``, its gradients divided by the whole dp degree as the
    recipe's ``shard_ep_block`` does, the others over ``dp``)."""
    from raggedfsdp.fsdp import Float8Blocks, MixedPrecisionPolicy, MXFP8Blocks

    prec, mesh = settings.precision, settings.mesh
    gather = {"param": None, "fp8": Float8Blocks(FP8_BLOCK), "mxfp8": MXFP8Blocks()}
    mp = MixedPrecisionPolicy(
        param_dtype=_dtype(prec.param),
        reduce_dtype=_dtype(prec.reduce),
        all_gather=gather[settings.all_gather],
    )
    options = {
        "mp_policy": mp,
        "reshard_after_forward": settings.reshard_after_forward,
        "shard_policy": shard_policy(settings.units, settings.optimizer),
    }
    local = local_model(model, mesh)

    def build(fully_shard: Callable[..., Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # a mesh holds rank numbers fake tensors would lose
            meshes = device_meshes(mesh)
            chain = Chain(local, _dtype(prec.master), meshes, mesh)
        dp = meshes["dp"]
        for group in chain.groups:
            group.to_empty(device="cpu")
            fully_shard(group, mesh=meshes["experts_dp"] if group.experts else dp, **options)
            if group.experts:
                group.set_gradient_divide_factor(dp.size())
        fully_shard(chain, mesh=dp, **options)
        return chain, _optimizer(settings.optimizer, chain)

    return build


def _optimizer(spec: OptimizerSpec, model: nn.Module) -> torch.optim.Optimizer:
    """``make_optimizer``, its refusal of a case one line naming the flag: AdamW8bit refuses
    at construction blocks or tiles a TP split cuts (the planner only notes them)."""
    try:
        return make_optimizer(spec, model)
    except ValueError as err:
        raise PlanError(
            f"--verify: --optimizer {spec.name}: the runtime refuses it: {err}"
        ) from None


def make_optimizer(spec: OptimizerSpec, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``spec`` names, built with the settings the planner took from it (its
    units and state follow from them): AdamW8bit's blocks, tiles and 8-bit threshold (its
    eager step: a fake tensor has no data for the native kernel), Shampoo's and SOAP's
    ``max_preconditioner_dim``, Muon's whole-matrix rule and Newton–Schulz steps over
    ``split_muon_params``' two groups."""
    from raggedfsdp.optim import SOAP, AdamW, AdamW8bit, Muon, Shampoo, split_muon_params

    params = list(model.named_parameters())
    if spec.name == "adamw8bit":
        return AdamW8bit(
            params,
            block_size=spec.block_size,
            tile=spec.tile,
            min_8bit_size=spec.min_8bit_size,
            fused=False,
        )
    if spec.name == "muon":
        return Muon(
            split_muon_params(model),
            ns_steps=spec.ns_steps,
            whole_matrices=spec.whole_matrices,
            max_extra_padding=spec.max_extra_padding,
        )
    if spec.name in ("shampoo", "soap"):
        cls = Shampoo if spec.name == "shampoo" else SOAP
        return cls(params, max_preconditioner_dim=spec.preconditioner_dim)
    return AdamW(params, lr=1e-3)


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.zeros((), dtype=torch.float32))


@dataclass(frozen=True)
class Row:
    """One figure: the planner's estimate and what the runtime measured (bytes)."""

    label: str
    estimate: float
    runtime: float

    @property
    def ratio(self) -> float:
        return self.estimate / self.runtime if self.runtime else float(self.estimate == 0)

    @property
    def agrees(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


@dataclass(frozen=True)
class Comparison:
    """Every row for one case, and the runtime's set-up time (wrapping, optimizer)."""

    rows: tuple[Row, ...]
    seconds: float
    world_size: int
    nccl_total: float  # the planner's total at peak with one reduce-scatter in flight (CUDA)
    rank: int = 0  # the rank simulated (``largest_state_rank``)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def worst(self) -> Row:
        return max(self.rows, key=lambda r: abs(r.ratio - 1))


class RingCounter(CollectiveCounter):
    """``CollectiveCounter`` that also keeps ``sent[kind]``: the bytes a rank sends with ring
    algorithms, the planner's unit, each collective over its own group's ``n`` ranks, of
    which a ring sends ``(n - 1) / n`` of the whole buffer (all-gather, reduce-scatter) or
    ``2 (n - 1) / n`` (all-reduce). Under EP the groups differ (the experts' ``dp_shard_mod_ep``
    beside ``dp_shard``), so the conversion is per call."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: Counter[str] = Counter()

    def reset(self) -> None:
        super().reset()
        self.sent.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "c10d":
            return func(*args, **(kwargs or {}))
        before = dict(self.bytes)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for kind, total in self.bytes.items():
            if total != before.get(kind, 0):
                n = _group_size(args)
                share = (2 if kind == "all_reduce" else 1) * (n - 1) / n
                self.sent[kind] += (total - before.get(kind, 0)) * share
        return out


def _group_size(args: tuple) -> int:
    """The size of the process group a ``c10d`` op runs on (its ``ScriptObject`` argument)."""
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a).size()
    raise ValueError(f"no process group among the collective's arguments {args!r}")


def compare(est: Estimate, report: StepReport, sent: dict[str, float]) -> tuple[Row, ...]:
    """The planner's figures beside the runtime's ``StepReport`` for the same case, and the
    bytes its collectives sent by ring algorithms (``RingCounter.sent``), the planner's
    traffic unit. The token all-to-all of an ep dim is not compared: nil activations route
    no tokens."""
    mem, traffic, mesh = est.memory, est.traffic, est.settings.mesh
    persistent = mem["params"] + mem["optimizer"]
    # the runtime's figure is its largest all-gather: a group over one rank (EP's experts at
    # dp_shard_mod_ep = 1) makes none
    gathered = max(
        (p.layout.world_size * p.gather_bytes for p in est.plans if p.layout.world_size > 1),
        default=0,
    )
    passes = max(report.peak_forward, report.peak_backward)
    rows = [
        Row("sharded parameters", mem["params"], report.params),
        Row("sharded gradients", mem["grads"], report.grads),
        Row("optimizer state", mem["optimizer"], report.optimizer),
        Row("static (after the step)", persistent + mem["grads"], report.static),
        Row("largest gathered buffer", gathered, report.largest_all_gather),
        Row("transient at peak", mem["total"] - persistent, report.peak - persistent),
        Row("total at peak", mem["total"], report.peak),
        Row("peak of forward + backward", est.phase_totals["forward_backward"], passes),
        Row("peak of the optimizer step", est.phase_totals["step"], report.peak_step),
        Row("all-gather sent / step", traffic["all_gather"], sent.get("all_gather", 0.0)),
        Row(
            "reduce-scatter sent / step", traffic["reduce_scatter"], sent.get("reduce_scatter", 0.0)
        ),
    ]
    if mesh.replicate > 1:
        rows.append(
            Row("all-reduce sent / step", traffic["all_reduce"], sent.get("all_reduce", 0.0))
        )
    return tuple(rows)


def verify(model: ModelShapes, settings: Settings) -> Comparison:
    """Run the planner's case as ``largest_state_rank`` on the fake process group and
    compare (module docstring).

    A dry run runs on CPU, where the runtime finishes each reduce-scatter before the next
    group's backward; on CUDA it leaves one in flight on its stream (``--backend nccl``, the
    planner's default, counts that buffer). So the runtime is compared with the planner's
    estimate of the schedule it runs, ``--backend gloo``'s; the table names the NCCL total.
    The dry run is ``dry_run``'s (``measure`` as one rank in the fake world and fake tensors)
    with a ``RingCounter`` beneath, reset as each step's forward starts, as ``measure``'s own
    counter is."""
    check_verifiable(model, settings)
    from raggedfsdp.dry_run.run import measure, tensor_mode
    from raggedfsdp.dry_run.world import fake_world

    cpu = dataclasses.replace(settings, backend="gloo")
    est = estimate(model, cpu)
    world, rank = settings.mesh.world_size, largest_state_rank(est)
    ring = RingCounter()

    def loss(chain: nn.Module) -> torch.Tensor:
        ring.reset()
        return _loss(chain)

    with fake_world(rank, world), tensor_mode("fake"), ring:
        report = measure(_build(model, cpu), loss, tensors="fake")
    nccl = estimate(model, dataclasses.replace(settings, backend="nccl")).memory["total"]
    return Comparison(compare(est, report, dict(ring.sent)), report.setup_s, world, nccl, rank)


def largest_state_rank(est: Estimate) -> int:
    """The rank whose optimizer state the planner says is the largest, the one its per-rank
    figures are (every other per-rank figure is the same on every rank): a shard coordinate
    ``s``, of the first replica and the first TP rank (rank ``(r * shard + s) * tp + t`` holds
    shard ``s``, tp the fastest dim; every TP rank holds blocks of the same shapes). Under
    AdamW every rank holds the same; Shampoo's and SOAP's per-slab state sits on the slabs'
    first ranks, so a figure checked on another rank would not be the planner's. Under EP an
    experts group's state is already at ``dp_shard``'s ranks (``ep_plan.ep_ranks``)."""
    state = sum(p.instances * p.state for p in est.plans)
    return int(np.argmax(state)) * est.settings.mesh.tp


def render_comparison(comparison: Comparison) -> str:
    """The rows as a table: estimate, runtime, ratio, and whether it is within 5 %."""
    head = (
        f"Checked against the runtime: raggedfsdp.fully_shard as rank {comparison.rank:,} of "
        f"{comparison.world_size:,} on the fake process group, fake CPU tensors, the "
        "planner's groups with nil activations"
    )
    lines = [head, f"  {'':<28}{'estimate':>12}{'runtime':>12}{'ratio':>8}"]
    for row in comparison:
        mark = "" if row.agrees else f"  off by more than {TOLERANCE:.0%}"
        lines.append(
            f"  {row.label:<28}{format_bytes(row.estimate):>12}{format_bytes(row.runtime):>12}"
            f"{row.ratio:>8.3f}{mark}"
        )
    worst = comparison.worst()
    lines.append(
        f"  worst: {worst.label} at {worst.ratio:.3f}; runtime set-up {comparison.seconds:.1f} s"
    )
    lines.append(
        "  (estimates for the CPU schedule the dry run runs, --backend gloo's: on CUDA one "
        "reduce-scatter stays in flight, and --backend nccl's total at peak is "
        f"{format_bytes(comparison.nccl_total)})"
    )
    return "\n".join(lines)
