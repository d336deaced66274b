"""``AdamW8bit``: AdamW with block-wise 8-bit moments, blocks whole on one rank.

Each step dequantizes the moments of a piece, runs AdamW in fp32, and requantizes them with a
fresh absmax per block (bitsandbytes' scheme; the op sequence is torchao's ``AdamW8bit``, so one
process gives its results bitwise): :func:`adamw8bit_update_` at the top of this file. Blocks are
fixed by the *parameter*: 256 consecutive elements of its flat index (``block_size``), or
``tile = (rows, cols)`` tiles of its 2-D view (``raggedfsdp.sharding.blocks.QuantBlocks``), and
whether a parameter is quantized depends on its global size only. Shards are cut on block
boundaries (``shard_policy``), so each rank quantizes whole blocks of its own and the results are
the same bits at every world size.

``fused=True`` runs the step in one pass per block instead of about fifty eager passes: on CPU
for fp32 parameters a hand-written kernel (``native.py``: each block decoded once, AVX-512
gathers from L1-sized tables; its codes and scales are the eager step's bits), elsewhere
compiled (``torch.compile`` of :func:`adamw8bit_blocks_`, the same math region by region, as
torchao does). The state format, the blocks and the world-size invariance are the same;
parameters differ from the eager step by an ulp where rounding differs (eager ``sqrt`` on CPU is
MKL's, not correctly rounded; inductor's ``lerp`` is no FMA), see ``docs/optimizers.md``.

State per quantized parameter: ``<moment>_codes`` (uint8, the parameter's shape and split) and
``<moment>_absmax`` (fp32, one per block: shape ``(num_blocks,)`` or the tile grid, split with
the blocks), both indexed by global position, so DCP reshards them like any tensor. Parameters
below ``min_8bit_size`` elements keep torch-style ``exp_avg`` / ``exp_avg_sq`` in their dtype.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from raggedfsdp.comm.mesh import MeshLike
from raggedfsdp.optim.adamw import check_adam_args
from raggedfsdp.optim.base import ShardedOptimizer
from raggedfsdp.optim.compiled import CompiledRegions, use_compiled
from raggedfsdp.optim.contract import Piece, StateSpec, check_unit_alignment
from raggedfsdp.optim.native import cpu_kernel, native_update_
from raggedfsdp.optim.pieces import flat, merge_runs, unwrap
from raggedfsdp.optim.quant import (
    BlockGrid,
    QuantMap,
    dequantize_,
    dequantize_blocks,
    quantize_,
    quantize_blocks_,
)
from raggedfsdp.sharding import RaggedShard, ShardPolicy
from raggedfsdp.sharding.blocks import QuantBlocks
from raggedfsdp.sharding.quant_tp import quant_split_grid
from raggedfsdp.sharding.tp_shard import TPRaggedShard, TPShard, tp_split_of
from raggedfsdp.sharding.units import adamw8bit_policy, is_quantized, quantized_unit

__all__ = ["AdamW8bit", "adamw8bit_blocks_", "adamw8bit_update_", "adamw_fp32"]

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}


# ----------------------------------------------------------------------------- the math
@dataclass(frozen=True)
class _Hyper:
    """One step's scalars, as fp32 host tensors where torchao uses tensors."""

    lr: Tensor
    lr_wd: Tensor
    bc1: Tensor
    bc2_sqrt: Tensor
    beta1: float
    beta2: float
    eps: float
    maximize: bool

    @classmethod
    def of(cls, group: dict[str, Any], step: Tensor) -> _Hyper:
        beta1, beta2 = group["betas"]
        lr = torch.as_tensor(group["lr"]).to(device="cpu", dtype=torch.float32)
        count = step + 1
        return cls(
            lr=lr,
            lr_wd=lr * group["weight_decay"],
            bc1=1 - beta1**count,
            bc2_sqrt=(1 - beta2**count).sqrt(),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            maximize=group["maximize"],
        )


@dataclass(frozen=True)
class _Quantized:
    """One moment of a piece as stored: flat uint8 ``codes``, flat fp32 ``absmax`` (one per
    block) and the code map they index."""

    codes: Tensor
    absmax: Tensor
    qmap: QuantMap


def adamw_fp32(
    p: Tensor, g: Tensor, states: list[Tensor], h: _Hyper
) -> tuple[Tensor, list[Tensor]]:
    """AdamW in fp32 on flat tensors, in torchao's op order (so results are its bits).

    ``states`` are fp32 ``[exp_avg, exp_avg_sq(, max_exp_avg_sq)]``; returns the new parameter
    values and the new states (to be stored, quantized or not, by the caller).
    """
    p32, g32 = p.float(), g.float()
    if h.maximize:
        g32 = -g32
    p32 = p32 - h.lr_wd * p32
    exp_avg = states[0].lerp(g32, 1 - h.beta1)
    exp_avg_sq = states[1].lerp(g32.square(), 1 - h.beta2)
    new_states = [exp_avg, exp_avg_sq]
    second = exp_avg_sq
    if len(states) == 3:
        second = torch.maximum(states[2], exp_avg_sq)
        new_states.append(second)
    denom = (second.sqrt() / h.bc2_sqrt) + h.eps
    p32 = p32 - h.lr * (exp_avg / h.bc1) / denom
    return p32, new_states


def adamw8bit_update_(
    p: Tensor, g: Tensor, moments: Sequence[_Quantized], grid: BlockGrid, h: _Hyper
) -> None:
    """One 8-bit AdamW step of a flat piece, in place: dequantize its moments, AdamW in fp32,
    requantize them with a fresh scale per block of ``grid``, write the parameter."""
    states = []
    for m in moments:
        values = torch.empty(grid.numel, dtype=torch.float32, device=p.device)
        dequantize_(values, grid, m.codes, m.absmax, m.qmap)
        states.append(values)
    new_p, new_states = adamw_fp32(p, g, states, h)
    for m, new in zip(moments, new_states, strict=True):
        quantize_(new, grid, m.codes, m.absmax, m.qmap)
    p.copy_(new_p)


def adamw8bit_blocks_(p: Tensor, g: Tensor, moments: Sequence[_Quantized], h: _Hyper) -> None:
    """The same step for one region of whole blocks: ``p``, ``g`` and each moment's ``codes``
    viewed as ``(block rows, tile rows, block cols, tile cols)``, its ``absmax`` as ``(block
    rows, 1, block cols, 1)``. Every block is updated on its own, so the result does not depend
    on how a piece is cut into regions; this is the function the fused step compiles."""
    states = [dequantize_blocks(m.codes, m.absmax, m.qmap) for m in moments]
    new_p, new_states = adamw_fp32(p, g, states, h)
    for m, new in zip(moments, new_states, strict=True):
        quantize_blocks_(new, m.codes, m.absmax, m.qmap)
    p.copy_(new_p)


_COMPILED = CompiledRegions(adamw8bit_blocks_)


def fused_update_(
    p: Tensor, g: Tensor, moments: Sequence[_Quantized], grid: BlockGrid, h: _Hyper
) -> None:
    """``adamw8bit_update_`` compiled: ``adamw8bit_blocks_`` on each region of ``grid`` (a
    piece has one to four: whole tiles, then partial edges), with sizes symbolic so regions of
    every size share the graphs."""
    for region in grid.regions():
        views = [
            _Quantized(grid.blocks(m.codes, *region), grid.scales(m.absmax, *region), m.qmap)
            for m in moments
        ]
        p4, g4 = grid.blocks(p, *region), grid.blocks(g, *region)
        sized = [p4, g4, *(t for v in views for t in (v.codes, v.absmax))]
        _COMPILED(p4, g4, views, h, dynamic=sized)


def adamw_full_(p: Tensor, g: Tensor, states: Sequence[Tensor], h: _Hyper) -> None:
    """The same step for moments kept in full precision (parameters below ``min_8bit_size``),
    any shape as long as all agree."""
    new_p, new_states = adamw_fp32(p, g, [s.float() for s in states], h)
    for s, new in zip(states, new_states, strict=True):
        s.copy_(new)
    p.copy_(new_p)


# ----------------------------------------------------------------------------- the optimizer
@dataclass(frozen=True)
class _Blocks:
    """A quantized piece's local block grid, and the global absmax grid and its split."""

    local: BlockGrid
    grid_shape: tuple[int, ...]
    absmax_shard: RaggedShard | None


def _cpu_kernel_builds() -> bool:
    """Whether the CPU kernel is (or can now be) built: ``fused=None``'s choice on CPU, where
    the kernel is about 8x faster than the eager step; warns once and stays eager if not."""
    try:
        cpu_kernel()
    except Exception as err:  # no compiler (inductor's InvalidCxxCompiler) or a failed build
        warnings.warn(
            f"AdamW8bit(fused=None) runs the eager step on CPU: its kernel could not be built "
            f"({str(err).splitlines()[0]}); install a C++ compiler or pass fused=False to "
            "silence this",
            stacklevel=4,
        )
        return False
    return True


class AdamW8bit(ShardedOptimizer):
    """AdamW with 8-bit block-wise moments (bitsandbytes / torchao format), sharded.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``
            (float lr is used as an fp32 tensor, as torchao does).
        block_size: elements per 1-D quantization block (torchao's ``block_size``).
        tile: ``(rows, cols)`` to quantize parameters of 2 or more dims in 2-D tiles instead
            (e.g. ``(32, 32)``, the veScale-FSDP paper's blocks); 1-D parameters keep
            ``block_size`` blocks.
        min_8bit_size: parameters with fewer elements keep full-precision state (4096, like
            bitsandbytes and torchao). Unlike torchao, larger parameters whose size is not a
            multiple of the block are quantized too, with a shorter last block (as bitsandbytes).
        fused: run the step fused (one pass over the state instead of about fifty: on CPU a
            built kernel for fp32 parameters, elsewhere ``torch.compile``): True, False (eager,
            the op-by-op reference, bitwise torchao's eager step), or None for the device's
            default: compiled on CUDA / XPU where triton can build kernels; on CPU the kernel
            for fp32 parameters where a C++ compiler builds it (seconds, once per machine;
            eager otherwise, with a warning, and for other dtypes). True raises at
            construction, with the fix, where kernels cannot be built. Either way the state is
            the same format.
        mesh: ranks for the drop-in mode (see ``raggedfsdp.optim.AdamW``).
    """

    handles_tensor_parallel = True
    #: EP x TP experts: their blocks' grid is split on both mesh dims where it can be
    #: (``_tp_grid``), refused in one line where it cannot.
    handles_multi_dim_tp = True

    _state_keys_depend_on = ("amsgrad",)

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        block_size: int = 256,
        tile: tuple[int, int] | None = None,
        min_8bit_size: int = 4096,
        fused: bool | None = None,
        mesh: MeshLike = None,
    ) -> None:
        check_adam_args(lr, betas, eps, weight_decay)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        if tile is not None and (
            len(tile) != 2 or any(not isinstance(t, int) or t < 1 for t in tile)
        ):
            raise ValueError(f"tile={tile!r} must be (rows, cols) of positive ints, or None")
        self.block_size = block_size
        self.tile = tuple(tile) if tile is not None else None
        self.min_8bit_size = min_8bit_size
        if fused not in (None, True, False):
            raise ValueError(f"fused={fused!r} must be True, False or None (per device)")
        self.fused = fused
        self._compiled_on: dict[torch.device, bool] = {}
        self._blocks: dict[Piece, _Blocks] = {}
        defaults = {
            "lr": lr,
            "betas": tuple(float(b) for b in betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        super().__init__(params, defaults, mesh=mesh)
        for pc in self._pieces.values():  # fused=True: fail now, not at the first step
            self._compiled(pc.local().device)

    # ----------------------------------------------------------------------------- sharding rule
    @classmethod
    def shard_policy(
        cls,
        block_size: int = 256,
        tile: tuple[int, int] | None = None,
        min_8bit_size: int = 4096,
    ) -> ShardPolicy:
        """Units that keep every quantization block on one rank: ``block_size`` elements from the
        tensor's start (1-D blocks) or ``tile[0]`` whole rows (2-D tiles); one element for
        parameters that stay in full precision. Pass the optimizer's own settings."""
        return adamw8bit_policy(block_size, tile, min_8bit_size)

    def _policy(self) -> ShardPolicy:
        return self.shard_policy(self.block_size, self.tile, self.min_8bit_size)

    def _quantized(self, piece: Piece) -> bool:
        return is_quantized(piece.param.shape, self.min_8bit_size)

    def _check_piece(self, piece: Piece, group: dict[str, Any]) -> None:
        if not self._quantized(piece):
            return
        if not piece.sharded and not piece.param.is_contiguous():
            raise ValueError(
                f"parameter {piece.name!r} is not contiguous (stride {piece.param.stride()}); "
                "8-bit blocks follow the row-major flat index. Make it contiguous first "
                "(p.data = p.data.contiguous())"
            )
        shape = tuple(piece.param.shape)
        what = f"a {self.tile} tile slab" if self.tile and len(shape) >= 2 else "a block"
        tp = tp_split_of(piece.spec)
        if tp is not None:
            self._tp_grid(piece, tp)
            shape = tp.local_shape
        check_unit_alignment(piece, quantized_unit(shape, self.block_size, self.tile), what)

    def _tp_grid(self, piece: Piece, tp: TPShard) -> tuple[int | None, ...]:
        """The absmax grid dim each TP (or EP) split of ``piece`` cuts: a TP-split parameter is
        quantized in the blocks of its global tensor (as on one process) by quantizing each
        TP block's local tensor, which needs every block whole in one TP block and the TP
        blocks' blocks to form a ``Shard`` of the absmax grid (so checkpoints keep the
        single-process grid). Refused otherwise, naming the fix: the rule is
        ``sharding.quant_tp.quant_split_grid``, which the capacity planner applies too."""
        splits = tuple((d, tp.mesh.size(i)) for i, d in tp.splits)
        try:
            return quant_split_grid(tp.global_shape, splits, self.block_size, self.tile)
        except ValueError as err:
            raise ValueError(f"{self._split_by_tp(piece, tp)}: {err}") from None

    # ----------------------------------------------------------------------------- state
    def _blocks_of(self, piece: Piece) -> _Blocks:
        """The piece's quantization blocks (see ``QuantBlocks``), computed once."""
        if piece in self._blocks:
            return self._blocks[piece]
        spec, tp = piece.spec, tp_split_of(piece.spec)
        shape = piece.param.shape if tp is None else tp.local_shape  # TP: blocks of its block
        blocks = QuantBlocks.of(shape, self.block_size, self.tile)
        start, stop = (0, blocks.numel) if spec is None else spec.local_range(piece.rank)
        shard, grid_shape = None, blocks.grid_shape
        if spec is not None:
            counts = [blocks.counts(a, b) for a, b in itertools.pairwise(spec.bounds)]
            shard = RaggedShard.from_counts(
                blocks.grid_shape, blocks.count_unit, counts, f"{piece.name}.absmax"
            )
        if tp is not None:  # the TP blocks' grids are a Shard of the global grid (checked)
            grid_shape = QuantBlocks.of(tp.global_shape, self.block_size, self.tile).grid_shape
            shard = TPRaggedShard.of(shard, tp.derived(grid_shape, self._tp_grid(piece, tp)))
        found = _Blocks(BlockGrid(*blocks.local_view(start, stop)), grid_shape, shard)
        self._blocks[piece] = found
        return found

    def _moments(self, group: dict[str, Any]) -> tuple[str, ...]:
        return _MOMENTS if group["amsgrad"] else _MOMENTS[:2]

    def _state_specs(self, piece: Piece, group: dict[str, Any]) -> dict[str, StateSpec]:
        n = piece.numel
        if not self._quantized(piece):
            return {m: StateSpec(n, piece.param.dtype) for m in self._moments(group)}
        blocks = self._blocks_of(piece)
        specs = {}
        for m in self._moments(group):
            specs[f"{m}_codes"] = StateSpec(n, torch.uint8)
            specs[f"{m}_absmax"] = StateSpec(
                blocks.local.num_blocks if n else 0,
                torch.float32,
                blocks.grid_shape,
                blocks.absmax_shard,
            )
        return specs

    def _new_step(self, group: dict[str, Any], device: torch.device) -> Tensor:
        # torchao keeps an fp32 host counter whatever the parameter's device.
        return torch.tensor(0.0, dtype=torch.float32)

    # ----------------------------------------------------------------------------- update
    def _compiled(self, device: torch.device) -> bool:
        """Whether this optimizer's step runs fused on ``device`` (decided once per device; on
        CPU the kernel is built here, so a build failure shows at construction)."""
        if device not in self._compiled_on:
            if self.fused is None and device.type == "cpu":
                self._compiled_on[device] = _cpu_kernel_builds()
            else:
                self._compiled_on[device] = use_compiled(self.fused, device)
                if self._compiled_on[device] and device.type == "cpu":
                    cpu_kernel()
        return self._compiled_on[device]

    def _update_fn(self, p: Tensor) -> Any:
        """The step for a piece: eager, the CPU kernel (fp32 parameters on CPU), or inductor."""
        if not self._compiled(p.device):
            return adamw8bit_update_
        if p.device.type == "cpu":
            if p.dtype == torch.float32 and p.is_contiguous():
                return native_update_
            if self.fused is None:  # inductor compiles for tens of seconds: only when asked
                return adamw8bit_update_
        return fused_update_

    def _update(self, group: dict[str, Any], pieces: Sequence[Piece], step: Tensor) -> None:
        h = _Hyper.of(group, step)
        moments = self._moments(group)
        full, full_single = [], []
        for pc in pieces:
            state = self.state[pc.param]
            if not self._quantized(pc):
                entry = [pc.local(), pc.local_grad(), *(unwrap(state[m]) for m in moments)]
                (full if pc.sharded else full_single).append(entry)
                continue
            grid = self._blocks_of(pc).local
            if grid.numel == 0:
                continue
            p = flat(pc.local())
            stored = [
                _Quantized(
                    flat(unwrap(state[f"{m}_codes"])),
                    flat(unwrap(state[f"{m}_absmax"])),
                    QuantMap.get(_SIGNED[m], p.device),
                )
                for m in moments
            ]
            self._update_fn(p)(p, pc.local_grad().reshape(-1), stored, grid, h)
        for p, g, *states in merge_runs(full) + full_single:
            adamw_full_(p, g, states, h)
