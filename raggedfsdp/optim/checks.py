"""Input checks that keep a sharded optimizer from corrupting state silently.

Most mistakes (a sparse gradient, a parameter listed twice) fail loudly in torch too. The
dangerous one is specific to sharding, ranks that disagree about the parameter list: the
fingerprint in :mod:`raggedfsdp.comm.fingerprint` catches it at construction.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["check_grad"]


def check_grad(name: str, param: Tensor, grad: Tensor) -> None:
    """Gradients the update math cannot use, with the fix in the message."""
    if grad.is_sparse:
        raise RuntimeError(
            f"parameter {name!r} has a sparse gradient; raggedfsdp.optim needs dense gradients "
            "(use torch.optim.SparseAdam for sparse embeddings, or nn.Embedding(sparse=False))"
        )
    if grad.is_complex():
        raise RuntimeError(
            f"parameter {name!r} has a complex gradient; raggedfsdp.optim works on real tensors: "
            "store the parameter as torch.view_as_real(...) and view it as complex in forward"
        )
    if grad.shape != param.shape or grad.dtype != param.dtype:
        raise RuntimeError(
            f"parameter {name!r}: gradient of shape {tuple(grad.shape)} and dtype {grad.dtype} "
            f"does not match the parameter ({tuple(param.shape)}, {param.dtype})"
        )
