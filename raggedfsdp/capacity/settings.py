"""What besides the model the estimate depends on: the mesh, dtypes, units, optimizer, backend.

Each value is checked when it is built, so a bad ``--mesh`` or dtype fails with a message naming
the option before any planning starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from raggedfsdp.capacity.float8 import ALL_GATHER_KINDS, FORMATS
from raggedfsdp.capacity.model_shapes import PlanError
from raggedfsdp.capacity.policies import OptimizerSpec, UnitPolicy
from raggedfsdp.sharding.ep_split import ep_complement
from raggedfsdp.sharding.planner import DEFAULT_ALIGNMENT_BYTES, dtype_itemsize

__all__ = ["BACKENDS", "MAX_SHARD_SIZE", "NAMED_DIMS", "Mesh", "Precision", "Settings"]

#: Per-rank arrays are W floats per distinct group; far beyond any real cluster, refuse.
MAX_SHARD_SIZE = 10_000_000
BACKENDS = ("nccl", "gloo")
#: ``--mesh``'s dim names (torchtitan's), in ``Mesh``'s field order.
NAMED_DIMS = ("dp_replicate", "dp_shard", "tp", "ep")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}


@dataclass(frozen=True)
class Mesh:
    """``replicate x shard x tp`` ranks, torchtitan's ``(dp_replicate, dp_shard, tp)`` order:
    plain FSDP is ``replicate == tp == 1``, HSDP ``tp == 1``. ``fully_shard`` plans each TP
    rank's local tensors over the ``shard`` ranks. ``ep`` is no extra dim: as in torchtitan,
    expert parallelism borrows its ranks from ``dp_shard``, leaving ``shard / ep``
    (``dp_shard_mod_ep``) to shard each EP rank's experts."""

    replicate: int
    shard: int
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for dim in ("replicate", "shard", "tp", "ep"):
            size = getattr(self, dim)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise PlanError(f"mesh {dim} size {size!r}: must be a positive integer")
        if self.shard > MAX_SHARD_SIZE:
            raise PlanError(
                f"shard size {self.shard:,} is above the planner's limit of {MAX_SHARD_SIZE:,} "
                "ranks; use a 2-D mesh (--mesh REPLICATExSHARD) with a smaller shard dimension"
            )
        try:
            ep_complement(self.shard, self.ep)
        except ValueError as err:
            raise PlanError(f"--mesh {self.text}: {err}") from None

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tp

    @property
    def text(self) -> str:
        """The ``--mesh`` that gives this mesh: ``RxS[xT]``, or named dims with an ep dim."""
        if self.ep > 1:
            tp = f",tp={self.tp}" if self.tp > 1 else ""
            return f"dp_replicate={self.replicate},dp_shard={self.shard}{tp},ep={self.ep}"
        dims = (
            (self.replicate, self.shard, self.tp) if self.tp > 1 else (self.replicate, self.shard)
        )
        return "x".join(map(str, dims))

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """``"256"`` (FSDP), ``"4x256"`` (HSDP: 4 replicas of 256-rank shard groups),
        ``"4x32x8"`` (HSDP x TP: each of those ranks a group of 8 tensor-parallel ones), or
        torchtitan's dim names, ``"dp_replicate=4,dp_shard=256,ep=8"`` (``tp=`` too; only
        ``dp_shard`` is required), the one form that takes an ep dim."""
        if "=" in text:
            return cls._parse_named(text)
        parts = re.split(r"\s*[x×,*]\s*", text.strip().lower())
        if len(parts) > 3:
            raise PlanError(
                f"--mesh {text!r}: {len(parts)} dimensions, expected SHARD or REPLICATExSHARD[xTP] "
                "(torchtitan's dp_replicate, dp_shard, tp); fold the outer dimensions into "
                "REPLICATE, e.g. 2x2x2x2 -> 4x2x2"
            )
        if not all(re.fullmatch(r"[+-]?\d+", p) for p in parts):
            raise PlanError(
                f"--mesh {text!r}: expected SHARD or REPLICATExSHARD[xTP] with positive integers, "
                "e.g. --mesh 4x256 (4 replicas of 256-rank shard groups) or 4x32x8 (tp 8)"
            )
        sizes = [int(p) for p in parts]
        if any(s < 1 for s in sizes):
            raise PlanError(f"--mesh {text!r}: every dimension must be >= 1, got {sizes}")
        return cls(*sizes) if len(sizes) > 1 else cls(1, sizes[0])

    @classmethod
    def _parse_named(cls, text: str) -> Mesh:
        """``dp_replicate=R,dp_shard=S,tp=T,ep=E`` in any order, each name at most once."""
        sizes: dict[str, int] = {}
        for item in filter(None, (p.strip() for p in text.lower().split(","))):
            name, _, value = (s.strip() for s in item.partition("="))
            if name not in NAMED_DIMS or name in sizes or not re.fullmatch(r"\d+", value):
                raise PlanError(
                    f"--mesh {text!r}: {item!r} is not NAME=SIZE with NAME one of "
                    f"{', '.join(NAMED_DIMS)} (each once) and SIZE >= 1, e.g. --mesh "
                    "dp_replicate=1,dp_shard=16,ep=8"
                )
            sizes[name] = int(value)
        if "dp_shard" not in sizes:
            raise PlanError(
                f"--mesh {text!r}: dp_shard is missing; name the shard dim's size, e.g. "
                "--mesh dp_shard=16,ep=8"
            )
        return cls(*(sizes.get(name, 1) for name in NAMED_DIMS))


@dataclass(frozen=True)
class Precision:
    """Dtype names of the all-gather/compute copy, the master weights and the gradient
    reduction (``fp32``/``bf16``/``fp16``/``fp8`` or torch names such as ``bfloat16``)."""

    param: str = "bfloat16"
    master: str = "float32"
    reduce: str = "float32"

    def __post_init__(self) -> None:
        for role in ("param", "master", "reduce"):
            name = _DTYPES.get(getattr(self, role), getattr(self, role))
            try:
                dtype_itemsize(name)
            except ValueError:
                raise PlanError(
                    f"--{role}-dtype {getattr(self, role)!r}: unknown; use one of "
                    f"{sorted(_DTYPES)} or a torch dtype name such as bfloat16"
                ) from None
            object.__setattr__(self, role, name)

    def bytes(self, role: str) -> int:
        return dtype_itemsize(getattr(self, role))


@dataclass(frozen=True)
class Settings:
    """Everything besides the model that the estimate depends on.

    ``backend``: ``"nccl"`` (``fully_shard`` leaves one reduce-scatter running while the next
    group's backward computes) or ``"gloo"`` (each reduce-scatter is finished at once); on both
    all-gathers land in place.
    """

    mesh: Mesh
    units: UnitPolicy = field(default_factory=UnitPolicy)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    precision: Precision = field(default_factory=Precision)
    reshard_after_forward: bool = True
    backend: str = "nccl"
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES
    all_gather: str = "param"  # "fp8": Float8Blocks(128), "mxfp8": MXFP8Blocks() all-gathers
    #: With an ep dim: tokens each rank routes per step and experts per token (the all-to-all).
    tokens_per_rank: int = 4096
    top_k: int | None = None

    def __post_init__(self) -> None:
        self._check_ep()
        if self.backend not in BACKENDS:
            raise PlanError(f"backend {self.backend!r}: choose one of {list(BACKENDS)}")
        if self.all_gather not in ALL_GATHER_KINDS:
            raise PlanError(
                f"--all-gather {self.all_gather!r}: choose one of {list(ALL_GATHER_KINDS)}"
            )
        if self.all_gather != "param" and self.mesh.tp > 1:
            raise PlanError(
                f"--all-gather {self.all_gather} with tp {self.mesh.tp} (--mesh "
                f"{self.mesh.text}): fully_shard refuses FP8 gathers of tensor-parallel "
                "parameters (a tile of the global tensor is not on one rank); use --all-gather "
                "param or a mesh without a tp dim"
            )

    def _check_ep(self) -> None:
        """What an ep dim needs (a top-k for the all-to-all) and refuses: FP8 gathers, which
        ``fully_shard`` refuses for the experts' DTensors as for TP ones, and Muon, whose
        owners over EP experts the planner does not model."""
        mesh = self.mesh
        for key in ("tokens_per_rank", "top_k"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PlanError(f"--{key.replace('_', '-')} {value!r}: must be an integer >= 1")
        if mesh.ep == 1:
            return
        refused = [
            (self.top_k is None, "the all-to-all bytes need the experts each token is routed "
             "to: give --top-k K (the model's num_experts_per_tok)"),
            (self.all_gather != "param", f"--all-gather {self.all_gather}: fully_shard refuses "
             "FP8 gathers of the experts' DTensors as of TP ones; use --all-gather param"),
            (self.optimizer.name == "muon", "--optimizer muon: Muon's owners over EP experts "
             "are not modelled; plan with --optimizer adamw, or drop ep from --mesh"),
        ]  # fmt: skip
        for bad, why in refused:
            if bad:
                raise PlanError(f"--mesh {mesh.text}: {why}")

    def describe_units(self) -> str:
        """The user's unit and, with an FP8 gather, the tile units ``fully_shard`` combines it
        with: those set the padding then, so the report names them."""
        units = self.units.describe()
        if self.all_gather not in FORMATS:
            return units
        return f"{units}; {FORMATS[self.all_gather].units} for {self.all_gather}'s tiles"
