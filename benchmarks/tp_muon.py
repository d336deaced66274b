"""Muon on FSDP2 x TP for ``tp_vs_fsdp2.py --optimizer muon``: the optimizers of the three
systems, the bytes DTensor's collectives move, and the same-gradient check.

* ``optimizer(system, model)``: ours is ``raggedfsdp.optim.Muon`` on ``split_muon_params``'
  groups (hidden matrices Muon, the embedding, head and norms AdamW); ``fsdp2`` is
  ``torch.optim.Muon`` on the hidden matrices' DTensors (DTensor runs its Newton–Schulz
  matmuls as sharded matmuls on the 2-D mesh) and ``torch.optim.AdamW`` on the rest;
  ``gather`` is the same FSDP2 x TP model with ``GatherMuon``, benchmarks/muon_step.py's
  "gather everything" (b): every NS input gathered whole in bf16 on every rank.
* ``DTensorCollectives``: calls and bytes of DTensor's functional collectives while active
  (what torch's optimizers on DTensors move; ours reports its exchange in ``last_step_stats``).
* ``same_gradient_check``: every system steps from the same weights with the same global
  gradients; the updates, gathered, against one process's ``torch.optim.Muon`` +
  ``torch.optim.AdamW`` on the unsharded tensors, and against fp64 Newton–Schulz (how far
  bf16 rounding alone takes one process).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from measure import Both
from torch import nn
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.utils._python_dispatch import TorchDispatchMode

from raggedfsdp.optim import Muon, split_muon_params

__all__ = [
    "ADAMW",
    "MUON",
    "DTensorCollectives",
    "GatherMuon",
    "optimizer",
    "same_gradient_check",
]

MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW = {"lr": 1e-3, "weight_decay": 0.1}  # torch's AdamW defaults otherwise (betas, eps)
BETAS = (0.9, 0.999)  # torch.optim.AdamW's default, given to our Muon's AdamW groups


class GatherMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` on FSDP2 x TP DTensors by gathering: the momentum on this rank's
    piece (element-wise), each NS input gathered whole in bf16 (``full_tensor()``: over dp and
    tp), Newton–Schulz of the whole matrix on every rank, each rank applying its own piece of
    the result. torch's own functions, so bitwise ``torch.optim.Muon`` on the unsharded
    parameters (checked by ``same_gradient_check``)."""

    def __init__(self, params: Any, lr: float, weight_decay: float, momentum: float) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum}
        super().__init__(params, defaults | {"ns_coefficients": (3.4445, -4.775, 2.0315)})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum)  # nesterov, as torch's default
                whole = update.to(torch.bfloat16).full_tensor()
                ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], 5, 1e-7)
                mine = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
                local = p.to_local()  # no_grad: the parameter's own local tensor
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(mine.to_local(), alpha=-_adjust_lr(lr, None, p.shape))


def muon_matrices(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``split_muon_params``' Muon matrices (2-D only: torch's Muon takes no other) and the
    rest."""
    groups = split_muon_params(model)
    matrices = [p for g in groups if g["use_muon"] for _, p in g["params"] if p.ndim == 2]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    return matrices, rest


def optimizer(system: str, model: nn.Module) -> torch.optim.Optimizer:
    """The Muon (+ AdamW) of ``system``: "ours", "fsdp2" or "gather" (see the module's doc)."""
    if system == "ours":
        groups = split_muon_params(model)
        return Muon(groups, **MUON, adamw_lr=ADAMW["lr"], adamw_betas=BETAS)
    matrices, rest = muon_matrices(model)
    muon_cls = torch.optim.Muon if system == "fsdp2" else GatherMuon
    return Both(muon_cls(matrices, **MUON), torch.optim.AdamW(rest, **ADAMW))


# ----------------------------------------------------------------------------- bytes
class DTensorCollectives(TorchDispatchMode):
    """Calls and bytes this rank sends in DTensor's functional collectives while active, by
    kind: an all-gather of n input bytes over a group of g ranks sends (g-1) n, a ring
    all-reduce 2 (g-1)/g n, a reduce-scatter and an all-to-all (g-1)/g n (the group's size
    from its name, so collectives over one mesh dim count with that dim's size)."""

    FACTORS: ClassVar[dict[str, Callable[[int], float]]] = {
        "all_gather_into_tensor": lambda g: g - 1,
        "all_reduce": lambda g: 2 * (g - 1) / g,
        "reduce_scatter_tensor": lambda g: (g - 1) / g,
        "all_to_all_single": lambda g: (g - 1) / g,
        "broadcast": lambda g: g - 1,
    }

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower itself to plain ops and collectives
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        name = getattr(packet, "__name__", "")
        if getattr(func, "namespace", "") == "_c10d_functional" and name in self.FACTORS:
            tensor = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            group = next(a for a in reversed(args) if isinstance(a, str))
            size = _resolve_process_group(group).size()
            nbytes = tensor.numel() * tensor.element_size()
            self.calls[name] += 1
            self.bytes[name] += int(self.FACTORS[name](size) * nbytes)
        return out


# ----------------------------------------------------------------------------- correctness
def _gradients(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) * 0.01 for n, p in model.named_parameters()}


def _set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Every rank's piece of the same global gradients: ours a RaggedTensor piece of the
    parameter's layout, FSDP2's a DTensor of its placements (each rank cuts its own)."""
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(grads[n], p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad = torch.empty_like(p).copy_(grads[n])


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def _reference(
    before: dict[str, torch.Tensor],
    grads: list[dict[str, torch.Tensor]],
    model: nn.Module,
    ns_dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """One process on the unsharded tensors: torch's Muon + AdamW (``ns_dtype`` None), or our
    Muon with that NS dtype (fp64: the rounding-free answer)."""
    names = {id(p): n for n, p in model.named_parameters()}
    matrices, _ = muon_matrices(model)
    is_matrix = {names[id(p)] for p in matrices}
    params = {n: nn.Parameter(t.clone()) for n, t in before.items()}
    mats = [(n, p) for n, p in params.items() if n in is_matrix]
    rest = [(n, p) for n, p in params.items() if n not in is_matrix]
    if ns_dtype is None:
        opt: torch.optim.Optimizer = Both(
            torch.optim.Muon([p for _, p in mats], **MUON),
            torch.optim.AdamW([p for _, p in rest], **ADAMW),
        )
    else:
        groups = [{"params": mats, "use_muon": True}, {"params": rest, "use_muon": False}]
        opt = Muon(groups, **MUON, adamw_lr=ADAMW["lr"], adamw_betas=BETAS, ns_dtype=ns_dtype)
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _relative(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    """The error of an update, relative to the reference update's norm."""
    return ((got - want).norm() / (want - start).norm().clamp(min=1e-30)).item()


def same_gradient_check(
    build: Callable[[str], tuple[nn.Module, torch.optim.Optimizer]],
    systems: list[str],
    steps: int = 2,
) -> dict[str, Any]:
    """Each system built fresh (``build(name)``), ``steps`` optimizer steps with the same global
    gradients, its parameters gathered; against one process on the unsharded tensors:
    ``bitwise`` (every parameter equal) and the worst relative update error of the Muon
    matrices (``matrix_error``) and of the rest (``rest_error``). ``bf16_vs_fp64``: the same
    for one process's bf16 NS against fp64 NS, the rounding bf16 leaves alone. Collective."""
    report: dict[str, Any] = {}
    reference = None
    for name in systems:
        model, opt = build(name)
        before = _full(model)
        grads = [_gradients(model, seed) for seed in range(steps)]
        if reference is None:  # the systems start from the same weights (asserted below)
            start = before
            reference = _reference(before, grads, model, None)
            exact = _reference(before, grads, model, torch.float64)
            names = {id(p): n for n, p in model.named_parameters()}
            matrices = {names[id(p)] for p in muon_matrices(model)[0]}
            report["bf16_vs_fp64"] = max(
                _relative(reference[n], exact[n], start[n]) for n in matrices
            )
        assert all(torch.equal(before[n], start[n]) for n in start), f"{name}: other weights"
        error = None
        try:
            for g in grads:
                _set_grads(model, g)
                opt.step()
        except Exception as e:  # reported, not hidden
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        entry: dict[str, Any] = {"error": error}
        if error is None:
            after = _full(model)
            errors = {n: _relative(after[n], reference[n], start[n]) for n in after}
            entry["bitwise"] = all(torch.equal(after[n], reference[n]) for n in after)
            entry["matrix_error"] = max(errors[n] for n in matrices)
            entry["rest_error"] = max(
                (v for n, v in errors.items() if n not in matrices), default=0
            )
            entry["vs_fp64"] = max(_relative(after[n], exact[n], start[n]) for n in matrices)
        report[name] = entry
        del model, opt
    dist.barrier()
    return report


def owner_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes our Muon's owner exchange sent from this rank last step (0 for torch's)."""
    return int(getattr(opt, "last_step_stats", {}).get("bytes_sent", 0))
