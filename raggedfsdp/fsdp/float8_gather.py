"""One group's block-wise FP8 all-gather: pack this rank's tiles, unpack every rank's.

One design serves both formats (``Float8Blocks``: fp32 scales per 128x128 tile;
``MXFP8Blocks``: e8m0 scales per 1x32 block): the policy gives the tile shape, the scale dtype
and the math; the plan and the steps here only move tiles and scales.

``pack`` quantizes this rank's pieces of the eligible weights from the fp32 master segment
straight into its segment of a byte payload (codes, then the tiles' scales) and casts the other
tensors' pieces there in the compute dtype; the payload is all-gathered as one flat byte buffer
(``Float8Payload`` says where everything is); ``unpack`` dequantizes every rank's pieces into
the compute buffer, whose views are the module's parameters. Quantizing runs on the current
(compute) stream before the collective is issued and unpacking on the stream that waited for
it, as the plain gather's cast does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from raggedfsdp.fsdp.float8 import FP8_DTYPE, Float8Blocks
from raggedfsdp.fsdp.float8_linear import Float8Weight
from raggedfsdp.fsdp.managed_param import ManagedParam
from raggedfsdp.fsdp.mxfp8 import MXFP8Blocks
from raggedfsdp.sharding import FlatBuffer, Layout
from raggedfsdp.sharding.float8_payload import Float8Payload, PayloadPiece, eligible_tiles

__all__ = ["Float8Format", "Float8Gather", "float8_notes"]

#: What ``MixedPrecisionPolicy(all_gather=...)`` accepts.
Float8Format = Float8Blocks | MXFP8Blocks


def float8_notes(
    layout: Layout, policy: Float8Format, dtype: torch.dtype, group: str
) -> tuple[str, ...]:
    """The group's note on tensors that keep ``dtype`` in the gather; with ``strict`` an error
    naming the weights of 2+ dims among them (raised before anything is built)."""
    tiled = eligible_tiles(layout, policy.tile)
    kept = [t for t in layout.tensors if t.name not in tiled]
    weights = [f"{t.name} {t.shape}" for t in kept if len(t.shape) >= 2]
    if policy.strict and weights:
        raise ValueError(
            f"fully_shard group {group!r}: {policy!r} cannot tile "
            f"{', '.join(weights)}: {policy.requirement}; "
            "use strict=False to keep them in the compute dtype, or wrap them separately"
        )
    if not kept:
        return ()
    names = ", ".join(t.name for t in kept)
    return (f"FP8 all-gather: kept in {str(dtype).removeprefix('torch.')}: {names}",)


class Float8Gather:
    """The payload plan of one group and the pack/unpack steps around its all-gather."""

    def __init__(self, layout: Layout, policy: Float8Format, dtype: torch.dtype) -> None:
        self.policy = policy
        self.dtype = dtype
        self.plan = Float8Payload(
            layout,
            eligible_tiles(layout, policy.tile),
            policy.tile,
            dtype.itemsize,
            scale_bytes=policy.scale_dtype.itemsize,
        )

    def pack(self, master: FlatBuffer, rank: int) -> tuple[Tensor, Tensor]:
        """A fresh payload (``W`` segments of bytes) and this rank's segment of it, filled from
        the master segment: the all-gather's output and input."""
        seg = self.plan.segment_bytes
        full = torch.empty(self.plan.buffer_bytes, dtype=torch.uint8, device=master.device)
        mine = full[rank * seg : (rank + 1) * seg]
        for piece in self.plan.pieces[rank]:
            source = master.shard_view(piece.name)
            if piece.tiles is None:
                self._raw(mine, piece).copy_(source)
                continue
            codes, scales = self.policy.quantize(source.view(piece.tiles))
            self._codes(mine, piece).copy_(codes)
            self._scales(mine, piece).copy_(scales)
        return full, mine

    def unpack(self, full: Tensor, compute: FlatBuffer) -> None:
        """Dequantize (or copy) every rank's pieces from the gathered payload into
        ``compute.full`` and zero its padding, as a plain gather of zero-padded segments
        leaves it."""
        seg = self.plan.segment_bytes
        for rank, pieces in enumerate(self.plan.pieces):
            chunk = full[rank * seg : (rank + 1) * seg]
            self._unpack_rank(chunk, pieces, compute)
        compute.zero_full_padding()

    def weights(self, full: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """Every quantized tensor's whole codes ``(B, m, n)`` and scales ``(B, ceil(m/tile
        rows), ceil(n/tile cols))`` from a gathered payload (copies: a tensor's pieces lie in
        several ranks' segments), exactly what the policy's ``quantize`` gives for the whole
        master tensor."""
        seg, codes, scales = self.plan.segment_bytes, {}, {}
        for rank, pieces in enumerate(self.plan.pieces):
            chunk = full[rank * seg : (rank + 1) * seg]
            for piece in pieces:
                if piece.tiles is not None:
                    codes.setdefault(piece.name, []).append(self._codes(chunk, piece).flatten())
                    scales.setdefault(piece.name, []).append(self._scales(chunk, piece).flatten())
        out = {}
        for name, (matrix_rows, cols) in self.plan.tiles.items():
            numel = self.plan.layout.by_name[name].numel
            shape = (numel // (matrix_rows * cols), matrix_rows, cols)
            grid = (shape[0], *self.plan.grid(matrix_rows, cols))
            out[name] = (torch.cat(codes[name]).view(shape), torch.cat(scales[name]).view(grid))
        return out

    def keep(self, full: Tensor, params: Sequence[ManagedParam]) -> None:
        """Give every gathered 2-D weight its codes and scales (``param.float8_blocks``, for
        ``float8_block_linear``) until ``drop``; stacked tensors keep none."""
        by_name = {mp.fqn: mp.unsharded for mp in params}
        for name, (codes, scales) in self.weights(full).items():
            if by_name[name].dim() == 2:
                by_name[name].float8_blocks = Float8Weight(codes[0], scales[0])

    @staticmethod
    def drop(params: Sequence[ManagedParam]) -> None:
        """Forget the kept codes (the group is resharded)."""
        for mp in params:
            mp.unsharded.__dict__.pop("float8_blocks", None)

    def _unpack_rank(
        self, chunk: Tensor, pieces: Sequence[PayloadPiece], compute: FlatBuffer
    ) -> None:
        for piece in pieces:
            flat = compute.full_view(piece.name).view(-1)
            dest = flat[piece.tensor_offset : piece.tensor_offset + piece.numel]
            if piece.tiles is None:
                dest.copy_(self._raw(chunk, piece))
                continue
            codes, scales = self._codes(chunk, piece), self._scales(chunk, piece)
            self.policy.dequantize(codes, scales, self.dtype, out=dest.view(piece.tiles))

    def _raw(self, chunk: Tensor, piece: PayloadPiece) -> Tensor:
        size = piece.numel * self.dtype.itemsize
        return chunk[piece.data_offset : piece.data_offset + size].view(self.dtype)

    @staticmethod
    def _codes(chunk: Tensor, piece: PayloadPiece) -> Tensor:
        codes = chunk[piece.data_offset : piece.data_offset + piece.numel].view(FP8_DTYPE)
        return codes.view(piece.tiles)

    def _scales(self, chunk: Tensor, piece: PayloadPiece) -> Tensor:
        start, dtype = piece.scale_offset, self.policy.scale_dtype
        scales = chunk[start : start + piece.num_scales * dtype.itemsize].view(dtype)
        matrices, rows, cols = piece.tiles
        return scales.view(matrices, *self.plan.grid(rows, cols))
