"""Shared pieces of the optimizer tests: models with awkward shapes, exact gradients, and
hand-made RaggedTensor parameters (FSDP mode before ``fully_shard`` exists).

Gradients are small integers times 2^-8: sums over up to 4 ranks are exact in fp32 in any order,
so the gloo average is exactly ``sum / W`` and a single-process oracle can be fed the very same
averaged gradient. Identical gradients on every rank average to themselves at any W.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from raggedfsdp.sharding import FlatBuffer, RaggedShard, RaggedTensor, TensorSpec, plan_layout


def rank_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def init_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def exact_grads(
    shapes: dict[str, tuple[int, ...]], step: int, world: int, same: bool = False
) -> dict[str, torch.Tensor]:
    """Per-rank gradients ``(W, *shape)``; ``same``: one gradient for every rank."""
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        gen = torch.Generator().manual_seed(7919 * step + i)
        lead = 1 if same else world
        g = torch.randint(-64, 64, (lead, *shape), generator=gen).float() / 256
        out[name] = g.expand(world, *shape) if same else g
    return out


def average(g: torch.Tensor) -> torch.Tensor:
    """What gloo's AVG gives for exact inputs: the fp32 sum divided by W."""
    return g.sum(0) / g.shape[0]


def ragged_params(
    init: dict[str, torch.Tensor],
    unit: Callable[[str, torch.Tensor], int],
    world: int,
    rank: int,
) -> tuple[dict[str, torch.nn.Parameter], FlatBuffer]:
    """RaggedTensor parameters whose local pieces are views of one planned flat shard, as
    ``fully_shard`` makes them; also returns a gradient buffer of the same layout."""
    specs = [TensorSpec(n, tuple(t.shape), "float32", max(1, unit(n, t))) for n, t in init.items()]
    layout = plan_layout(specs, world)
    params = FlatBuffer(layout, rank, torch.float32)
    params.load_full_tensors(init)
    grads = FlatBuffer(layout, rank, torch.float32)
    out = {
        n: torch.nn.Parameter(RaggedTensor(params.shard_view(n), layout.shards[n], rank))
        for n in init
    }
    return out, grads


def counted_params(
    init: dict[str, torch.Tensor], counts: dict[str, tuple[RaggedShard, ...]], rank: int
) -> dict[str, torch.nn.Parameter]:
    """RaggedTensor parameters with explicit (uneven, empty) splits, each its own allocation."""
    out = {}
    for n, t in init.items():
        spec = counts[n]
        start, stop = spec.local_range(rank)
        local = t.reshape(-1)[start:stop].clone()
        out[n] = torch.nn.Parameter(RaggedTensor(local, spec, rank))
    return out


def set_ragged_grads(
    params: dict[str, torch.nn.Parameter],
    full: dict[str, torch.Tensor],
    buf: FlatBuffer | None = None,
) -> None:
    """Give each RaggedTensor parameter this rank's piece of the full gradient (in ``buf``'s
    views when given, as FSDP's reduce-scatter output would be)."""
    for n, p in params.items():
        spec = p.ragged_shard
        start, stop = p.local_range
        piece = full[n].reshape(-1)[start:stop]
        local = buf.shard_view(n) if buf is not None else torch.empty_like(piece)
        local.copy_(piece)
        p.grad = RaggedTensor(local, spec, p.rank)


def local_piece(p: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's values of a RaggedTensor parameter, the same range of a full tensor)."""
    start, stop = p.local_range
    return p.local, full.detach().reshape(-1)[start:stop]


def equal_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    return [torch.equal(a, b) for a, b in pairs]


def continue_in_lockstep(
    opt: torch.optim.Optimizer,
    twin_opt: torch.optim.Optimizer,
    params: dict[str, torch.Tensor],
    twin: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    set_grads: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None],
    steps: range = range(2, 4),
) -> bool:
    """Give ``twin`` the parameters of ``params`` (its optimizer has loaded ``opt``'s state),
    step both on the same gradients, and say whether they stay bitwise equal."""
    world = rank_world()[1]
    with torch.no_grad():
        for n in shapes:
            twin[n].copy_(params[n])
    for step in steps:
        grads = exact_grads(shapes, step, world)
        set_grads(params, grads)
        set_grads(twin, grads)
        opt.step()
        twin_opt.step()
    return all(torch.equal(params[n], twin[n]) for n in shapes)


def mode_params(
    init: dict[str, torch.Tensor], unit: Callable[[str, torch.Tensor], int], mode: str
) -> tuple[dict[str, torch.nn.Parameter], FlatBuffer | None]:
    """Parameters for ``mode``: RaggedTensors on a planned layout ("fsdp"), else plain ones
    (single process or drop-in); with the fsdp gradient buffer."""
    if mode == "fsdp":
        rank, world = rank_world()
        return ragged_params(init, unit, world, rank)
    return {n: torch.nn.Parameter(t) for n, t in init.items()}, None


def set_mode_grads(
    params: dict[str, torch.nn.Parameter], grads: dict[str, torch.Tensor], gbuf: FlatBuffer | None
) -> None:
    """The same full gradient on every rank: RaggedTensor pieces in fsdp mode, else a copy."""
    if gbuf is not None:
        set_ragged_grads(params, grads, gbuf)
    else:
        for n, p in params.items():
            p.grad = grads[n].clone()


def full_values(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {
        n: p.full_tensor() if isinstance(p, RaggedTensor) else p.detach().clone()
        for n, p in params.items()
    }


def assert_resumes_bitwise(dist_pool, run, *args, names) -> None:
    """``run(*args, save)`` (see ``train_checkpointed``) saved at 4 ranks and resumed at 3 ends
    with bitwise the same full parameters ``names`` on every rank."""
    expected = dist_pool(4).run(run, *args, True)[0]
    for rank, resumed in enumerate(dist_pool(3).run(run, *args, False)):
        for n in names:
            assert torch.equal(resumed[n], expected[n]), (rank, n)


def train_checkpointed(
    opt: torch.optim.Optimizer,
    params: dict[str, torch.nn.Parameter],
    gbuf: FlatBuffer | None,
    shapes: dict[str, tuple[int, ...]],
    path: str,
    save: bool,
    steps: int = 5,
    at: int = 3,
) -> dict[str, torch.Tensor]:
    """``save``: train ``steps`` steps with DCP-saving model and optimizer before step ``at``;
    else load that checkpoint and train steps ``at``.. on the same gradients. Returns the final
    full parameters, so a resume at another world size can be compared bitwise."""
    import torch.distributed.checkpoint as dcp

    world = rank_world()[1]
    if not save:
        state = {"model": dict(params), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=path)
        opt.load_state_dict(state["optim"])
    for step in range(0 if save else at, steps):
        if save and step == at:
            dcp.save({"model": dict(params), "optim": opt.state_dict()}, checkpoint_id=path)
        grads = exact_grads(shapes, step, world, same=True)
        set_mode_grads(params, {n: g[0] for n, g in grads.items()}, gbuf)
        opt.step()
    return full_values(params)


def assert_ranks_match(results: Sequence[dict], params: dict, state: dict) -> None:
    """Every rank's gathered ``results["params"]`` and ``results["state"]`` (global
    coordinates) equal one process's ``params`` and ``state``, bitwise, key by key."""
    for result in results:
        for n, value in params.items():
            assert torch.equal(result["params"][n], value), n
        assert result["state"].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(result["state"][key], value), key
