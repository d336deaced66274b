"""The per-rank estimate: plan every distinct group once, then add up memory, padding, traffic.

Planning is per *distinct* group (the 32 identical blocks of Llama-3-8B are one plan counted 32
times), and every per-rank quantity is O(tensors + W) numpy work per distinct group, so a whole
model at W = 100,000 takes well under a second beyond the planner itself.

Memory model (what ``raggedfsdp.fully_shard`` holds, per rank, in bytes):

* persistent: the master segment (``S`` elements per group, ``--master-dtype``), its
  ``--param-dtype`` copy that feeds the all-gather when the two dtypes differ, and the optimizer
  state of the elements this rank holds (the one quantity that differs between ranks: padding is
  not optimized, so the maximum over ranks is reported);
* sharded gradients: ``S`` master-dtype elements per group, from the group's reduce-scatter until
  ``zero_grad``;
* transient, by phase: in forward, the full all-gather buffers (``W * S`` elements) of the current
  group and the prefetched next ones; in backward, the re-gathered current group and the
  prefetched previous ones, the current group's full gradient buffer (``--reduce-dtype``), the
  reduce-scatters still in flight (the runtime's windows, ``raggedfsdp.sharding.schedule``: one
  group ahead and, on NCCL, one reduce-scatter in flight, more of either while they total at
  most ``LATENCY_BOUND_BYTES``; gloo finishes a larger one at once), the group's fresh
  ``--param-dtype`` gradients, held until its last one arrives (the larger of "all held beside
  the parameters" and "all held beside the gradient buffer, the parameters freed"), and the
  sharded gradients of the groups already reduced. (On gloo the all-gather is an exchange of
  point-to-point messages into the buffer and a reduce-scatter an in-place all-reduce, or at
  W=2 an exchange too, so no collective stages a copy of a full buffer there.) A root group stays
  gathered from its forward to its backward (``fully_shard``'s default, FSDP2's schedule). Tied
  to its embedding (no output map of its own) it is read to the end of backward and holds its
  fresh gradients until the lookup's, the last, arrives; untied, its backward (the head's) is
  the first, beside the prefetched last blocks, after which it is reduced and freed, and its
  embedding tables (planned into a group of their own) are freed after forward.

The total is the persistent part plus the largest phase. Activations and optimizer-step
temporaries are not included (they depend on batch, sequence length, checkpointing, kernels).

With a tp dim (``Mesh.tp > 1``) every group is planned as one TP rank holds it
(:func:`~raggedfsdp.capacity.tp_plan.tp_local_model`: torchtitan's plan splits the weights,
the rest is replicated), so every quantity above is per rank of the whole mesh; traffic is
over the data-parallel dims only, since TP's activation collectives depend on the batch.

With an ep dim (``Mesh.ep > 1``) each MoE group is first split into its block's group and its
experts' (:func:`~raggedfsdp.capacity.ep_plan.ep_local_model`: ``E / ep`` experts per EP rank),
and each group is planned over the ranks it is sharded over, ``dp_shard`` or, for the experts,
``dp_shard_mod_ep``: its gathered buffers and collectives span that many ranks, and its
per-rank arrays are mapped onto ``dp_shard``'s ranks (``ep_plan.ep_ranks``). The traffic adds
the token all-to-all (``ep_plan.all_to_all_bytes``: a stated tokens per rank and top-k,
uniform routing).

Traffic per rank per step is bytes each rank sends (and receives) with ring algorithms: an
all-gather or reduce-scatter of a ``W * S`` buffer moves ``(W - 1) * S`` elements per rank; the
HSDP replicate all-reduce moves ``2 (R - 1) / R * S``. ZeRO-3 gathers every non-root group twice
(forward and backward) unless ``reshard_after_forward`` is off.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raggedfsdp.capacity.ep_plan import (
    MoELayer,
    all_to_all_bytes,
    ep_local_model,
    ep_ranks,
    moe_layers,
    shard_ranks,
)
from raggedfsdp.capacity.float8 import (
    ALL_GATHER_KINDS,
    FORMATS,
    float8_summary,
    gather_policy,
    payload,
)
from raggedfsdp.capacity.model_shapes import Group, ModelShapes, PlanError, Shape
from raggedfsdp.capacity.muon import MuonBalance, muon_balance
from raggedfsdp.capacity.optimizer_state import counter_bytes, state_per_rank
from raggedfsdp.capacity.policies import is_expert, shard_policy
from raggedfsdp.capacity.settings import Settings
from raggedfsdp.capacity.tp_plan import (
    check_quantized_splits,
    tp_block_notes,
    tp_dim,
    tp_local_model,
    tp_notes,
)
from raggedfsdp.sharding.baselines import fsdp2_cuts_units, fsdp2_padding
from raggedfsdp.sharding.planner import Layout, TensorSpec, plan_layout
from raggedfsdp.sharding.schedule import gathers_a_copy, prefetch_ends, reduces_in_flight
from raggedfsdp.sharding.units import expert_notes, resolve_units

__all__ = ["Estimate", "GroupPlan", "estimate", "per_rank"]

#: Groups (repeats included) the phase model walks one by one.
MAX_FSDP_GROUPS = 1_000_000
#: What the traffic leaves out with a tp dim (it counts the data-parallel collectives only).
TP_TRAFFIC_EXCLUDES = ["tensor-parallel activation collectives"]


@dataclass
class GroupPlan:
    """One distinct group's plan and what follows from it, for one instance of the group."""

    group: Group
    instances: int
    layout: Layout
    fsdp2_shard: int  # elements per rank under FSDP2's rule (padded dim-0 chunks)
    fsdp2_cut: int  # tensors whose units FSDP2's even dim-0 split cuts
    state: np.ndarray  # optimizer state bytes per rank
    empty_ranks: int  # ranks holding no element of the group
    gather_bytes: int = 0  # bytes per rank of the group's all-gather (FP8 payload or param dtype)
    tp_notes: tuple[str, ...] = ()  # policy blocks a TP or EP split cuts (``tp_block_notes``)

    @property
    def segment(self) -> int:
        return self.layout.segment_size

    def to_dict(self) -> dict[str, Any]:
        lay, numel = self.layout, self.layout.numel
        return {
            "name": self.group.name,
            "instances": self.instances,
            "tensors": len(lay.tensors),
            "numel": numel,
            "segment_elements": lay.segment_size,
            "padding_pct": 100 * lay.padding / numel,
            "lower_bound_pct": 100 * lay.lower_bound_padding / numel,
            "fsdp2_padding_pct": 100 * (self.fsdp2_shard * lay.world_size - numel) / numel,
            "fsdp2_cut_tensors": self.fsdp2_cut,
            "empty_ranks": self.empty_ranks,
            "plan_ms": 1e3 * lay.planning_time_s,
            "notes": [*lay.notes, *self.tp_notes],
        }


@dataclass
class Estimate:
    """The planner's answer for one model and one set of settings (see the module docstring)."""

    model: ModelShapes
    settings: Settings
    plans: list[GroupPlan]
    memory: dict[str, float]
    peak_phase: str
    padding: dict[str, float]
    traffic: dict[str, float]
    muon: MuonBalance | None
    notes: list[str]
    elapsed_s: float
    float8: dict[str, Any] | None = None  # --all-gather fp8|mxfp8 (see ``_float8``)
    moe: list[MoELayer] = dataclasses.field(default_factory=list)  # with an ep dim
    #: total bytes at the peak of forward and backward, and of the optimizer step (its
    #: temporaries not included): what ``--verify`` sets beside the runtime's phase peaks
    phase_totals: dict[str, float] = dataclasses.field(default_factory=dict)

    def _expert_parallel(self) -> dict[str, Any]:
        """The ep dim's own keys of ``to_dict``: what the all-to-all assumes, experts per EP
        rank and the complement group."""
        s, mesh = self.settings, self.settings.mesh
        return {
            "ep": mesh.ep,
            "dp_shard_mod_ep": shard_ranks(mesh),
            "tokens_per_rank": s.tokens_per_rank,
            "top_k": s.top_k,
            "routing": "uniform",
            "layers": [
                {**dataclasses.asdict(layer), "experts_per_ep_rank": layer.n_experts // mesh.ep}
                for layer in self.moe
            ],
        }

    def to_dict(self) -> dict[str, Any]:
        s, mesh = self.settings, self.settings.mesh
        return {
            "model": {
                "name": self.model.name,
                "source": self.model.source,
                "params": self.model.numel,
                "distinct_groups": len(self.plans),
                "fsdp_groups": self.model.num_fsdp_groups,
            },
            "mesh": {
                "replicate": mesh.replicate,
                "shard": mesh.shard,
                "tp": mesh.tp,
                **({"ep": mesh.ep, "dp_shard_mod_ep": shard_ranks(mesh)} if self.moe else {}),
                "world": mesh.world_size,
            },
            "unit": s.describe_units(),
            "optimizer": s.optimizer.name,
            "precision": {
                "param": s.precision.param,
                "master": s.precision.master,
                "reduce": s.precision.reduce,
            },
            "reshard_after_forward": s.reshard_after_forward,
            "backend": s.backend,
            "memory_bytes": self.memory,
            "memory_excludes": ["activations", "optimizer-step temporaries", *_fixed_tables(s)],
            "peak_phase": self.peak_phase,
            "padding": self.padding,
            "traffic_bytes": self.traffic,
            "traffic_excludes": TP_TRAFFIC_EXCLUDES if mesh.tp > 1 else [],
            "muon": None if self.muon is None else self.muon.to_dict(),
            "all_gather": s.all_gather,
            "float8_all_gather_bytes": self.float8,
            **({"expert_parallel": self._expert_parallel()} if self.moe else {}),
            "groups": [p.to_dict() for p in self.plans],
            "notes": self.notes,
            "planning_time_s": sum(p.layout.planning_time_s for p in self.plans),
            "elapsed_s": self.elapsed_s,
        }


def per_rank(layout: Layout, weights: Sequence[float]) -> np.ndarray:
    """``sum_t weights[t] * (elements of tensor t on rank r)`` for every rank r, in O(T + W):
    a tensor covers a partial first segment, whole middle ones (a range update) and a partial
    last one."""
    world, seg = layout.world_size, layout.segment_size
    direct, ramp = np.zeros(world), np.zeros(world + 1)
    for t, w in zip(layout.tensors, weights, strict=True):
        if not w or not t.numel:
            continue
        a = layout.offsets[t.name]
        b = a + t.numel
        first, last = a // seg, (b - 1) // seg
        if first == last:
            direct[first] += w * t.numel
            continue
        direct[first] += w * ((first + 1) * seg - a)
        direct[last] += w * (b - last * seg)
        ramp[first + 1] += w * seg
        ramp[last] -= w * seg
    return direct + np.cumsum(ramp[:world])


def _plan_group(group: Group, instances: int, settings: Settings) -> GroupPlan:
    """Plan one group as ``fully_shard`` would: units from the user's policy combined with the
    optimizer's (``resolve_units``), then the optimizer's state on that layout."""
    world, dtype = shard_ranks(settings.mesh, group.experts), settings.precision.master
    policy = gather_policy(shard_policy(settings.units, settings.optimizer), settings.all_gather)
    units = resolve_units(policy, [(name, shape, dtype) for name, shape in group.tensors], world)
    specs = [TensorSpec(name, shape, dtype, units[name]) for name, shape in group.tensors]
    layout = plan_layout(specs, world, settings.alignment_bytes)
    tp = tp_block_notes(group, units, policy, world, settings.mesh, dtype)
    held = per_rank(layout, [1.0] * len(specs))
    pb = settings.precision.bytes("param")
    fp8 = settings.all_gather != "param"
    state = state_per_rank(layout, group.tensors, settings.optimizer, dtype)
    return GroupPlan(
        group=group,
        instances=instances,
        layout=layout,
        fsdp2_shard=sum(math.prod(s) + fsdp2_padding(s, world) for _, s in group.tensors) // world,
        fsdp2_cut=sum(fsdp2_cuts_units(t.shape, world, t.unit) for t in specs),
        state=ep_ranks(state, settings.mesh) if group.experts else state,
        empty_ranks=int((held == 0).sum()),
        gather_bytes=(
            payload(layout, pb, settings.all_gather).segment_bytes
            if fp8
            else layout.segment_size * pb
        ),
        tp_notes=tp,
    )


def estimate(model: ModelShapes, settings: Settings) -> Estimate:
    """Plan ``model`` under ``settings`` and estimate per-rank memory, padding and traffic."""
    t0 = time.perf_counter()
    if model.num_fsdp_groups > MAX_FSDP_GROUPS:
        raise PlanError(
            f"model {model.name!r} has {model.num_fsdp_groups:,} FSDP groups with repeats; "
            f"the planner walks at most {MAX_FSDP_GROUPS:,}: merge groups in the shapes file"
        )
    if settings.units.kind == "expert" and not any(
        is_expert(n) for g in model.groups for n, _ in g.tensors
    ):
        raise PlanError(
            f"--unit expert: model {model.name!r} has no expert tensors (names with "
            "'experts.'); use --unit-rows K or --unit matrix"
        )
    mesh = settings.mesh
    split, ep_notes = ep_local_model(model, mesh)
    check_quantized_splits(split, mesh, settings.optimizer)
    local = tp_local_model(split, mesh)
    plans, sequence = _plan_model(local, settings)
    counters = counter_bytes(settings.optimizer, [t for g in local.groups for t in g.tensors])
    memory, phase, phase_totals = _memory(plans, sequence, settings, counters)
    layers = moe_layers(model) if mesh.ep > 1 else []
    if layers:
        memory.update(_expert_memory(plans, settings))
    muon = None
    if settings.optimizer.name == "muon":
        muon = muon_balance(sequence, mesh.shard, settings.optimizer.ns_steps, mesh.tp)
    float8 = _float8(local, settings, plans, sequence)
    return Estimate(
        model=model,
        settings=settings,
        plans=plans,
        memory=memory,
        peak_phase=phase,
        padding=_padding(plans, local.numel),
        traffic=_traffic(sequence, settings, layers),
        muon=muon,
        notes=_notes(plans, settings) + tp_notes(model, mesh) + ep_notes,
        elapsed_s=time.perf_counter() - t0,
        float8=float8,
        moe=layers,
        phase_totals=phase_totals,
    )


#: A model's groups in forward order, each as (its distinct group's plan, whether it is a root).
Walk = list[tuple[GroupPlan, bool]]


def _plan_model(model: ModelShapes, settings: Settings) -> tuple[list[GroupPlan], Walk]:
    """Every distinct group planned once, and the model's groups in order as (plan, root)."""
    instances: dict[tuple, int] = {}
    for g in model.groups:
        instances[g.tensors] = instances.get(g.tensors, 0) + g.repeat
    firsts = {g.tensors: g for g in reversed(model.groups)}
    plans = {key: _plan_group(firsts[key], n, settings) for key, n in instances.items()}
    sequence = [(plans[g.tensors], g.root) for g in model.groups for _ in range(g.repeat)]
    return list(plans.values()), sequence


def _float8(
    model: ModelShapes, settings: Settings, plans: list[GroupPlan], sequence: Walk
) -> dict[str, Any] | None:
    """With an FP8 gather: its payload split (``float8_summary``) and how its per-step bytes,
    padding included, compare with FSDP2's param-dtype gather, beside every other
    ``--all-gather`` kind planned the same way. The FP8 units can pad far more than they save
    (128-row units at large W), so the ratio to the same layout's param-dtype gather alone
    would hide it; ``suggested`` names a kind that moves fewer bytes, if one does."""
    kind = settings.all_gather
    if kind == "param":
        return None
    ratios = {kind: _fsdp2_gather_ratio(sequence, settings)}
    for other in ALL_GATHER_KINDS:
        if other != kind:
            alternative = dataclasses.replace(settings, all_gather=other)
            ratios[other] = _fsdp2_gather_ratio(_plan_model(model, alternative)[1], alternative)
    best = min(ratios, key=ratios.__getitem__)
    summary = float8_summary(plans, settings.precision.bytes("param"), kind)
    return {
        **summary,
        "payload_padding_pct": 100 * summary["padding"] / max(summary["payload"], 1.0),
        "format": kind,
        "tile": list(FORMATS[kind].tile),
        "scale_bytes": FORMATS[kind].scale_bytes,
        "units": FORMATS[kind].units,
        "fsdp2_ratio": ratios[kind],
        "fsdp2_ratios": ratios,
        "suggested": best if ratios[best] < ratios[kind] else None,
    }


def _schedule(
    window: list[GroupPlan],
    full: list[float],
    grad_full: list[float],
    settings: Settings,
) -> tuple[list[float], list[float], list[float]]:
    """The runtime's prefetch and reduce-scatter windows (``raggedfsdp.sharding.schedule``)
    over the blocks, per block ``i``: the bytes prefetched beside its forward (``ahead``) and
    its backward (``behind``; ``behind[n]``: beside the root's, which comes first), and the
    full gradient buffers of later blocks still being reduced at its flush (``in_flight``).
    The windows go by the gathered parameter bytes (FP8 payloads aside), as the runtime's; the
    root's place is first in both passes (its own size is in no window)."""
    n = len(window)
    gathered = [_gathered_bytes(p, settings, payload=False) for p in window]
    ends = prefetch_ends([0.0, *gathered], n + 1)  # forward: the root, then the blocks
    ahead = [sum(full[i + 1 : ends[i + 1]]) for i in range(n)]
    ends = prefetch_ends([0.0, *gathered[::-1]], n + 1)  # backward: the root, then reversed
    # place q of the backward pass is block n - q; its window reaches block n - ends[q]
    behind = [sum(full[n - ends[n - i] : i]) for i in range(n)] + [sum(full[n - ends[0] :])]
    nccl = settings.backend == "nccl"
    in_flight = []
    for i in range(n):  # after block i + 1's reduction started: the newest, i + 1, last
        started = grad_full[i + 1 :][::-1]
        keep = reduces_in_flight(started, at_least_one=nccl) if started else 0
        in_flight.append(sum(started[len(started) - keep :]))
    return ahead, behind, in_flight


def _memory(
    plans, sequence, settings: Settings, counters: int
) -> tuple[dict[str, float], str, dict[str, float]]:
    prec = settings.precision
    mb, pb, rb = prec.bytes("master"), prec.bytes("param"), prec.bytes("reduce")
    segments = sum(p.instances * p.segment for p in plans)
    state = sum(p.instances * p.state for p in plans) + counters
    # no persistent param-dtype copy: each gather casts (or quantizes) the master segment
    persistent = segments * mb + float(state.max())

    window = [p for p, root in sequence if not root]
    roots = [p for p, root in sequence if root]
    full = [_gathered_bytes(p, settings) for p in window]
    grad_full = [_ranks(p) * p.segment * rb for p in window]
    held = [p.layout.numel * pb for p in window]  # a group's fresh gradients, before the copy
    sharded = [p.segment * mb for p in window]
    root_full = sum(_gathered_bytes(p, settings) for p in roots)
    # a tied root is read to the end of backward (the embedding's lookup gradient comes last);
    # an untied one only in its own backward, the first, after which it is reduced and freed
    tied = [p for p in roots if not _has_head(p)]
    untied = [p for p in roots if _has_head(p)]
    root_kept = sum(_gathered_bytes(p, settings) for p in tied)
    root_held = sum(p.layout.numel * pb for p in tied)  # their gradients wait for the last one
    root_sharded = sum(p.segment * mb for p in untied)  # reduced before any block's backward
    later = np.concatenate([np.cumsum(sharded[::-1])[::-1][1:], [0.0]]) if window else []
    gathered_upto = np.cumsum(full) if window else []
    names = [p.group.name for p in window]

    phases: list[tuple[float, float, str]] = []  # (unsharded bytes, sharded grads, label)
    n = len(window)
    ahead, behind, in_flight = _schedule(window, full, grad_full, settings)
    for i in range(n):
        fwd = full[i] if settings.reshard_after_forward else gathered_upto[i]
        phases.append((root_full + fwd + ahead[i], 0.0, f"forward of {names[i]}"))
        params = full[i] + behind[i] if settings.reshard_after_forward else gathered_upto[i]
        # what stays gathered beside the flush: the prefetched previous group, or without
        # resharding after forward every earlier one (each is freed in its own backward)
        earlier = behind[i] if settings.reshard_after_forward else params - full[i]
        flush = earlier + held[i] + grad_full[i] + in_flight[i]
        unsharded = root_kept + root_held + max(params + held[i], flush)
        phases.append((unsharded, later[i] + root_sharded, f"backward of {names[i]}"))
    if tied:
        root_grads = sum(_ranks(p) * p.segment * rb for p in tied)
        phases.append((root_kept + root_held + root_grads, sum(sharded), "backward of the root"))
    for p in untied:  # the head's backward, the last blocks prefetched beside it
        read = _read_in_backward(p) * pb
        beside = behind[n] + root_kept + root_held
        flush = read + _ranks(p) * p.segment * rb  # its fresh gradients, then the flat buffer
        phases.append((beside + max(2 * read, flush), 0.0, "backward of the root"))
    all_grads = segments * mb
    phases.append((0.0, all_grads, "optimizer step"))
    unsharded, grads_then, label = max(phases, key=lambda ph: ph[0] + ph[1])
    memory = {
        "params": segments * mb,
        "grads": all_grads,
        "optimizer": float(state.max()),
        "optimizer_mean": float(state.mean()),
        "peak_unsharded": max(ph[0] for ph in phases),
        "total": persistent + unsharded + grads_then,
    }
    memory = {k: float(v) for k, v in memory.items()}  # plain floats for JSON
    *passes, step = phases
    totals = {
        "forward_backward": float(persistent + max((u + g for u, g, _ in passes), default=0.0)),
        "step": float(persistent + step[0] + step[1]),
    }
    return memory, label, totals


def _gathered_bytes(plan: GroupPlan, settings: Settings, payload: bool = True) -> float:
    """The bytes of a group's gathered buffer in the param dtype, with ``payload`` its FP8
    payload beside it (from its gather until unpacked): none where the sharded memory is the
    unsharded parameters (one shard rank, no cast: ``gathers_a_copy``, the runtime's rule)."""
    prec, fp8 = settings.precision, settings.all_gather != "param"
    casts = prec.param != prec.master
    if not gathers_a_copy(_ranks(plan), casts=casts, offloaded=False, float8=fp8):
        return 0.0
    fp8_bytes = plan.gather_bytes if fp8 and payload else 0
    return _ranks(plan) * (plan.segment * prec.bytes("param") + fp8_bytes)


def _ranks(plan: GroupPlan) -> int:
    """The ranks the group is sharded over: ``dp_shard``, or ``dp_shard_mod_ep`` for EP's
    experts; its gathered buffers hold this many segments."""
    return plan.layout.world_size


def _expert_memory(plans: list[GroupPlan], settings: Settings) -> dict[str, float]:
    """The EP experts' share of the per-rank memory: their sharded parameters, gradients and
    optimizer state (the largest rank's), and one experts group gathered (``E / ep`` experts
    in the param dtype, the buffer a MoE layer's forward holds)."""
    prec = settings.precision
    experts = [p for p in plans if p.group.experts]
    segments = sum(p.instances * p.segment for p in experts)
    state = sum(p.instances * p.state for p in experts)
    gathered = max(_gathered_bytes(p, settings, payload=False) for p in experts)
    return {
        "expert_params": float(segments * prec.bytes("master")),
        "expert_grads": float(segments * prec.bytes("master")),
        "expert_optimizer": float(np.max(state)),
        "expert_gathered": float(gathered),
    }


def _fixed_tables(settings: Settings) -> list[str]:
    """Per-process constants an optimizer keeps besides its state: AdamW8bit's code maps
    (``raggedfsdp.optim.quant.QuantMap``, once per device, whatever the model)."""
    return (
        ["adamw8bit code maps (0.55 MiB per device)"]
        if settings.optimizer.name == "adamw8bit"
        else []
    )


#: Module names of output maps: a root group holding one is untied from its embedding.
HEADS = ("output", "lm_head", "head", "classifier")


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0].rsplit(".", 1)[-1].lower() if "." in name else ""


def _is_lookup(name: str) -> bool:
    """An embedding table (read by lookups only, in an untied model)."""
    return "embed" in name.lower() or _module(name) in ("wte", "wpe")


def _has_head(plan: GroupPlan) -> bool:
    """A root group with its own output map: backward reads it in the root's backward only."""
    return any(_module(name) in HEADS for name, _ in plan.group.tensors)


def _read_in_backward(plan: GroupPlan) -> int:
    """Elements of an untied root group that backward reads: all but its embedding tables,
    which ``fully_shard`` plans into a group of their own, freed after forward."""
    return sum(math.prod(shape) for name, shape in plan.group.tensors if not _is_lookup(name))


def _padding(plans, numel: int) -> dict[str, float]:
    pad = sum(p.instances * p.layout.padding for p in plans)
    bound = sum(p.instances * p.layout.lower_bound_padding for p in plans)
    fsdp2 = sum(p.instances * (p.fsdp2_shard * p.layout.world_size - p.layout.numel) for p in plans)
    return {
        "elements": pad,
        "pct": 100 * pad / numel,
        "lower_bound_elements": bound,
        "lower_bound_pct": 100 * bound / numel,
        "fsdp2_elements": fsdp2,
        "fsdp2_pct": 100 * fsdp2 / numel,
        "fsdp2_cut_tensors": sum(p.instances * p.fsdp2_cut for p in plans),
        "tensors": sum(p.instances * len(p.layout.tensors) for p in plans),
    }


def _tp_expert(name: str, shape: Shape) -> bool:
    """An expert tensor the TP plan splits (on its ``d_ff``)."""
    return is_expert(name) and tp_dim(name, len(shape)) is not None


def _gathers(root: bool, settings: Settings) -> int:
    """All-gathers of a group per step: ZeRO-3 gathers it again for backward, except the root,
    which stays gathered."""
    return 1 if root or not settings.reshard_after_forward else 2


def _traffic(sequence, settings: Settings, layers: list[MoELayer]) -> dict[str, float]:
    prec, rep = settings.precision, settings.mesh.replicate
    pb, rb = prec.bytes("param"), prec.bytes("reduce")
    ours = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    fsdp2 = dict.fromkeys(ours, 0.0)
    for plan, root in sequence:
        gathers, world = _gathers(root, settings), _ranks(plan)
        for out, seg in ((ours, plan.segment), (fsdp2, plan.fsdp2_shard)):
            size = plan.gather_bytes if out is ours else seg * pb
            out["all_gather"] += gathers * (world - 1) * size
            out["reduce_scatter"] += (world - 1) * seg * rb
            out["all_reduce"] += 2 * (rep - 1) / rep * seg * rb
    if layers:  # FSDP2 x EP dispatches the same tokens: the same bytes
        ours["all_to_all"] = fsdp2["all_to_all"] = all_to_all_bytes(
            layers, settings.mesh, settings.tokens_per_rank, settings.top_k, pb
        )
    return {**ours, **{f"fsdp2_{k}": v for k, v in fsdp2.items()}}


def _fsdp2_gather_ratio(sequence: Walk, settings: Settings) -> float:
    """A step's all-gather bytes over FSDP2's param-dtype ones, padding included: the
    traffic's ratio, with ``W - 1`` cancelled so that W = 1 has one too."""
    pb = settings.precision.bytes("param")
    ours = sum(_gathers(root, settings) * plan.gather_bytes for plan, root in sequence)
    fsdp2 = sum(_gathers(root, settings) * plan.fsdp2_shard * pb for plan, root in sequence)
    return ours / max(fsdp2, 1)


def _notes(plans, settings: Settings) -> list[str]:
    notes = []
    for p in plans:
        notes += [f"{p.group.name}: {note}" for note in p.layout.notes]
        notes += [f"{p.group.name}: {note}" for note in expert_notes(p.layout.tensors)]
        notes += [f"{p.group.name}: {note}" for note in p.tp_notes]
        if p.empty_ranks:
            notes.append(
                f"{p.group.name}: {p.empty_ranks:,} of {p.layout.world_size:,} ranks hold none "
                "of its elements; smaller units or a smaller shard group (HSDP) spread it"
            )
    if settings.optimizer.name in ("adamw8bit", "shampoo", "soap"):
        notes.append(
            f"units include {settings.optimizer.name}'s blocks (LCM with the unit policy), so "
            "its state math needs no communication"
        )
    mesh = settings.mesh
    name = settings.optimizer.name
    experts = sum(p.instances for p in plans for n, s in p.group.tensors if _tp_expert(n, s))
    if name in ("shampoo", "soap") and mesh.tp > 1 and experts:
        notes.append(
            f"{name}: the slabs of the {experts:,} expert tensors TP splits on d_ff are computed "
            "on owners over dp_shard x tp (raggedfsdp/optim/tp_slabs.py), which the planner "
            "does not model: their per-slab state is counted where the TP-local layout puts it"
        )
    if name == "muon" and mesh.tp > 1:
        notes.append(
            f"muon: each matrix the TP split cuts is gathered whole on one owner from its pieces "
            f"over dp_shard x tp ({mesh.shard:,} x {mesh.tp} ranks) and its update sent back; "
            "matrices TP replicates are updated on every TP rank (owners and bytes above)"
        )
    return notes
