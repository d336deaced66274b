"""The CPU kernel of the fused 8-bit AdamW step (``adamw8bit_cpu.c``): built, loaded, called.

Why not inductor on CPU: the step is two table lookups per element and moment, which inductor's
CPU code emulates with scalar loads (no hardware gather), and it decodes every code twice (for
the block's absmax, then for the update). The kernel decodes each block once into an L1 scratch
buffer and uses AVX-512 gathers from L1-sized tables; see the source for the loop.

It is built once per machine and source with the C++ compiler inductor would use (the same
toolchain that ``fused=True`` requires anyway, see ``compiled.compiler_problem``), cached under
inductor's cache directory by a hash of the source, compiler, flags and CPU capability, and
called through ``ctypes``. A ctypes call releases the GIL, so a large region is split into
block ranges over ``torch.get_num_threads()`` threads, as torch's own CPU kernels would.

``RAGGEDFSDP_PORTABLE_KERNEL=1`` (read once, at import) builds the portable variant instead,
with ``-mno-avx512f`` added: the kernel's one-element loop, compiled as for a CPU without
AVX-512 (auto-vectorised for AVX2 at most). It gives the same bits (tested) and exists so that
this fallback is built and tested on AVX-512 machines too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from raggedfsdp.optim.quant import BlockGrid

__all__ = ["cpu_kernel", "native_update_"]

SOURCE = Path(__file__).with_name("adamw8bit_cpu.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC")
#: Build the portable (one element at a time) kernel even where AVX-512 is available.
PORTABLE = os.environ.get("RAGGEDFSDP_PORTABLE_KERNEL", "") == "1"
#: Elements a thread gets at least: below this, spreading a region costs more than it saves.
MIN_PER_THREAD = 1 << 18


class _Moment(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("absmax", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("lo", ctypes.c_int32),
        ("hi", ctypes.c_int32),
    ]


class _Hyper(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_float) for name in ("lr", "lr_wd", "bc1", "bc2_sqrt", "w1", "w2", "eps")),
        ("maximize", ctypes.c_int32),
    ]


@functools.cache
def cpu_kernel(portable: bool = False) -> Any:
    """The built kernel's ``adamw8bit_blocks`` (built on first use; raises with the compiler's
    output if the build fails); ``portable``: the variant without AVX-512."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    compiler = get_cpp_compiler()
    source = SOURCE.read_bytes()
    flags = (*FLAGS, "-mno-avx512f") if portable else FLAGS
    capability = torch.backends.cpu.get_cpu_capability()
    key = hashlib.sha256(
        b"\0".join([source, compiler.encode(), " ".join(flags).encode(), capability.encode()])
    ).hexdigest()[:20]
    target = Path(cache_dir()) / "raggedfsdp" / f"adamw8bit_cpu_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, *flags, "-x", "c++", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(
                f"building the 8-bit AdamW CPU kernel failed: {' '.join(cmd)}\n"
                f"{done.stderr.strip()}"
            )
        os.replace(tmp, target)  # atomic: ranks building at once each load a whole file
    fn = ctypes.CDLL(str(target)).adamw8bit_blocks
    fn.restype = None
    fn.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_Moment), ctypes.c_int32,
        *[ctypes.c_int64] * 7, ctypes.POINTER(_Hyper), ctypes.c_void_p,
    ]  # fmt: skip
    return fn


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="raggedfsdp-adamw8bit")


def native_update_(p: Tensor, g: Tensor, moments: Sequence[Any], grid: BlockGrid, h: Any) -> None:
    """``adamw8bit_update_`` by the CPU kernel: ``p`` fp32 and ``g`` flat and contiguous,
    ``moments`` the piece's ``_Quantized`` moments (flat codes and absmax), ``h`` its ``_Hyper``."""
    kernel = cpu_kernel(PORTABLE)
    g = g.float().contiguous()
    hyper = _Hyper(
        float(h.lr), float(h.lr_wd), float(h.bc1), float(h.bc2_sqrt),
        1.0 - h.beta1, 1.0 - h.beta2, h.eps, int(h.maximize),
    )  # fmt: skip
    gcols = grid.grid[1]
    for rows, cols, tr, tc in grid.regions():
        offset = rows.start * grid.cols + cols.start
        first_scale = rows.start // grid.tile_rows * gcols + cols.start // grid.tile_cols
        nbc = (cols.stop - cols.start) // tc
        blocks = (rows.stop - rows.start) // tr * nbc
        array = (_Moment * len(moments))(*(
            _Moment(
                m.codes.data_ptr() + offset, m.absmax.data_ptr() + 4 * first_scale,
                m.qmap.values.data_ptr(), m.qmap.compact.data_ptr(), m.qmap.lo, m.qmap.hi,
            )
            for m in moments
        ))  # fmt: skip
        args = (p.data_ptr() + 4 * offset, g.data_ptr() + 4 * offset, array, len(moments),
                nbc, tr, tc, grid.cols, gcols)  # fmt: skip

        def run(b0: int, b1: int, args=args, tr=tr, tc=tc) -> None:
            scratch = torch.empty(3 * tr * tc)
            kernel(*args, b0, b1, ctypes.byref(hyper), scratch.data_ptr())

        threads = min(torch.get_num_threads(), blocks * tr * tc // MIN_PER_THREAD)
        if threads <= 1:
            run(0, blocks)
            continue
        cuts = [blocks * i // threads for i in range(threads + 1)]
        for f in [_pool(threads).submit(run, a, b) for a, b in itertools.pairwise(cuts)]:
            f.result()
