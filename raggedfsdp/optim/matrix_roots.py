"""Matrix functions of the Shampoo family: inverse roots of factor blocks and their eigenbases.

For a symmetric positive semi-definite factor ``A`` (``n × n``) and an exponent ``p``:

* **eigh** (``A = Q diag(λ) Qᵀ``): ``A^{-p} = Q diag(λ^{-p}) Qᵀ`` with ``λ`` made positive by
  epsilon, in one of DistributedShampoo's two forms: *after* the decomposition,
  ``λ ← λ - min(λ_min, 0) + ε``; or *before* it, ``A + εI`` is decomposed and, only when
  ``λ_min < ε``, ``λ ← λ - λ_min + ε`` (its ``perturb_before_computation``).
* **Coupled Newton** (Higham's coupled inverse iteration, matmuls only, for ``p = 1/r`` with ``r``
  a positive integer): ``z = (r + 1) / (2‖A + εI‖_F)``, ``X = z^{1/r} I``, ``M = z (A + εI)``;
  repeat ``T = (1 + 1/r) I - M / r``, ``X ← X T``, ``M ← T^r M`` until ``max|M - I| ≤ tol``.
  Then ``X → A^{-1/r}``. ``NEWTON_TOLERANCE`` and ``NEWTON_MAX_ITERATIONS`` are
  DistributedShampoo's defaults; a root that does not converge (or is not finite) falls back
  to eigh, and both outcomes are counted.
* **Eigenbasis** (SOAP): the eigenvectors of ``A`` with eigenvalues in descending order, and its
  refresh from a previous basis ``Q`` by one power iteration and a QR step: order ``Q``'s
  columns by ``diag(Qᵀ A Q)``, descending, then ``Q ← qr(A Q[:, order]).Q``.

Equal-size eigendecompositions run as one batched ``torch.linalg.eigh`` when every matrix of
the batch starts 64-byte aligned in it (``n² · itemsize`` a multiple of 64): on CPU (MKL) such a
slot is then bitwise the matrix's own decomposition, measured and tested, so batching never
changes a result and results stay independent of which blocks share a rank. Other sizes run
one by one. ``batching=None`` batches CPU tensors only: on CUDA, torch may decompose a batch
with another algorithm than a single matrix (cuSOLVER's batched Jacobi for small sizes), which
is not verified bitwise here, so it is used there only when asked (``batching=True``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "NEWTON_MAX_ITERATIONS",
    "NEWTON_TOLERANCE",
    "RootJob",
    "batchable",
    "descending_eigenbasis",
    "inverse_roots_",
    "refresh_eigenbasis",
]

#: Coupled Newton stops when ``max|M - I|`` is at most this (DistributedShampoo's default).
NEWTON_TOLERANCE = 1e-6
#: ... or after this many iterations, then falls back to eigh (DistributedShampoo's default).
NEWTON_MAX_ITERATIONS = 100
#: A batch slot must start this many bytes into the batch for batched eigh to be bitwise exact.
_ALIGNMENT_BYTES = 64


@dataclass
class RootJob:
    """One factor block whose inverse root is due: ``out = factor^{-exponent}``."""

    factor: Tensor  # n × n, already bias-corrected
    out: Tensor  # n × n view of the stored root (keeps its value when the root fails)
    exponent: float


def batchable(n: int, dtype: torch.dtype) -> bool:
    """Whether ``n × n`` matrices of ``dtype`` may share one batched decomposition."""
    return (n * n * dtype.itemsize) % _ALIGNMENT_BYTES == 0


# ----------------------------------------------------------------------------- eigh
def _eigh(matrix: Tensor, stats: dict[str, int]) -> tuple[Tensor, Tensor] | None:
    """``eigh`` of one finite matrix, retried in fp64 when it fails; None when both fail."""
    try:
        return torch.linalg.eigh(matrix)
    except RuntimeError:
        if matrix.dtype == torch.float64:
            return None
        stats["fp64_retries"] += 1
        with contextlib.suppress(RuntimeError):
            return torch.linalg.eigh(matrix.double())
    return None


def _batching(batching: bool | None, device: torch.device) -> bool:
    """Whether to batch on ``device``: True, False, or None (CPU only; module docstring)."""
    return batching if batching is not None else device.type == "cpu"


def _decompose(
    matrices: Sequence[Tensor], stats: dict[str, int], batching: bool | None = None
) -> list[tuple | None]:
    """Eigendecompositions of contiguous symmetric matrices: batched by size where
    ``batching`` allows and ``batchable``, one by one otherwise; None for non-finite matrices
    and failures."""
    out: list[tuple | None] = [None] * len(matrices)
    by_size: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, m in enumerate(matrices):
        stats["eigendecompositions"] += 1
        stats["eigh_cost"] += m.shape[0] ** 3
        if bool(torch.isfinite(m).all()):
            by_size.setdefault((m.shape[0], m.dtype), []).append(i)
    for (n, dtype), members in by_size.items():
        batch = _batching(batching, matrices[members[0]].device)
        if batch and len(members) > 1 and batchable(n, dtype):
            with contextlib.suppress(RuntimeError):  # a failure: per matrix, with retries
                lam, q = torch.linalg.eigh(torch.stack([matrices[i] for i in members]))
                for k, i in enumerate(members):
                    out[i] = (lam[k], q[k])
                stats["eigh_batched"] += len(members)
                continue
        for i in members:
            out[i] = _eigh(matrices[i], stats)
    return out


def _root_from_eigh(lam: Tensor, q: Tensor, exponent: float, eps: float, before: bool) -> Tensor:
    """``Q diag(λ^{-p}) Qᵀ`` with ``λ`` made positive by epsilon (see the module docstring)."""
    low = lam.min()
    if before:
        if low < eps:
            lam = lam - low + eps
    else:
        lam = lam - torch.clamp(low, max=0.0) + eps
    return (q * lam.pow(-exponent).unsqueeze(0)) @ q.T


# ----------------------------------------------------------------------------- Newton
def _newton_root(a: Tensor, r: int, eps: float) -> tuple[Tensor, int, bool]:
    """Coupled Newton for ``(a + εI)^{-1/r}``: the root, iterations run, converged."""
    n = a.shape[0]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    ridge = a + eps * eye
    z = (r + 1) / (2 * torch.linalg.matrix_norm(ridge))
    x = z ** (1 / r) * eye
    m = z * ridge
    error = (m - eye).abs().max()
    it = 0
    while error > NEWTON_TOLERANCE and it < NEWTON_MAX_ITERATIONS:
        it += 1
        t = m.mul(-1 / r).add_(eye, alpha=1 + 1 / r)
        x = x @ t
        m = torch.linalg.matrix_power(t, r) @ m
        error = (m - eye).abs().max()
    ok = bool(error <= NEWTON_TOLERANCE) and bool(torch.isfinite(x).all())
    return x, it, ok


# ----------------------------------------------------------------------------- entry point
def inverse_roots_(
    jobs: Sequence[RootJob],
    eps: float,
    epsilon_before: bool,
    method: str,
    stats: dict[str, int],
    batching: bool | None = None,
) -> None:
    """Write every job's ``factor^{-exponent}`` into its ``out``.

    ``method`` is ``"eigh"`` or ``"newton"`` (coupled Newton, which always adds ``εI`` first;
    unconverged roots fall back to eigh). A factor that is not finite, or whose decomposition
    fails in fp32 and fp64, keeps its previous root and counts in ``stats["root_failures"]``.
    """
    pending = list(jobs)
    if method == "newton":
        pending = []
        for job in jobs:
            stats["newton_roots"] += 1
            x, it, ok = _newton_root(job.factor, round(1 / job.exponent), eps)
            stats["newton_iterations"] += it
            if ok:
                job.out.copy_(x)
            else:
                stats["newton_fallbacks"] += 1
                pending.append(job)
        epsilon_before = True  # the fallback perturbs where Newton did
    matrices = []
    for job in pending:
        m = job.factor.contiguous()
        if epsilon_before:
            m = m + eps * torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
        matrices.append(m)
    for job, decomposed in zip(pending, _decompose(matrices, stats, batching), strict=True):
        root = None
        if decomposed is not None:
            lam, q = decomposed
            root = _root_from_eigh(lam, q, job.exponent, eps, epsilon_before)
        if root is None or not bool(torch.isfinite(root).all()):
            stats["root_failures"] += 1
            continue
        job.out.copy_(root)


def descending_eigenbasis(
    matrices: Sequence[Tensor], stats: dict[str, int], batching: bool | None = None
) -> list[Tensor | None]:
    """SOAP's first basis of each matrix: its eigenvectors, largest eigenvalue first (None
    where the matrix is not finite or eigh fails in fp32 and fp64)."""
    out: list[Tensor | None] = []
    for decomposed in _decompose([m.contiguous() for m in matrices], stats, batching):
        out.append(None if decomposed is None else decomposed[1].flip(-1))
    return out


def refresh_eigenbasis(a: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """SOAP's refresh: ``(qr(A Q[:, order]).Q, order)``, ``order`` sorting the columns of ``Q``
    by their estimated eigenvalues ``diag(Qᵀ A Q)``, largest first (stable on ties)."""
    aq = a @ q
    estimate = (q * aq).sum(0)
    order = torch.argsort(estimate, descending=True, stable=True)
    basis, _ = torch.linalg.qr(aq[:, order])
    return basis, order
