"""Capacity planning: will a model fit, how much padding and traffic does a layout cost?

``raggedfsdp plan llama3-70b --world-size 1024`` (or ``python -m raggedfsdp.capacity plan ...``,
the same program) plans every distinct FSDP group of a model with the structure-aware planner
and estimates, per rank, the memory of parameters, gradients, optimizer state and unsharded
buffers, the padding against the lower bound and FSDP2's rule, the all-gather /
reduce-scatter bytes of a step and Muon's owner balance. Pure Python and numpy (no process
group, no GPU), so it answers for 100,000 ranks in seconds.

It re-derives none of the runtime's rules: units come from ``raggedfsdp.sharding.units`` (the
policies ``fully_shard`` and the optimizers use, resolved the same way), Muon's owners from
``raggedfsdp.sharding.owners`` and per-block optimizer state from ``raggedfsdp.sharding.blocks``;
``tests/capacity/test_drift.py`` checks the answers against real optimizers.

Library use::

    from raggedfsdp.capacity import Mesh, Settings, estimate, load_model
    est = estimate(load_model("llama3-8b"), Settings(Mesh(1, 1024)))
    est.memory["total"], est.padding["pct"], est.to_dict()
"""

from raggedfsdp.capacity.loader import load_model, preset_names
from raggedfsdp.capacity.memory import Estimate, estimate
from raggedfsdp.capacity.model_shapes import Group, ModelShapes, PlanError, parse_shapes
from raggedfsdp.capacity.muon import MuonBalance
from raggedfsdp.capacity.policies import OptimizerSpec, UnitPolicy
from raggedfsdp.capacity.settings import Mesh, Precision, Settings

__all__ = [
    "Estimate",
    "Group",
    "Mesh",
    "ModelShapes",
    "MuonBalance",
    "OptimizerSpec",
    "PlanError",
    "Precision",
    "Settings",
    "UnitPolicy",
    "estimate",
    "load_model",
    "parse_shapes",
    "preset_names",
]
