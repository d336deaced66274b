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
(``largest_state_rank``), the rank its figures describe. So both sides
state the same assumptions, the planner's: a group's forward reads each of its parameters once
through a matrix product with a one-row input, so backward makes a fresh gradient of every
parameter (as a real layer does) while activations are a few bytes. The planner leaves
activations out on purpose (they depend on batch, sequence length and checkpointing; a recipe's
``--dry-run`` measures them for a real model); here they are nil on both sides.

Only what the dry run can simulate is accepted (``check_verifiable``): FSDP or HSDP meshes
without tp or ep dims, no root groups. Anything else is one ``PlanError`` line naming the flag.
The optimizer step's own temporaries (torch's kernels, AdamW8bit's fp32 moments, Muon's
gathered matrices, Shampoo's roots) are not modelled: "peak of the optimizer step" falls short
by them, which matters where the step is the peak (small models at small W). Imports torch:
``cli`` imports this module only for ``--verify``, so the planner itself stays torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from raggedfsdp.capacity.float8 import FP8_BLOCK
from raggedfsdp.capacity.memory import Estimate, estimate
from raggedfsdp.capacity.model_shapes import ModelShapes, PlanError
from raggedfsdp.capacity.policies import OptimizerSpec, shard_policy
from raggedfsdp.capacity.report import format_bytes
from raggedfsdp.capacity.settings import Settings

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
    """Refuse, in one line naming the flag, a case the dry run cannot simulate."""
    mesh = settings.mesh
    if mesh.tp > 1 or mesh.ep > 1:
        raise PlanError(
            f"--verify simulates FSDP and HSDP meshes only, not tp={mesh.tp}, ep={mesh.ep}: "
            "drop the tp and ep dims (-w W or --mesh RxS)"
        )
    if any(g.root for g in model.groups):
        roots = [g.name for g in model.groups if g.root]
        raise PlanError(
            f"--verify: model {model.name!r} has a root group ({', '.join(roots)}), which it "
            'cannot build yet; mark no group "root" in the shapes file'
        )


class Group(nn.Module):
    """One FSDP group of the planner's model: its tensors as parameters under their names."""

    def __init__(
        self, tensors: tuple[tuple[str, tuple[int, ...]], ...], dtype: torch.dtype
    ) -> None:
        super().__init__()
        for name, shape in tensors:
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(
                leaf, nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus a read of every parameter: ``ones(1, rows) @ p`` as a matrix, so its
        gradient is a fresh tensor of the parameter's size and nothing large is saved. One
        ``ones`` row per row count and dtype, and one sum at the end: a dry run's time is
        its op count (DeepSeek-V3's blocks hold 782 tensors)."""
        rows: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        terms = []
        for p in self.parameters():
            matrix = p.reshape(p.shape[0], -1)
            key = (matrix.shape[0], p.dtype)
            if key not in rows:
                rows[key] = torch.ones(1, key[0], dtype=p.dtype, device=p.device)
            terms.append((rows[key] @ matrix).sum().to(x.dtype))
        return x + torch.stack(terms).sum()


class Chain(nn.Module):
    """The groups in forward order; backward visits them in reverse, as a model's blocks."""

    def __init__(self, model: ModelShapes, dtype: torch.dtype) -> None:
        super().__init__()
        self.groups = nn.ModuleList(
            Group(g.tensors, dtype) for g in model.groups for _ in range(g.repeat)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            x = group(x)
        return x


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _build(
    model: ModelShapes, settings: Settings
) -> Callable[[Callable[..., Any]], tuple[nn.Module, torch.optim.Optimizer]]:
    """The dry run's ``build``: the chain, each group wrapped as the planner planned it."""
    from raggedfsdp.fsdp import Float8Blocks, MixedPrecisionPolicy, MXFP8Blocks

    prec, mesh = settings.precision, settings.mesh
    master = _dtype(prec.master)
    gather = {"param": None, "fp8": Float8Blocks(FP8_BLOCK), "mxfp8": MXFP8Blocks()}
    mp = MixedPrecisionPolicy(
        param_dtype=_dtype(prec.param),
        reduce_dtype=_dtype(prec.reduce),
        all_gather=gather[settings.all_gather],
    )
    policy = shard_policy(settings.units, settings.optimizer)

    def build(fully_shard: Callable[..., Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh

        with unset_fake_temporarily():  # a mesh holds rank numbers fake tensors would lose
            shape, names = (mesh.replicate, mesh.shard), ("dp_replicate", "dp_shard")
            device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            if mesh.replicate == 1:
                device_mesh = device_mesh["dp_shard"]
            chain = Chain(model, master)
        options = {
            "mesh": device_mesh,
            "mp_policy": mp,
            "reshard_after_forward": settings.reshard_after_forward,
            "shard_policy": policy,
        }
        for group in chain.groups:
            group.to_empty(device="cpu")
            fully_shard(group, **options)
        fully_shard(chain, **options)
        return chain, make_optimizer(settings.optimizer, chain)

    return build


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


def compare(est: Estimate, report: StepReport) -> tuple[Row, ...]:
    """The planner's figures beside the runtime's ``StepReport`` for the same case.

    Traffic is bytes a rank sends with ring algorithms, the planner's unit: the dry run counts
    each collective's whole buffer, of which a ring sends ``(n - 1) / n`` (all-gather and
    reduce-scatter over the ``shard`` ranks) or ``2 (n - 1) / n`` (all-reduce over the
    ``replicate`` ones)."""
    mem, traffic, mesh = est.memory, est.traffic, est.settings.mesh
    persistent = mem["params"] + mem["optimizer"]
    gathered = max(p.layout.world_size * p.gather_bytes for p in est.plans)
    ring, rep = (mesh.shard - 1) / mesh.shard, 2 * (mesh.replicate - 1) / mesh.replicate
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
        Row("all-gather sent / step", traffic["all_gather"], report.all_gather * ring),
        Row("reduce-scatter sent / step", traffic["reduce_scatter"], report.reduce_scatter * ring),
    ]
    if mesh.replicate > 1:
        rows.append(Row("all-reduce sent / step", traffic["all_reduce"], report.all_reduce * rep))
    return tuple(rows)


def verify(model: ModelShapes, settings: Settings) -> Comparison:
    """Run the planner's case as ``largest_state_rank`` on the fake process group and
    compare (module docstring).

    A dry run runs on CPU, where the runtime finishes each reduce-scatter before the next
    group's backward; on CUDA it leaves one in flight on its stream (``--backend nccl``, the
    planner's default, counts that buffer). So the runtime is compared with the planner's
    estimate of the schedule it runs, ``--backend gloo``'s; the table names the NCCL total."""
    check_verifiable(model, settings)
    from raggedfsdp.dry_run import dry_run

    cpu = dataclasses.replace(settings, backend="gloo")
    est = estimate(model, cpu)
    world, rank = settings.mesh.world_size, largest_state_rank(est)
    report = dry_run(_build(model, cpu), _loss, rank=rank, world_size=world)
    nccl = estimate(model, dataclasses.replace(settings, backend="nccl")).memory["total"]
    return Comparison(compare(est, report), report.setup_s, world, nccl, rank)


def largest_state_rank(est: Estimate) -> int:
    """The rank whose optimizer state the planner says is the largest, the one its per-rank
    figures are (every other per-rank figure is the same on every rank): a shard coordinate,
    of the first replica (rank ``r * shard + s`` holds shard ``s``). Under AdamW every rank
    holds the same; Shampoo's and SOAP's per-slab state sits on the slabs' first ranks, so a
    figure checked on another rank would not be the planner's."""
    state = sum(p.instances * p.state for p in est.plans)
    return int(np.argmax(state))


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
