"""Compiled optimizer math: ``torch.compile`` where it can build kernels, eager where it cannot.

An optimizer step written as a chain of torch ops runs one kernel per op eagerly, each a pass over
memory. Compiled by inductor, the chain of one region of blocks becomes one loop nest that reads
the inputs once and writes the outputs once. This module decides whether that is possible on a
device (:func:`compiler_problem`, :func:`use_compiled`) and compiles a per-region function so
that every region of every parameter shares a few graphs (:class:`CompiledRegions`).

What inductor needs to build kernels: on CPU a C++ compiler (``$CXX`` or ``g++``, found the way
inductor finds it) and the Python headers (``Python.h``); on CUDA / XPU, triton and a C compiler
for triton's launcher (``$CC``, ``cc``, ``gcc`` or ``clang``).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["CompiledRegions", "compiler_problem", "use_compiled"]

#: Devices where ``fused=None`` compiles: a GPU step is launch- and gather-bound eagerly, and
#: triton is part of their torch builds. Not CPU, where inductor graphs take tens of seconds to
#: build: ``AdamW8bit`` runs its hand-written kernel there for fp32 parameters (``native.py``).
COMPILED_BY_DEFAULT = ("cuda", "xpu")


def compiler_problem(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device`` here, or None if it can."""
    if device.type == "cpu":
        from torch._inductor import config
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception:  # inductor's own search (InvalidCxxCompiler when nothing answers)
            tried = ", ".join(str(c) for c in config.cpp.cxx if c is not None)
            return (
                f"inductor found no C++ compiler to build CPU kernels (tried: {tried}); install "
                "one (e.g. `apt-get install g++`) or point $CXX at it"
            )
        headers = Path(sysconfig.get_path("include")) / "Python.h"
        if not headers.exists():
            return (
                f"inductor builds CPU kernels against the Python headers, and {headers} is "
                "missing (install the python3-dev package of this interpreter)"
            )
        return None
    if device.type in COMPILED_BY_DEFAULT:
        from torch.utils._triton import has_triton

        if not has_triton():
            return f"inductor builds {device.type} kernels with triton, which is not installed"
        compilers = [os.environ.get("CC"), "cc", "gcc", "clang"]
        if not any(c and shutil.which(c) for c in compilers):
            return "triton needs a C compiler for its launcher ($CC, cc, gcc or clang): none found"
        return None
    return f"the compiled step builds kernels for CPU, CUDA and XPU only, not {device.type}"


def use_compiled(fused: bool | None, device: torch.device) -> bool:
    """Whether to run the compiled step on ``device``: ``fused=True`` always (raising, with the
    reason and the fix, where it cannot build kernels), ``False`` never, and ``None`` on GPUs
    where it can; ``None`` on CPU gives eager here (``AdamW8bit`` decides its CPU kernel
    itself: it builds in ~2 s, inductor graphs for other dtypes in tens of seconds)."""
    if fused is False or (fused is None and device.type not in COMPILED_BY_DEFAULT):
        return False
    problem = compiler_problem(device)
    if fused is None:
        return problem is None
    if problem is not None:
        raise RuntimeError(
            f"fused=True compiles the step with torch.compile, but {problem}. Or pass "
            "fused=False: the eager step, with the same state format"
        )
    return True


class CompiledRegions:
    """``fn`` compiled for regions of any size: graphs are specialised only on which dims are
    1, the dtypes and the Python scalars, never on sizes, so a model compiles a handful of
    graphs once and later steps (and other parameters of other sizes) reuse them.

    ``fn`` must take its tensors as arguments; ``dynamic`` lists those whose sizes vary (each
    dim of size > 1 becomes symbolic). The number of argument combinations is small and fixed for
    a model, so dynamo's recompile limit, meant to catch graphs recompiled every call, is lifted
    for these calls (as torchao does for its compiled step): hitting it would silently run some
    parameters eagerly, with other rounding than the rest.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._compiled: Callable[..., None] | None = None

    def __call__(self, *args: Any, dynamic: list[Tensor]) -> None:
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=False, fullgraph=True)
        for t in dynamic:
            for dim, size in enumerate(t.shape):
                if size > 1:
                    torch._dynamo.mark_dynamic(t, dim)
        with torch._dynamo.utils.disable_cache_limit():
            self._compiled(*args)
