"""``torch.distributed.checkpoint.state_dict`` for ``fully_shard``-ed models.

torch's helpers gather and cut only DTensors. With ``full_state_dict=True`` they hand back
fully_shard's ``RaggedTensor`` parameters and optimizer states as they are (this rank's piece,
not the full tensor a Hugging Face export needs), and loading a full optimizer state leaves
full tensors beside sharded parameters (the next step fails). These functions keep torch's
names, signatures and ``StateDictOptions``, so code written for FSDP2 ports by changing the
import, and add RaggedTensors:

* ``get_*``: each RaggedTensor is gathered to the full tensor, one at a time; with
  ``cpu_offload`` it moves to the CPU at once and, as torch does, only rank 0 keeps the result
  (the others return ``{}``).
* ``set_*``: each full tensor is cut to this rank's piece; with ``broadcast_from_rank0`` it is
  streamed from rank 0 tensor by tensor, so no rank ever holds the whole state.

Sharded state dicts (the default, what DCP saves and loads) are torch's, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict as _torch
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.utils._pytree import tree_flatten_with_path, tree_map_only, tree_unflatten

from raggedfsdp.optim.state import names_from
from raggedfsdp.sharding import RaggedTensor

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


# ----------------------------------------------------------------------------- get
def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """torch's ``get_model_state_dict``; with ``full_state_dict=True`` RaggedTensors are
    gathered too."""
    return _get(_torch.get_model_state_dict, (model,), submodules, options)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict``; with ``full_state_dict=True`` RaggedTensor states
    (``exp_avg``...) are gathered too."""
    return _get(_torch.get_optimizer_state_dict, (model, optimizers), submodules, options)


def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict(...), get_optimizer_state_dict(...))``."""
    return (
        get_model_state_dict(model, submodules=submodules, options=options),
        get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options),
    )


def _get(
    torch_get: Callable[..., dict[str, Any]],
    args: tuple[Any, ...],
    submodules: set[nn.Module] | None,
    options: StateDictOptions | None,
) -> dict[str, Any]:
    options = options or StateDictOptions()
    if not options.full_state_dict:
        return torch_get(*args, submodules=submodules, options=options)
    # torch's pass without offloading: with ``cpu_offload`` it would empty every rank but 0
    # before the RaggedTensors, whose gathers need every rank, are gathered
    state = torch_get(*args, submodules=submodules, options=replace(options, cpu_offload=False))
    return _gathered(state, options.cpu_offload)


def _gathered(state: dict[str, Any], cpu_offload: bool) -> dict[str, Any]:
    keep = not cpu_offload or not dist.is_initialized() or dist.get_rank() == 0

    def gather(tensor: torch.Tensor) -> torch.Tensor | None:
        full = tensor.full_tensor() if isinstance(tensor, RaggedTensor) else tensor
        if not keep:
            return None  # gathered with the others, then dropped at once
        return full.cpu() if cpu_offload else full

    gathered = tree_map_only(torch.Tensor, gather, state)
    return gathered if keep else {}


# ----------------------------------------------------------------------------- set
def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> Any:
    """torch's ``set_model_state_dict``; a full state dict is cut to each RaggedTensor
    parameter's piece first (streamed from rank 0 with ``broadcast_from_rank0``).

    Unlike ``nn.Module.load_state_dict``, which copies what fits and then reports the rest, a
    state dict with missing or unexpected keys (under ``strict``) or another shape is refused
    before any parameter changes, on every rank alike."""
    check = _model_checker(model, options or StateDictOptions())
    model_state_dict, options = _cut(model, model_state_dict, options, _model_fqn, check)
    return _torch.set_model_state_dict(model, model_state_dict, options=options)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """torch's ``set_optimizer_state_dict``; a full state dict (nested or flattened) is cut to
    the pieces of the RaggedTensor parameters its states belong to first. Load errors name
    parameters by their names in ``model``."""
    optim_state_dict, options = _cut(model, optim_state_dict, options, _optimizer_fqn)
    listed = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    with names_from(model, listed):
        _torch.set_optimizer_state_dict(model, listed, optim_state_dict, options=options)


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> Any:
    """``set_model_state_dict`` then ``set_optimizer_state_dict``; returns the model's
    missing and unexpected keys."""
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


@dataclass(frozen=True)
class _TensorMeta:
    """What rank 0 announces of each tensor it is about to broadcast."""

    shape: torch.Size
    dtype: torch.dtype


def _model_checker(
    model: nn.Module, options: StateDictOptions
) -> Callable[[list[tuple[Any, Any]]], None]:
    """A check of a model state dict's flattened leaves against ``model``'s keys and (global)
    shapes, raising one line that names the keys and the fix."""
    local = replace(options, full_state_dict=False, broadcast_from_rank0=False, cpu_offload=False)
    expected = _torch.get_model_state_dict(model, options=local)  # this rank's: no collective

    def check(leaves: list[tuple[Any, Any]]) -> None:
        # the key is the path's first step (a module's ``_extra_state`` may nest further)
        given = {getattr(path[0], "key", None): v if len(path) == 1 else None for path, v in leaves}
        missing = sorted(set(expected) - set(given)) if options.strict else []
        unexpected = sorted(set(given) - set(expected)) if options.strict else []
        if missing or unexpected:
            raise ValueError(
                f"set_model_state_dict: the state dict does not fit this model (missing keys "
                f"{missing[:5]}, unexpected keys {unexpected[:5]}); load a checkpoint of this "
                "model, or pass StateDictOptions(strict=False) to load the keys it shares"
            )
        for fqn, value in given.items():
            want = getattr(expected.get(fqn), "shape", None)
            shape = getattr(value, "shape", None)
            if want is not None and shape is not None and tuple(shape) != tuple(want):
                raise ValueError(
                    f"set_model_state_dict: {fqn!r} has shape {tuple(shape)} in the state dict "
                    f"but {tuple(want)} in this model; load a checkpoint of this model"
                )

    return check


def _model_fqn(keys: list[Any]) -> str | None:
    return keys[0] if len(keys) == 1 else None


def _optimizer_fqn(keys: list[Any]) -> str | None:
    """The parameter a state tensor belongs to: ``state[fqn][name]`` (torch's nested form) or
    ``"state.<fqn>.<name>"`` (``flatten_optimizer_state_dict``)."""
    if len(keys) == 3 and keys[0] == "state":
        return keys[1]
    if len(keys) == 1 and isinstance(keys[0], str) and keys[0].startswith("state."):
        return keys[0].removeprefix("state.").rpartition(".")[0]
    return None


def _cut(
    model: nn.Module,
    state: dict[str, Any],
    options: StateDictOptions | None,
    fqn_of: Callable[[list[Any]], str | None],
    check: Callable[[list[tuple[Any, Any]]], None] | None = None,
) -> tuple[dict[str, Any], StateDictOptions]:
    """A full state dict as torch's sharded one (and the options to load it with): every
    tensor shaped like the RaggedTensor parameter it belongs to replaced by this rank's piece
    of it (a copy on the parameter's device, so the full tensor can go). Other state dicts
    pass unchanged. ``check`` sees the flattened leaves first (rank 0's, as announced, when
    broadcasting), so every rank refuses a bad state dict before anything moves."""
    options = options or StateDictOptions()
    if not options.full_state_dict:
        if check is not None:
            check(tree_flatten_with_path(state)[0])
        return state, options
    sharded = replace(options, full_state_dict=False, broadcast_from_rank0=False)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied: every name
    broadcast = options.broadcast_from_rank0 and dist.is_initialized()
    leaves, spec = tree_flatten_with_path(state)
    if broadcast:
        leaves, spec = _announced_by_rank0(leaves, spec)
    if check is not None:
        check(leaves)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    out = []
    for path, leaf in leaves:
        param = params.get(fqn_of([getattr(k, "key", getattr(k, "idx", None)) for k in path]))
        if broadcast and isinstance(leaf, (_TensorMeta, torch.Tensor)):
            leaf = _receive(leaf, param.device if param is not None else device)
        out.append(_piece(leaf, param))
    return tree_unflatten(out, spec), sharded


def _announced_by_rank0(leaves: list[tuple[Any, Any]], spec: Any) -> tuple[list, Any]:
    """Every rank learns rank 0's structure; rank 0 keeps its tensors to send, the others get
    ``_TensorMeta`` placeholders (0-d tensors, e.g. ``step``, travel in the announcement)."""
    if dist.get_rank() == 0:
        shown = [(path, _shown(t)) for path, t in leaves]
        announcement = [(shown, spec)]
    else:
        announcement = [None]
    dist.broadcast_object_list(announcement, src=0)
    shown, spec = announcement[0]
    return (leaves if dist.get_rank() == 0 else shown), spec


def _shown(leaf: Any) -> Any:
    if not torch.is_tensor(leaf):
        return leaf
    return _TensorMeta(leaf.shape, leaf.dtype) if leaf.dim() else leaf.cpu()


def _receive(leaf: torch.Tensor | _TensorMeta, device: torch.device) -> torch.Tensor:
    if isinstance(leaf, _TensorMeta):
        tensor = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
    elif leaf.dim() == 0:  # announced with the structure
        return leaf
    else:
        tensor = leaf.to(device)
    dist.broadcast(tensor, src=0)
    return tensor


def _piece(value: Any, param: torch.Tensor | None) -> Any:
    if not (
        isinstance(param, RaggedTensor) and torch.is_tensor(value) and value.shape == param.shape
    ):
        return value
    piece = torch.empty_like(param, dtype=value.dtype)  # a RaggedTensor on param's device
    return piece.copy_(value.detach())  # keeps this rank's elements of the full tensor
