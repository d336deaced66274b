"""SOAP (Vyas et al., 2024, Algorithm 3) as a float64 loop, one parameter and one block at a time.

Written from the paper and the behaviour of the authors' ``soap.py``, independently of
``raggedfsdp.optim.soap`` (no shared code): the first call builds the factors and their
eigenbases; then Adam in the eigenbasis, bias correction in the step size, decoupled weight
decay after the step, and a power-iteration + QR refresh of each basis every
``precondition_frequency`` Adam steps with the second moment re-ordered.

The first moment is kept as the authors' code keeps it: in the rotated basis, rotated back to
the parameter's basis before the factors are updated and forward again into the (possibly
refreshed) basis after, every step. The authors' options:

* ``normalize_grads``: the rotated-back update divided by ``1e-30 + sqrt(mean(update²))``
  over the whole parameter, before the step;
* ``shampoo_beta`` None or negative: β₂;
* ``large_dims="skip"``: no blocks; a dim above ``max_preconditioner_dim`` keeps no factor (a
  tensor with none left is plain Adam);
* ``tensor_factors="per_dim"``: one factor per dim of a tensor of 2+ dims (of its merged shape
  with ``merge_dims``, the authors' merging), contracted over every other dim; a tensor of 2+
  dims merged into one keeps its factor.

Blocks (``large_dims="block"``) follow ``Shampoo``'s grid: cut every dim at multiples of ``B``.
"""

from __future__ import annotations

import itertools
import math

import torch

from tests.support.shampoo_reference import matrix_view

DEFAULTS = {
    "lr": 3e-3,
    "betas": (0.95, 0.95),
    "shampoo_beta": None,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "precondition_frequency": 10,
    "max_preconditioner_dim": 1024,
    "correct_bias": True,
    "merge_dims": False,
    "precondition_1d": False,
    "normalize_grads": False,
    "large_dims": "block",
    "tensor_factors": "matrix",
}


def authors_merge(shape: tuple[int, ...], limit: int) -> list[int]:
    """The authors' merging: neighbouring dims join while their product stays within
    ``limit``; a dim above it stands alone."""
    out, run = [], 1
    for d in shape:
        if run * d <= limit:
            run *= d
            continue
        if run > 1:
            out.append(run)
        run = d
        if d > limit:
            out.append(d)
            run = 1
    if run > 1 or not out:
        out.append(run)
    return out


def layout(shape: tuple[int, ...], c: dict) -> tuple[list[int], list[int], list[bool]] | None:
    """``(dims, block sides, factored)`` of the tensor as preconditioned, or None (plain Adam)."""
    limit = c["max_preconditioner_dim"]
    if c["tensor_factors"] == "per_dim" and len(shape) >= 2 and math.prod(shape) > 0:
        dims = authors_merge(shape, limit) if c["merge_dims"] else list(shape)
    else:
        view = matrix_view(shape, c)
        if view is None:
            return None
        rows, cols, order = view
        dims = [rows, cols] if order == 2 else [rows]
    if c["large_dims"] == "skip":
        factored = [d <= limit for d in dims]
        return (dims, dims, factored) if any(factored) else None
    return dims, [min(limit, d) for d in dims], [True] * len(dims)


def _eigenvectors_descending(a: torch.Tensor) -> torch.Tensor:
    _, q = torch.linalg.eigh(a)
    return q[:, list(range(q.shape[1] - 1, -1, -1))]


def _refresh(a: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration from ``q``, columns sorted by their Rayleigh quotients, then QR."""
    product = a @ q
    quotients = torch.stack([q[:, i] @ product[:, i] for i in range(q.shape[1])])
    order = torch.argsort(quotients, descending=True, stable=True)
    return torch.linalg.qr(product[:, order])[0], order


def _contract_all_but(x: torch.Tensor, d: int) -> torch.Tensor:
    """``Σ`` over every index but ``d`` of ``x ⊗ x``: the dim-``d`` factor's statistic."""
    others = [i for i in range(x.dim()) if i != d]
    return torch.tensordot(x, x, dims=(others, others))


def _project(x: torch.Tensor, bases: list, back: bool = False) -> torch.Tensor:
    """Contract dim 0 with each basis in turn (its rows forward, its columns back), moving it
    last: after every dim, ``x`` is rotated along each and back in its own dim order."""
    for q in bases:
        if q is None:
            x = x.permute(*range(1, x.dim()), 0)
        else:
            x = torch.tensordot(x, q, dims=([0], [1 if back else 0]))
    return x


def _shampoo_beta(c: dict) -> float:
    beta = c["shampoo_beta"]
    return c["betas"][1] if beta is None or beta < 0 else beta


def _block(s: dict, key, gb: torch.Tensor, t: int, c: dict, factored: list[bool]) -> torch.Tensor:
    """The block's rotated-back Adam direction (zeros on the first call); then its factors and,
    when due, its refreshed bases, with the first moment carried into the new basis."""
    b1, b2, beta = *c["betas"], _shampoo_beta(c)
    stats = [_contract_all_but(gb, d) if f else None for d, f in enumerate(factored)]
    if key not in s:
        factors = [None if x is None else (1 - beta) * x for x in stats]
        bases = [None if f is None else _eigenvectors_descending(f) for f in factors]
        s[key] = {"F": factors, "Q": bases, "M": torch.zeros_like(gb), "V": torch.zeros_like(gb)}
        return torch.zeros_like(gb)
    k = s[key]
    rotated = _project(gb, k["Q"])
    k["M"] = b1 * k["M"] + (1 - b1) * rotated
    k["V"] = b2 * k["V"] + (1 - b2) * rotated**2
    direction = _project(k["M"] / (k["V"].sqrt() + c["eps"]), k["Q"], back=True)
    moment = _project(k["M"], k["Q"], back=True)
    k["F"] = [
        None if f is None else beta * f + (1 - beta) * x for f, x in zip(k["F"], stats, strict=True)
    ]
    if t % c["precondition_frequency"] == 0:
        for d, f in enumerate(k["F"]):
            if f is not None:
                k["Q"][d], order = _refresh(f, k["Q"][d])
                k["V"] = k["V"].index_select(d, order)
    k["M"] = _project(moment, k["Q"])
    return direction


def _param_step(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, c: dict) -> None:
    """Adam step ``t`` (0: the first call, which only builds the preconditioner)."""
    b1, b2 = c["betas"]
    plan = layout(tuple(p.shape), c)
    if plan is None:
        if t == 0:
            return
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        n = s["m"] / (s["v"].sqrt() + c["eps"])
    else:
        dims, sides, factored = plan
        gt = g.reshape(dims)
        n = torch.zeros(dims, dtype=torch.float64)
        starts = [range(0, d, side) for d, side in zip(dims, sides, strict=True)]
        for corner in itertools.product(*starts):
            blk = tuple(slice(a, a + side) for a, side in zip(corner, sides, strict=True))
            n[blk] = _block(s, corner, gt[blk], t, c, factored)
        if t == 0:
            return
    if c["normalize_grads"]:
        n = n / (1e-30 + torch.mean(n**2) ** 0.5)
    step = c["lr"] * (1 - b2**t) ** 0.5 / (1 - b1**t) if c["correct_bias"] else c["lr"]
    p -= step * n.reshape(p.shape)
    p -= c["lr"] * c["weight_decay"] * p


def reference(
    init: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], config: dict
) -> dict[str, torch.Tensor]:
    """The parameters after ``len(grads)`` calls of SOAP, in float64."""
    c = {**DEFAULTS, **config}
    params = {n: x.double().clone() for n, x in init.items()}
    state = {n: {"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for n, p in params.items()}
    for t, step_grads in enumerate(grads):
        for name, p in params.items():
            _param_step(p, step_grads[name].double(), state[name], t, c)
    return params
