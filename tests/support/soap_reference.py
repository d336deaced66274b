"""SOAP (Vyas et al., 2024, Algorithm 3) as a float64 loop, one parameter and one block at a time.

Written from the paper, independently of ``raggedfsdp.optim.soap`` (no shared code): the first
call builds the factors and their eigenbases; then the first moment in the parameter's basis,
the second in the eigenbasis, bias correction in the step size, decoupled weight decay after the
step, and a power-iteration + QR refresh of each basis every ``precondition_frequency`` Adam
steps with the second moment re-ordered. Blocks follow ``Shampoo``'s grid.
"""

from __future__ import annotations

import torch

from tests.support.shampoo_reference import matrix_view

DEFAULTS = {
    "lr": 3e-3,
    "betas": (0.95, 0.95),
    "shampoo_beta": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "precondition_frequency": 10,
    "max_preconditioner_dim": 1024,
    "correct_bias": True,
    "merge_dims": False,
    "precondition_1d": False,
}


def _eigenvectors_descending(a: torch.Tensor) -> torch.Tensor:
    _, q = torch.linalg.eigh(a)
    return q[:, list(range(q.shape[1] - 1, -1, -1))]


def _refresh(a: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration from ``q``, columns sorted by their Rayleigh quotients, then QR."""
    product = a @ q
    quotients = torch.stack([q[:, i] @ product[:, i] for i in range(q.shape[1])])
    order = torch.argsort(quotients, descending=True, stable=True)
    return torch.linalg.qr(product[:, order])[0], order


def _block(s: dict, key, gb: torch.Tensor, mb: torch.Tensor, t: int, c: dict) -> torch.Tensor:
    """The block's rotated-back Adam direction (zeros on the first call); then its factors and,
    when due, its refreshed bases."""
    b2, beta = c["betas"][1], c["shampoo_beta"]
    order = key[2]
    grams = [gb @ gb.T, gb.T @ gb][:order]
    if key not in s:
        s[key] = {"F": [(1 - beta) * x for x in grams], "V": torch.zeros_like(gb)}
        s[key]["Q"] = [_eigenvectors_descending(f) for f in s[key]["F"]]
        return torch.zeros_like(gb)
    k = s[key]
    q = k["Q"]

    def rot(x: torch.Tensor) -> torch.Tensor:
        return q[0].T @ x @ q[1] if order == 2 else q[0].T @ x

    k["V"] = b2 * k["V"] + (1 - b2) * rot(gb) ** 2
    n = rot(mb) / (k["V"].sqrt() + c["eps"])
    direction = q[0] @ n @ q[1].T if order == 2 else q[0] @ n
    k["F"] = [beta * f + (1 - beta) * x for f, x in zip(k["F"], grams, strict=True)]
    if t % c["precondition_frequency"] == 0:
        for side in range(order):
            k["Q"][side], new_order = _refresh(k["F"][side], k["Q"][side])
            k["V"] = k["V"][new_order] if side == 0 else k["V"][:, new_order]
    return direction


def _param_step(p: torch.Tensor, g: torch.Tensor, s: dict, t: int, c: dict) -> None:
    """Adam step ``t`` (0: the first call, which only builds the preconditioner)."""
    b1, b2, size = *c["betas"], c["max_preconditioner_dim"]
    view = matrix_view(tuple(p.shape), c)
    if t > 0:
        s["m"] = b1 * s["m"] + (1 - b1) * g
    if view is None:
        if t == 0:
            return
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        n = s["m"] / (s["v"].sqrt() + c["eps"])
    else:
        rows, cols, order = view
        gm, mm = g.reshape(rows, cols), s["m"].reshape(rows, cols)
        n = torch.zeros(rows, cols, dtype=torch.float64)
        for r0 in range(0, rows, size):
            for c0 in range(0, cols, size):
                blk = (slice(r0, r0 + size), slice(c0, c0 + size))
                n[blk] = _block(s, (r0, c0, order), gm[blk], mm[blk], t, c)
        if t == 0:
            return
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
