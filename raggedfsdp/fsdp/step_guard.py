"""The optimizer step guard: refuse a step that would silently do nothing or read bad gradients.

Two mistakes look like training but change nothing, or the wrong thing:

* an optimizer built *before* ``fully_shard`` holds the parameters ``fully_shard`` replaced:
  no module uses them any more, they get no gradient, and every step is a silent no-op (FSDP2
  has the same pitfall). ``fully_shard`` marks each tensor it replaces (``mark_replaced``) and
  the guard refuses an optimizer that holds one, naming it and saying to build the optimizer
  after wrapping;
* a step during backward, before the sharded gradients are reduced, or after a backward that
  raised half-way, would read partial gradients;
* a blocked raggedfsdp optimizer (Muon, Shampoo, SOAP, AdamW8bit) on tensor-parallel
  parameters would update each TP block as if it were the whole tensor (``check_tp_optimizer``).

The guard is torch's global optimizer step pre-hook, so it covers every optimizer in the
process, torch's and ours alike (torch wraps every ``Optimizer`` subclass's ``step``). It is
registered by the first ``fully_shard`` (``install_step_guard``), not on import: a program that
only imports raggedfsdp should not pay for it. Parameters can only have been replaced after a
``fully_shard`` ran, so the guard is always in place by then.

Cost: the hook runs before every step of every optimizer. An optimizer's parameters are checked
once, and again only when its parameter groups change or ``fully_shard`` replaces more tensors;
other steps cost a dictionary lookup and one tuple of the group sizes.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from raggedfsdp.fsdp.state import in_backward, reduced_in_this_backward, unfinished_backward
from raggedfsdp.fsdp.tensor_parallel import check_tp_optimizer
from raggedfsdp.sharding import RaggedTensor

__all__ = ["install_step_guard", "mark_replaced"]

_REPLACED_ATTR = "_raggedfsdp_replaced"


class _Checked(NamedTuple):
    """What the guard learnt about one optimizer's parameters, valid while ``key`` holds."""

    key: tuple[int, tuple[tuple[int, int], ...]]
    params: list[torch.Tensor]
    sharded: bool


_LOCK = threading.Lock()
_HANDLE: list[RemovableHandle] = []  # the registered hook, once the first fully_shard made it
_REPLACEMENTS = [0]  # tensors marked so far: a cached check older than the last mark is redone
_CHECKED: weakref.WeakKeyDictionary[Optimizer, _Checked] = weakref.WeakKeyDictionary()


def mark_replaced(original: torch.Tensor, fqn: str, owner: str) -> None:
    """Record that ``fully_shard`` (on ``owner``) replaced ``original`` by a sharded parameter
    named ``fqn``: from now on an optimizer holding ``original`` is refused at its step."""
    setattr(original, _REPLACED_ATTR, (fqn, owner))
    with _LOCK:
        _REPLACEMENTS[0] += 1


def install_step_guard() -> None:
    """Register the guard as torch's global optimizer step pre-hook, once."""
    with _LOCK:
        if not _HANDLE:
            _HANDLE.append(register_optimizer_step_pre_hook(_guard_step))


def _guard_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    checked = _check_params(optimizer)
    if checked.sharded:
        _refuse_step_during_backward(type(optimizer).__name__, checked.params)


def _check_params(optimizer: Optimizer) -> _Checked:
    """Refuse replaced parameters; the result is cached per optimizer until its groups change
    (a group added or resized) or ``fully_shard`` replaces more tensors."""
    groups = optimizer.param_groups
    key = (_REPLACEMENTS[0], tuple((id(g["params"]), len(g["params"])) for g in groups))
    cached = _CHECKED.get(optimizer)
    if cached is not None and cached.key == key:
        return cached
    params = []
    for gi, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            replaced = getattr(p, _REPLACED_ATTR, None)
            if replaced is not None:
                raise _replaced_parameter_error(optimizer, group, gi, i, replaced)
            params.append(p)
    sharded = any(isinstance(p, RaggedTensor) for p in params)
    if sharded:
        check_tp_optimizer(optimizer)
    checked = _Checked(key, params, sharded)
    _CHECKED[optimizer] = checked
    return checked


def _replaced_parameter_error(
    optimizer: Optimizer, group: dict[str, Any], gi: int, i: int, replaced: tuple[str, str]
) -> RuntimeError:
    """Name the stale parameter (the optimizer's own name for it when it has one, else its
    place in the groups) and the name ``fully_shard`` knew it by, and give the fix. Raised
    before the step touches anything: parameters, gradients and optimizer state stay as
    they were."""
    fqn, owner = replaced
    names = group.get("param_names")
    label = repr(names[i]) if names else f"param_groups[{gi}][{i}]"
    return RuntimeError(
        f"{type(optimizer).__name__}.step(): parameter {label} is the tensor that fully_shard "
        f"(on {owner}) replaced with a sharded parameter as {fqn!r}; no module uses it any "
        "more, so this step would update nothing the model sees. Build the optimizer after "
        "fully_shard, from model.parameters() or model.named_parameters() then. If a module "
        "outside that fully_shard call still uses this tensor (a weight tied across the call), "
        "wrap their common parent instead"
    )


def _refuse_step_during_backward(name: str, params: list[torch.Tensor]) -> None:
    """For optimizers of sharded parameters: no step on gradients backward has not finished
    reducing (except optimizer-in-backward, from hooks of already reduced parameters)."""
    if in_backward():
        if reduced_in_this_backward(params):
            return  # optimizer in backward: a post-accumulate-grad hook of reduced parameters
        raise RuntimeError(
            f"{name}.step() was called before backward finished reducing gradients; call it "
            "after loss.backward() returns, or from a post-accumulate-grad hook of the sharded "
            "parameters, which runs once their gradients are reduced"
        )
    if unfinished_backward(params) is not None:
        raise RuntimeError(
            f"{name}.step(): the last backward through these parameters raised before it "
            "finished reducing gradients, so their .grad is incomplete. Call reset_iter_state() "
            "on the root module (or run the next forward, which does it) and redo the backward"
        )
