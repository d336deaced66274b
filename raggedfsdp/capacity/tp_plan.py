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
* replicated: norms (``SequenceParallel``), routers, DeepSeek's low-rank ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` (torchtitan's ``NoParallel``) and every other tensor;
* MoE experts are not split by TP: whole on every TP rank (an ep dim splits them over EP ranks,
  ``capacity/ep_plan.py``).

The rule reads a tensor's name and number of dims only, so it gives the same answer on the
global and the TP-local shape. Shapes, units and notes of the split come from
:mod:`raggedfsdp.sharding.tp_split`, the rules ``fully_shard`` applies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

from raggedfsdp.capacity.model_shapes import Group, ModelShapes, PlanError, Shape
from raggedfsdp.capacity.policies import is_expert
from raggedfsdp.capacity.settings import Mesh
from raggedfsdp.sharding.tp_split import tp_block_note, tp_local_shape
from raggedfsdp.sharding.units import ShardPolicy, resolve_units

__all__ = [
    "COLWISE",
    "EMBEDDINGS",
    "ROWWISE",
    "global_shape",
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
    if is_expert(name) or "." not in name:
        return None
    module, leaf = name.rsplit(".", 2)[-2:]
    if leaf == "weight" and ndim == 2:
        if module in COLWISE or module in EMBEDDINGS:
            return 0
        return 1 if module in ROWWISE else None
    return 0 if leaf == "bias" and ndim == 1 and module in COLWISE else None


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
    tensors: Sequence[tuple[str, Shape]],
    units: dict[str, int],
    policy: ShardPolicy,
    world: int,
    degree: int,
    dtype: str,
) -> tuple[str, ...]:
    """Where the TP split cuts a block the shard policy asks for in global coordinates, in the
    runtime's words (``fully_shard`` notes the same for its TP parameters): the policy is
    asked about the global shapes of the group's split tensors, as the runtime asks it, and
    compared with the ``units`` planned on the TP-local ones."""
    split = [(n, s, tp_dim(n, len(s))) for n, s in tensors if tp_dim(n, len(s)) is not None]
    if degree == 1 or not split:
        return ()
    shapes = {n: global_shape(n, s, degree) for n, s, _ in split}
    global_units = resolve_units(policy, [(n, shapes[n], dtype) for n, _, _ in split], world)
    notes = (
        tp_block_note(n, dim, degree, shapes[n], global_units[n], units[n]) for n, _, dim in split
    )
    return tuple(note for note in notes if note)


def tp_notes(model: ModelShapes, degree: int) -> list[str]:
    """Model-wide notes of the TP dim: the experts it leaves whole."""
    if degree == 1:
        return []
    experts = sum(g.repeat for g in model.groups for n, _ in g.tensors if is_expert(n))
    if not experts:
        return []
    return [
        f"{experts:,} expert tensors are not split by TP: torchtitan's dense plan keeps each "
        f"whole on every one of the {degree} TP ranks (an ep dim in --mesh splits them over "
        "EP ranks instead)"
    ]
