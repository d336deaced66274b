"""raggedfsdp: Fully Sharded Data Parallel whose shards follow the structure of the math.

Sub-packages: :mod:`raggedfsdp.sharding` (RaggedShard, planner, flat buffers, RaggedTensor),
:mod:`raggedfsdp.comm` (in-place collectives for gloo and NCCL), :mod:`raggedfsdp.fsdp`
(``fully_shard``), :mod:`raggedfsdp.optim` (sharded optimizers), :mod:`raggedfsdp.capacity`
(the capacity planner and its CLI); modules :mod:`raggedfsdp.state_dict` (torch's state-dict
helpers with RaggedTensors gathered and cut) and :mod:`raggedfsdp.checkpoint` (DCP loading
without unpickling arbitrary objects).

The top-level names are imported lazily (PEP 562) so that pure-Python tools such as the
capacity planner's CLI start without importing torch; ``__dir__`` lists them all the same.
"""

from importlib import import_module as _import_module

__version__ = "0.1.0"

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "clip_grad_norm_",
    "fully_shard",
    "register_fsdp_forward_method",
]
_LAZY = dict.fromkeys(__all__, "raggedfsdp.fsdp")  # every top-level name lives there


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(_import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raggedfsdp' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy names beside those already bound (dunders, loaded sub-packages), so ``dir()``
    and tab completion show what ``__getattr__`` serves; private helpers stay out."""
    bound = (name for name in globals() if not name.startswith("_") or name.startswith("__"))
    return sorted({*bound, *__all__})
