"""DistributedShampoo's rule as a float64 loop, one parameter and one block at a time.

Written from the rule's description (DistributedShampoo's documentation and the Shampoo
papers), independently of ``raggedfsdp.optim.shampoo``: no code is shared with it, so the tests
compare two implementations. Dimension merging, the block grid, grafting, exponents, epsilon
placement, the root schedule and dampened Nesterov are all spelled out here.
"""

from __future__ import annotations

import math

import torch

DEFAULTS = {
    "lr": 1e-2,
    "betas": (0.9, 1.0),
    "epsilon": 1e-12,
    "momentum": 0.0,
    "dampening": 0.0,
    "weight_decay": 0.0,
    "max_preconditioner_dim": 1024,
    "precondition_frequency": 1,
    "start_preconditioning_step": -1,
    "use_nesterov": False,
    "use_bias_correction": True,
    "use_decoupled_weight_decay": True,
    "grafting": "adam",
    "grafting_beta2": 0.99,
    "grafting_epsilon": 1e-10,
    "inverse_exponent_override": {},
    "root_method": "eigh",
    "epsilon_before_decomposition": False,
    "merge_dims": False,
    "precondition_1d": False,
}


def matrix_view(shape: tuple[int, ...], c: dict) -> tuple[int, int, int] | None:
    """(rows, cols, order) of the preconditioned view, or None (grafting only)."""
    dims = list(shape)
    if c["merge_dims"]:
        merged = [dims[0]]
        for d in dims[1:]:
            if merged[-1] == 1 or d == 1 or merged[-1] * d <= c["max_preconditioner_dim"]:
                merged[-1] = merged[-1] * d
            else:
                merged.append(d)
        dims = merged
    if math.prod(shape) == 0:
        return None
    if len(dims) == 1:
        return (dims[0], 1, 1) if c["precondition_1d"] else None
    return math.prod(dims[:-1]), dims[-1], 2


def exponents(c: dict, order: int) -> list[float]:
    override = c["inverse_exponent_override"].get(order, 1 / (2 * order))
    if isinstance(override, dict):
        return [override.get(d, 1 / (2 * order)) for d in range(order)]
    return [override] * order


def inverse_root(a: torch.Tensor, p: float, eps: float, before: bool) -> torch.Tensor:
    if before:
        lam, q = torch.linalg.eigh(a + eps * torch.eye(a.shape[0], dtype=a.dtype))
        if lam.min() < eps:
            lam = lam - lam.min() + eps
    else:
        lam, q = torch.linalg.eigh(a)
        lam = lam - min(lam.min().item(), 0.0) + eps
    return q @ torch.diag(lam ** (-p)) @ q.T


def _block_direction(s: dict, key, gb, fb, ab, t: int, c: dict, order: int) -> torch.Tensor:
    """Factors, roots when due, and the block's (grafted) Shampoo direction, or None."""
    b2, freq = c["betas"][1], c["precondition_frequency"]
    start = freq if c["start_preconditioning_step"] == -1 else c["start_preconditioning_step"]
    exps = exponents(c, order)
    if key not in s:
        s[key] = {"F": [torch.zeros(n, n, dtype=torch.float64) for n in gb.shape[:order]]}
        s[key]["I"] = [torch.eye(n, dtype=torch.float64) for n in gb.shape[:order]]
    k = s[key]
    outers = [gb @ gb.T, gb.T @ gb][:order]
    for i in range(order):
        k["F"][i] = k["F"][i] + outers[i] if b2 == 1 else b2 * k["F"][i] + (1 - b2) * outers[i]
    if t == start or (t > start and t % freq == 0):
        bc = 1 - b2**t if c["use_bias_correction"] and b2 < 1 else 1.0
        for i in range(order):
            if exps[i] > 0:
                before = c["epsilon_before_decomposition"] or c["root_method"] == "newton"
                k["I"][i] = inverse_root(k["F"][i] / bc, exps[i], c["epsilon"], before)
    if t < start:
        return None
    out = k["I"][0] @ fb
    if order == 2:
        out = out @ k["I"][1]
    if c["grafting"] is not None:
        out = out * (ab.norm() / (out.norm() + 1e-16))
    return out


def _graft(s: dict, g, f_hat, t: int, c: dict) -> torch.Tensor | None:
    kind, gb2, geps = c["grafting"], c["grafting_beta2"], c["grafting_epsilon"]
    if kind is None:
        return None
    if kind == "sgd":
        return f_hat
    gb2 = 1.0 if kind == "adagrad" else gb2
    s["v"] = s["v"] + g * g if gb2 == 1 else gb2 * s["v"] + (1 - gb2) * g * g
    v_hat = s["v"] / (1 - gb2**t) if kind == "adam" and gb2 < 1 else s["v"]
    return f_hat / (v_hat.sqrt() + geps)


def _param_step(p, g, s: dict, t: int, c: dict) -> None:
    b1, wd, size = c["betas"][0], c["weight_decay"], c["max_preconditioner_dim"]
    if wd and not c["use_decoupled_weight_decay"]:
        g = g + wd * p
    s["f"] = b1 * s["f"] + (1 - b1) * g
    f_hat = s["f"] / (1 - b1**t) if c["use_bias_correction"] else s["f"]
    f_hat = g if b1 == 0 else f_hat
    a = _graft(s, g, f_hat, t, c)
    d = (f_hat if a is None else a).clone()
    view = matrix_view(tuple(p.shape), c)
    if view is not None:
        rows, cols, order = view
        gm, fm, am, dm = (x.reshape(rows, cols) for x in (g, f_hat, f_hat if a is None else a, d))
        for r0 in range(0, rows, size):
            for c0 in range(0, cols, size):
                blk = (slice(r0, r0 + size), slice(c0, c0 + size))
                out = _block_direction(s, (r0, c0), gm[blk], fm[blk], am[blk], t, c, order)
                if out is not None:
                    dm[blk] = out
    if c["use_decoupled_weight_decay"]:
        d = d + wd * p
    if c["momentum"]:
        mu, damp = c["momentum"], c["dampening"]
        s["m"] = mu * s["m"] + (1 - damp) * d
        d = (1 - damp) * d + mu * s["m"] if c["use_nesterov"] else s["m"]
    p -= c["lr"] * d


def reference(
    init: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], config: dict
) -> dict[str, torch.Tensor]:
    """The parameters after ``len(grads)`` steps of DistributedShampoo's rule, in float64."""
    c = {**DEFAULTS, **config}
    params = {n: t.double().clone() for n, t in init.items()}
    state = {n: {k: torch.zeros_like(p) for k in "fvm"} for n, p in params.items()}
    for t, step_grads in enumerate(grads, start=1):
        for name, p in params.items():
            _param_step(p, step_grads[name].double(), state[name], t, c)
    return params
