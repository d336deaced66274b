"""The expert-parallel dim: each MoE group as an EP rank holds it, and the all-to-all it costs.

With an ep dim (``--mesh dp_replicate=R,dp_shard=S,ep=E``) every MoE block is wrapped as the
recipe's ``shard_ep_block`` and torchtitan's ``apply_fsdp`` wrap it: the routed experts are
their own ``fully_shard`` group over ``dp_shard_mod_ep = S / ep`` ranks, holding the EP rank's
``E / ep`` experts whole, and the rest of the block (attention, norms, router, shared experts)
is a group over all ``S`` shard ranks. So :func:`ep_local_model` splits each MoE group in two,
the experts' group after the block's (its forward runs inside the block's), and marks it
:attr:`Group.experts <raggedfsdp.capacity.model_shapes.Group>` so the estimate plans it over
``S / ep`` ranks. One expert per tensor (Hugging Face's ``experts.7.up_proj.weight``) is fused
into ``(E, m, n)`` first: the runtime's EP splits one fused tensor per weight along dim 0.

Which experts a rank holds, the complement group's size and the refusals come from
:mod:`raggedfsdp.sharding.ep_split`, the rules the recipe's EP wrapping applies.

Tokens reach their experts by two ``all_to_all_single`` calls per MoE layer (dispatch, then
combine), each inverted in backward, after a count exchange of ``E`` int64s in forward. Each of a
rank's ``T`` tokens goes to ``k`` experts as one row of the router's input width; with uniform
routing ``(ep - 1) / ep`` of the rows leave the rank. With a tp dim as well the recipe gathers the
sequence over TP before routing (``moe_tp_forward``), so every TP rank routes the ``T`` tokens
its TP group gathered: ``--tokens-per-rank`` counts those.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raggedfsdp.capacity.model_shapes import Group, ModelShapes, PlanError, Shape
from raggedfsdp.capacity.policies import is_expert
from raggedfsdp.capacity.settings import Mesh
from raggedfsdp.sharding.ep_split import check_ep, ep_complement, ep_coordinates

__all__ = [
    "COUNT_BYTES",
    "MoELayer",
    "all_to_all_bytes",
    "ep_local_model",
    "ep_ranks",
    "fuse_experts",
    "fused_note",
    "moe_layers",
    "shard_ranks",
]

#: One expert's tensor: (prefix, expert index, the tensor's name within the expert).
_PER_EXPERT = re.compile(r"^(?P<pre>(?:.*\.)?experts\.)(?P<index>\d+)\.(?P<rest>.+)$")
#: Module names of MoE routers (DeepSeek and Qwen ``gate``, GPT-OSS and the recipe ``router``).
ROUTERS = ("gate", "router")
#: The count exchange's dtype: the per-expert counts are int64.
COUNT_BYTES = 8


@dataclass(frozen=True)
class MoELayer:
    """One distinct MoE group: its name, instances, routed experts and token width."""

    name: str
    repeat: int
    n_experts: int
    dim: int


def _fuse(group: Group) -> tuple[tuple[tuple[str, Shape], ...], bool]:
    """The group's tensors with one-expert-per-tensor stacks fused into ``(E, ...)`` ones, in
    the place of each stack's first tensor, and whether any were fused."""
    stacks: dict[str, list[tuple[int, Shape]]] = {}
    for name, shape in group.tensors:
        if m := _PER_EXPERT.match(name):
            stacks.setdefault(m["pre"] + m["rest"], []).append((int(m["index"]), shape))
    out, done = [], set()
    for name, shape in group.tensors:
        m = _PER_EXPERT.match(name)
        if m is None:
            out.append((name, shape))
            continue
        fused = m["pre"] + m["rest"]
        if fused in done:
            continue
        done.add(fused)
        members = sorted(stacks[fused])
        if [i for i, _ in members] != list(range(len(members))) or len(
            {s for _, s in members}
        ) != 1:
            raise PlanError(
                f"{group.name}: the per-expert tensors {fused!r} are not experts 0..E-1 of one "
                "shape, so they cannot be fused into the (E, m, n) tensor expert parallelism "
                "splits; fix the shapes file"
            )
        out.append((fused, (len(members), *members[0][1])))
    return tuple(out), bool(stacks)


def fuse_experts(model: ModelShapes) -> tuple[ModelShapes, list[str]]:
    """``model`` with every group's one-expert-per-tensor stacks fused into ``(E, m, n)``
    tensors, the layout the recipe's experts have (EP splits their dim 0, TP their ``d_ff``),
    and the names of the groups that had any."""
    groups, fused = [], []
    for g in model.groups:
        tensors, any_fused = _fuse(g)
        groups.append(dataclasses.replace(g, tensors=tensors) if any_fused else g)
        fused += [g.name] if any_fused else []
    return ModelShapes(model.name, model.source, tuple(groups)), fused


def fused_note(fused: Sequence[str]) -> list[str]:
    """The note of ``fuse_experts``' change, if it fused any group."""
    if not fused:
        return []
    return [
        f"{', '.join(fused)}: one tensor per expert is planned fused as (E, m, n), the "
        "tensors the recipe's expert and tensor parallelism split (dim 0 over ep, d_ff over tp)"
    ]


def _layer(group: Group, tensors: Sequence[tuple[str, Shape]]) -> MoELayer:
    """The group's experts count (dim 0 of every fused expert tensor) and router width."""
    counts = {shape[0] for name, shape in tensors if is_expert(name) and shape}
    if len(counts) != 1:
        raise PlanError(
            f"{group.name}: its expert tensors disagree on the number of experts (dim 0: "
            f"{sorted(counts)}); expert parallelism splits one (E, ...) stack per weight"
        )
    (experts,) = counts
    for name, shape in tensors:
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if not is_expert(name) and module in ROUTERS and len(shape) == 2 and shape[0] == experts:
            return MoELayer(group.name, group.repeat, experts, shape[1])
    raise PlanError(
        f"{group.name}: {experts} experts but no router weight ({experts}, dim) named "
        f"'{ROUTERS[0]}.weight' or '{ROUTERS[1]}.weight'; the all-to-all moves rows of the "
        "router's input width: add it to the shapes file"
    )


def moe_layers(model: ModelShapes) -> list[MoELayer]:
    """Every group holding routed experts (``is_expert`` names), fused as EP needs them."""
    return [_layer(g, _fuse(g)[0]) for g in model.groups if any(is_expert(n) for n, _ in g.tensors)]


def ep_local_model(model: ModelShapes, mesh: Mesh) -> tuple[ModelShapes, list[str]]:
    """``model`` as one rank of ``mesh`` plans it under EP, and the notes of the change: each
    MoE group split into its block's group and its experts' (``E / ep`` experts, planned over
    ``dp_shard_mod_ep``). Refuses a model without experts and an ``ep`` that does not divide
    a group's experts, naming a ``--mesh`` that works."""
    if mesh.ep == 1:
        return model, []
    layers = {layer.name: layer for layer in moe_layers(model)}
    if not layers:
        raise PlanError(
            f"--mesh {mesh.text}: model {model.name!r} has no expert tensors (names with "
            "'experts.') for the ep dim to split; drop ep from --mesh"
        )
    common = math.gcd(*(layer.n_experts for layer in layers.values()), mesh.shard)
    for layer in layers.values():
        try:
            check_ep(layer.n_experts, mesh.ep)
        except ValueError as err:
            best = max(d for d in range(1, mesh.ep + 1) if common % d == 0)
            raise PlanError(
                f"--mesh {mesh.text}: {layer.name}: {err}; use an ep that divides "
                f"{layer.n_experts} and dp_shard {mesh.shard}, e.g. --mesh "
                f"{dataclasses.replace(mesh, ep=best).text}"
            ) from None
    groups: list[Group] = []
    fused_groups = []
    for g in model.groups:
        if g.name not in layers:
            groups.append(g)
            continue
        tensors, fused = _fuse(g)
        if fused:
            fused_groups.append(g.name)
        # each EP rank's E / ep experts of every fused tensor (the same shapes on every one)
        experts = tuple((n, (s[0] // mesh.ep, *s[1:])) for n, s in tensors if is_expert(n))
        dense = tuple((n, s) for n, s in tensors if not is_expert(n))
        if dense:
            groups.append(dataclasses.replace(g, tensors=dense))
        groups.append(Group(f"{g.name}.experts", g.repeat, experts, experts=True))
    notes = _notes(layers, fused_groups, mesh)
    return ModelShapes(model.name, model.source, tuple(groups)), notes


def _notes(layers: dict[str, MoELayer], fused: list[str], mesh: Mesh) -> list[str]:
    notes = [
        f"{name}: {layer.n_experts // mesh.ep} of its {layer.n_experts} experts on each EP "
        f"rank (ep {mesh.ep}), sharded over dp_shard_mod_ep = {shard_ranks(mesh)} ranks; "
        f"the rest of the block over all {mesh.shard} shard ranks"
        for name, layer in layers.items()
    ]
    return notes + fused_note(fused)


def shard_ranks(mesh: Mesh, experts: bool = True) -> int:
    """The ranks a group is sharded over: ``dp_shard_mod_ep`` for an experts group (EP's
    complement, ``ep_split.ep_complement``; the default, what the report names), ``dp_shard``
    for the others."""
    return ep_complement(mesh.shard, mesh.ep) if experts else mesh.shard


def ep_ranks(values: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Per-rank values of an experts group (over its ``dp_shard_mod_ep`` ranks) at every rank
    of ``dp_shard``: every EP rank holds the same shapes, so rank ``r`` has what its
    ``dp_shard_mod_ep`` coordinate has (``ep_split.ep_coordinates``)."""
    index, _ = ep_coordinates(np.arange(mesh.shard), mesh.ep)
    return values[index]


def all_to_all_bytes(
    layers: Sequence[MoELayer], mesh: Mesh, tokens: int, top_k: int, itemsize: int
) -> float:
    """Bytes a rank sends per step in the EP all-to-alls: dispatch and combine forward and
    their inverses in backward (``4 * T * k`` rows of the router's width, ``(ep - 1) / ep``
    of them off the rank under uniform routing) and the forward count exchange."""
    off = (mesh.ep - 1) / mesh.ep
    total = 0.0
    for layer in layers:
        if top_k > layer.n_experts:
            raise PlanError(
                f"--top-k {top_k}: {layer.name} has only {layer.n_experts} experts; give at "
                f"most {layer.n_experts}"
            )
        rows = 4 * tokens * top_k * layer.dim * itemsize
        counts = layer.n_experts * COUNT_BYTES
        total += layer.repeat * off * (rows + counts)
    return total
