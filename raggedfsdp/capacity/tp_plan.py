"""The tensor-parallel dim: torchtitan's Llama TP plan applied to a model's shapes by name.

With ``--mesh RxSxT`` each TP rank holds one block of every TP-split weight, and ``fully_shard``
plans those TP-local tensors over the ``S`` data-parallel ranks. The planner cannot see the
user's ``parallelize_module`` plan, so it assumes torchtitan's (``tests/support/tp_models.py``
and ``examples/tensor_parallel.py`` apply the same one), by module name, Llama's and Hugging
Face's names alike:

* ``ColwiseParallel`` (weight ``Shard(0)``, bias ``Shard(0)``): attention q/k/v (``wq``,
  ``q_proj``, fused ``qkv_proj``, DeepSeek's ``q_b_proj`` and ``kv_b_proj``), MLP gate/up
  (``w1``, ``w3``, ``gate_proj``, ``up_proj``, fused ``gate_up_proj``) and the head
  (``output``, ``lm_head``);
* ``RowwiseParallel`` (weight ``Shard(1)``, bias replicated): attention output (``wo``,
  ``o_proj``) and MLP down (``w2``, ``down_proj``); on an embedding (``tok_embeddings``,
  ``embed_tokens``) ``Shard(0)``, over the vocabulary;
* replicated: norms (``SequenceParallel``), routers (the MoE ``gate`` / ``router``: the
  recipe's ``apply_tp_to_moe`` makes it ``Replicate()``, every TP rank routing every token),
  DeepSeek's low-rank ``q_a_proj`` and ``kv_a_proj_with_mqa`` (torchtitan's ``NoParallel``)
  and every other tensor;
* MoE routed experts, fused ``(E, m, n)`` (one-expert-per-tensor stacks are fused first,
  ``ep_plan.fuse_experts``), split on ``d_ff`` as ``apply_tp_to_moe`` splits them: gate/up
  (``w1``, ``w3``, ``gate_proj``, ``up_proj``, ``gate_up_proj``: ``(E, d_ff, d)``)
  ``Shard(1)``, down (``w2``, ``down_proj``: ``(E, d, d_ff)``) ``Shard(2)``. With an ep dim
  as well they are ``(Shard(0), Shard(1|2))`` on ``mesh["ep", "tp"]``
  (``expert_parallel.distribute_experts``): ``ep_plan`` keeps the EP rank's ``E / ep``
  experts, this the TP rank's ``d_ff / tp`` of each. Shared experts (``shared_expert``,
  ``shared_experts``) are the dense SwiGLU plan above, as the recipe's are.

The rule reads a tensor's name and number of dims only, so it gives the same answer on the
global and the TP-local shape. Shapes, units and notes of the split come from
:mod:`raggedfsdp.sharding.tp_split`, the rules ``fully_shard`` applies; whether a split cuts
AdamW8bit's blocks from :mod:`raggedfsdp.sharding.quant_tp`, the rule ``AdamW8bit`` refuses
with (``check_quantized_splits``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from raggedfsdp.capacity.ep_plan import fuse_experts, fused_note
from raggedfsdp.capacity.model_shapes import Group, ModelShapes, PlanError, Shape
from raggedfsdp.capacity.policies import OptimizerSpec, is_expert
from raggedfsdp.capacity.settings import Mesh
from raggedfsdp.sharding.quant_tp import Words, quant_split_grid
from raggedfsdp.sharding.tp_split import tp_local_shape, tp_split_note
from raggedfsdp.sharding.units import ShardPolicy, is_quantized, resolve_units

__all__ = [
    "COLWISE",
    "EMBEDDINGS",
    "ROWWISE",
    "check_quantized_splits",
    "global_shape",
    "rank_splits",
    "tp_block_notes",
    "tp_dim",
    "tp_local_model",
    "tp_notes",
]

#: Modules torchtitan's plan makes ``ColwiseParallel``: attention q/k/v, MLP gate/up, head.
COLWISE = frozenset(
    {"wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "qkv_proj", "q_b_proj", "kv_b_proj"}
    | {"w1", "w3", "gate_proj", "up_proj", "gate_up_proj", "output", "lm_head"}
)
#: ``RowwiseParallel`` linears (attention output, MLP down) and embeddings.
ROWWISE = frozenset(("wo", "o_proj", "w2", "down_proj"))
EMBEDDINGS = frozenset(("tok_embeddings", "embed_tokens"))


def tp_dim(name: str, ndim: int) -> int | None:
    """The dim torchtitan's plan splits tensor ``name`` on, or ``None`` when replicated."""
    if "." not in name:
        return None
    if is_expert(name):
        return _expert_dim(name, ndim)
    module, leaf = name.rsplit(".", 2)[-2:]
    if leaf == "weight" and ndim == 2:
        if module in COLWISE or module in EMBEDDINGS:
            return 0
        return 1 if module in ROWWISE else None
    return 0 if leaf == "bias" and ndim == 1 and module in COLWISE else None


def _expert_dim(name: str, ndim: int) -> int | None:
    """The ``d_ff`` dim of a fused expert weight (``apply_tp_to_moe``'s split): 1 for gate/up
    ``(E, d_ff, d)``, 2 for down ``(E, d, d_ff)``, named by its last part (the recipe's
    ``experts.w1``) or its module (``experts.gate_proj.weight``); ``None`` for the rest
    (expert biases), replicated. Per-expert tensors are fused before the split."""
    parts = name.split(".")
    weight = parts[-2] if parts[-1] == "weight" else parts[-1]
    if ndim != 3:
        return None
    if weight in COLWISE:
        return 1
    return 2 if weight in ROWWISE else None


def global_shape(name: str, local: Shape, degree: int) -> Shape:
    """The global shape of a TP-local tensor (the inverse of ``tp_local_shape``)."""
    dim = tp_dim(name, len(local))
    if dim is None:
        return local
    return tuple(size * degree if d == dim else size for d, size in enumerate(local))


def _splits(model: ModelShapes) -> Iterator[tuple[Group, str, Shape, int]]:
    """Every TP-split tensor of the model: (its group, name, global shape, split dim)."""
    for group in model.groups:
        for name, shape in group.tensors:
            dim = tp_dim(name, len(shape))
            if dim is not None:
                yield group, name, shape, dim


def tp_local_model(model: ModelShapes, mesh: Mesh) -> ModelShapes:
    """``model`` as one TP rank of ``mesh`` holds it: every split tensor's TP-local block. A
    dim that does not divide by the TP degree is a :class:`PlanError` naming it and the
    largest degree up to it that divides every split dim, as a ``--mesh`` to pass."""
    degree = mesh.tp
    if degree == 1:
        return model
    model = fuse_experts(model)[0]
    splits = list(_splits(model))
    for group, name, shape, dim in splits:
        if shape[dim] % degree:
            common = math.gcd(*(s[d] for _, _, s, d in splits))
            best = max(t for t in range(1, degree + 1) if common % t == 0)
            raise PlanError(
                f"--mesh {mesh.text}: {group.name} tensor {name!r} {shape} is "
                f"split on dim {dim} by torchtitan's TP plan, and {shape[dim]} does not divide "
                f"by tp {degree}; use a tp degree that divides every split dim, e.g. "
                f"--mesh {dataclasses.replace(mesh, tp=best).text}"
            )
    groups = tuple(
        dataclasses.replace(g, tensors=tuple((n, _local(n, s, degree)) for n, s in g.tensors))
        for g in model.groups
    )
    return ModelShapes(model.name, model.source, groups)


def _local(name: str, shape: Shape, degree: int) -> Shape:
    return tp_local_shape(shape, tp_dim(name, len(shape)), degree)


def tp_block_notes(
    group: Group,
    units: dict[str, int],
    policy: ShardPolicy,
    world: int,
    mesh: Mesh,
    dtype: str,
) -> tuple[str, ...]:
    """Where a TP (or EP) split cuts a block the shard policy asks for in global coordinates,
    in the runtime's words (``fully_shard`` notes the same for its TP parameters, EP's
    experts included): the policy is asked about the global shapes of the group's split
    tensors (``rank_splits``), as the runtime asks it, and compared with the ``units``
    planned on the TP-local ones."""
    split = []
    for name, shape in group.tensors:  # TP-local shapes, EP's local experts
        full, splits = rank_splits(name, global_shape(name, shape, mesh.tp), group.experts, mesh)
        if splits:
            split.append((name, full, tuple((d, n) for _, d, n in splits)))
    if not split:
        return ()
    global_units = resolve_units(policy, [(n, full, dtype) for n, full, _ in split], world)
    notes = (tp_split_note(n, s, full, global_units[n], units[n]) for n, full, s in split)
    return tuple(note for note in notes if note)


def tp_notes(model: ModelShapes, mesh: Mesh) -> list[str]:
    """Model-wide notes of the TP dim: how it splits the experts, and the per-expert stacks it
    fuses for that (under EP ``ep_plan`` notes the fusion)."""
    if mesh.tp == 1:
        return []
    fused, names = fuse_experts(model)
    experts = sum(g.repeat for g in fused.groups for n, s in g.tensors if is_expert(n))
    split = sum(
        g.repeat for g in fused.groups for n, s in g.tensors if is_expert(n) and tp_dim(n, len(s))
    )
    if not experts:
        return []
    return [
        f"{split:,} of {experts:,} expert tensors split on d_ff over the {mesh.tp} TP ranks, "
        "as the recipe's apply_tp_to_moe: gate/up (E, d_ff, d) Shard(1), down (E, d, d_ff) "
        "Shard(2) (with ep: (Shard(0), Shard(d)) on mesh['ep', 'tp']); routers replicated, "
        "shared experts the dense plan",
        *(fused_note(names) if mesh.ep == 1 else []),
    ]


#: How the planner's refusals name what to change: its flags.
CLI_WORDS = Words("--tile RxC", "--tile", "--block-size", "another optimizer (--optimizer adamw)")


def rank_splits(
    name: str, shape: Shape, experts: bool, mesh: Mesh
) -> tuple[Shape, tuple[tuple[str, int, int], ...]]:
    """The global shape of a tensor of the EP-split model (``ep_local_model``: an experts
    group holds ``E / ep`` experts) and its splits as the runtime's DTensor has them, ``(mesh
    dim, tensor dim, ranks)`` in mesh order: ``Shard(0)`` over ep for an experts group's
    experts, then the TP plan's ``Shard(tp_dim)`` over tp."""
    splits, full = [], list(shape)
    if experts and is_expert(name) and mesh.ep > 1:
        splits.append(("ep", 0, mesh.ep))
        full[0] *= mesh.ep
    dim = tp_dim(name, len(shape))
    if dim is not None and mesh.tp > 1:
        splits.append(("tp", dim, mesh.tp))
    return tuple(full), tuple(splits)


def check_quantized_splits(model: ModelShapes, mesh: Mesh, spec: OptimizerSpec) -> None:
    """Refuse AdamW8bit where a TP or EP split cuts its blocks or tiles, as ``AdamW8bit``
    refuses it at construction: the same rule (``quant_split_grid``) on the same global
    shapes and splits (``rank_splits``), for every tensor it quantizes (``is_quantized``).
    ``model`` is the EP-split one; one ``PlanError`` line naming the flags that fix it."""
    if spec.name != "adamw8bit" or (mesh.tp == 1 and mesh.ep == 1):
        return
    for group in fuse_experts(model)[0].groups:
        for name, shape in group.tensors:
            full, splits = rank_splits(name, shape, group.experts, mesh)
            if not splits or not is_quantized(full, spec.min_8bit_size):
                continue
            try:
                grid = [(d, n) for _, d, n in splits]
                quant_split_grid(full, grid, spec.block_size, spec.tile, CLI_WORDS)
            except ValueError as err:
                placed = " x ".join(f"Shard({d}) over {m} {n}" for m, d, n in splits)
                raise PlanError(
                    f"--optimizer adamw8bit with --mesh {mesh.text}: {group.name} tensor "
                    f"{name!r} {full}, split {placed}: {err} (AdamW8bit refuses it at "
                    "construction)"
                ) from None
