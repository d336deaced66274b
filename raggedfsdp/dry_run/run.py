"""Build, wrap, make the optimizer and train a step as one rank, and measure it: ``dry_run``.

``measure`` is the method: it runs the caller's ``build`` and ``loss`` under a
``MemoryTally`` and a ``CollectiveCounter`` in whatever process group exists, so a real gloo
or NCCL job measures itself with exactly the code a dry run uses. ``dry_run`` runs
``measure`` as rank ``r`` of ``W`` on the fake process group, with fake tensors by default:
every tensor has its real shape, dtype and storage size but no data, so the per-rank
memory of a model far larger than this machine is counted without being allocated, and
the two runtimes (``raggedfsdp.fully_shard`` and FSDP2's) are measured the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Literal

import torch
from torch import nn

from raggedfsdp.dry_run.collectives import CollectiveCounter
from raggedfsdp.dry_run.fake_values import (
    ZeroValues,
    fake_addresses,
    foreach_as_real,
    real_constant_tables,
)
from raggedfsdp.dry_run.report import StepReport
from raggedfsdp.dry_run.tally import MemoryTally
from raggedfsdp.dry_run.world import fake_world

__all__ = ["Build", "Runtime", "dry_run", "fully_shard_of", "measure", "tensor_mode"]

Runtime = Literal["raggedfsdp", "fsdp2"]
Tensors = Literal["fake", "real"]
#: ``build(fully_shard) -> (model, optimizer)``: make the model, wrap it with the given
#: ``fully_shard`` (the runtime's), and build its optimizer.
Build = Callable[[Callable[..., Any]], tuple[nn.Module, torch.optim.Optimizer]]


def fully_shard_of(runtime: Runtime) -> Callable[..., Any]:
    """The ``fully_shard`` of ``runtime``: raggedfsdp's, or PyTorch FSDP2's."""
    if runtime == "raggedfsdp":
        from raggedfsdp.fsdp import fully_shard

        return fully_shard
    if runtime == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    raise ValueError(f"runtime={runtime!r}: use 'raggedfsdp' or 'fsdp2'")


@contextmanager
def tensor_mode(tensors: Tensors) -> Iterator[None]:
    """Inside, new tensors are fake (``FakeTensorMode``; data-dependent reads see zeros,
    addresses are distinct) or, for ``"real"``, ordinary ones."""
    if tensors == "real":
        yield
        return
    if tensors != "fake":
        raise ValueError(f"tensors={tensors!r}: use 'fake' or 'real'")
    import torch.distributed._tools.fake_collectives  # noqa: F401  (c10d ops on fake tensors)
    from torch._subclasses.fake_tensor import FakeTensorMode

    real_constant_tables()
    with ExitStack() as stack:
        stack.enter_context(fake_addresses())
        stack.enter_context(foreach_as_real())
        mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(ZeroValues(mode))
        yield


def _locals(tensors: Any) -> list[torch.Tensor]:
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _static(tally: MemoryTally, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {
        "params": tally.bytes_of(params),
        "grads": tally.bytes_of(_locals(p.grad for p in params)),
        "optimizer": tally.bytes_of(_locals(state)),
        "static": tally.live,
    }


def _least(so_far: dict[str, int], step: dict[str, int]) -> dict[str, int]:
    """Each figure's least over the steady steps so far and this one."""
    return {k: min(v, so_far.get(k, v)) for k, v in step.items()}


def measure(
    build: Build,
    loss: Callable[[nn.Module], torch.Tensor],
    runtime: Runtime = "raggedfsdp",
    steps: int = 2,
    tensors: str = "real",
) -> StepReport:
    """Run ``build`` then ``steps`` training steps (``loss(model).backward()``, optimizer
    step, ``zero_grad``) in the current process group; report the steady steps (``steps=0``:
    the set-up alone, with the state as built and no peaks or traffic).

    The steady steps are all but the first (which also makes the optimizer state and the
    runtimes' lazy buffers). Each phase's peak, and the memory live after the optimizer step
    (``static``), is the least over the steady steps: a real backend's threads drop their
    references to a finished collective's buffers a moment after ``wait`` returns, so a free
    can land late and only ever add to a figure; with several steady steps it is the
    runtime's own. ``tensors`` only labels the report; the caller picks the tensor mode.
    Collective bytes are this rank's, of the last step.
    """
    if steps < 0:
        raise ValueError(f"steps={steps} must be >= 0 (0: set-up only)")
    tally, counter = MemoryTally(), CollectiveCounter()
    steady: dict[str, int] = {}
    static: dict[str, int] = {}
    with counter, tally:
        start = time.perf_counter()
        model, optimizer = build(fully_shard_of(runtime))
        setup_s = time.perf_counter() - start
        for step in range(steps):
            counter.reset()
            with tally.phase("forward"):
                value = loss(model)
            with tally.phase("backward"):
                value.backward()
                del value
            with tally.phase("step"):
                optimizer.step()
            after_step = _static(tally, model, optimizer)
            optimizer.zero_grad()
            if step > 0 or steps == 1:
                steady, static = _least(steady, tally.peaks), _least(static, after_step)
        if not steps:
            static = _static(tally, model, optimizer)
    return StepReport(
        runtime=runtime,
        rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        world_size=torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        tensors=tensors,
        **static,
        peak_forward=steady.get("forward", 0),
        peak_backward=steady.get("backward", 0),
        peak_step=steady.get("step", 0),
        all_gather=counter.bytes["all_gather"],
        reduce_scatter=counter.bytes["reduce_scatter"],
        all_reduce=counter.bytes["all_reduce"],
        all_to_all=counter.bytes["all_to_all"],
        largest_all_gather=counter.largest["all_gather"],
        setup_s=setup_s,
    )


def dry_run(
    build: Build,
    loss: Callable[[nn.Module], torch.Tensor],
    *,
    rank: int,
    world_size: int,
    runtime: Runtime = "raggedfsdp",
    tensors: Tensors = "fake",
    steps: int = 2,
) -> StepReport:
    """``measure`` as ``rank`` of ``world_size`` on the fake process group (module docstring).

    ``build`` and ``loss`` run inside the fake group and tensor mode: make the mesh, the model
    and the micro-batch there (on the meta device first for a model that does not fit, as
    for a real run; ``to_empty`` then gives fake tensors)."""
    fully_shard_of(runtime)  # a bad runtime fails before the process group is made
    with ExitStack() as stack:
        stack.enter_context(fake_world(rank, world_size))
        stack.enter_context(tensor_mode(tensors))
        return measure(build, loss, runtime, steps, tensors)
