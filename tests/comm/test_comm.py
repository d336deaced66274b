"""raggedfsdp.comm on gloo at world sizes 1-4, against single-process references.

Every rank can rebuild every other rank's input from its rank number, so each rank checks its own
result against a reference computed locally. Integer-valued floats keep sums exact, which makes
SUM and AVG comparable bitwise whatever order the backend adds in.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from raggedfsdp.comm import (
    CommHandle,
    ShardMesh,
    all_gather_flat,
    all_reduce_flat,
    all_to_all_uneven,
    reduce_scatter_flat,
    resolve_group,
    resolve_mesh,
)
from raggedfsdp.comm.handle import launch
from raggedfsdp.dry_run import CollectiveCounter
from tests.support.distributed import WorkerPool

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _ints(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct small integers per rank (exact in bfloat16 up to 256)."""
    return ((torch.arange(n) * 7 + rank * 31) % 97 - 40).to(dtype)


def _randn(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1234 + rank))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Not torch.testing.assert_close: its first call imports sympy, ~0.5 s in every rank.
    error = (actual - expected).abs().max().item()
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-5), f"max abs error {error}"


def _finish(handle: CommHandle, async_op: bool) -> None:
    assert isinstance(handle, CommHandle)
    if async_op:
        handle.wait()
    handle.wait()  # idempotent, also on handles returned complete


def _check_all_gather() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for size, dtype, in_place, async_op in itertools.product(
        (0, 1, 7), DTYPES, (False, True), (False, True)
    ):
        case = f"size={size} dtype={dtype} in_place={in_place} async={async_op}"
        expected = torch.cat([_ints(r, size, dtype) for r in range(world)])
        full = torch.full((world * size,), -99, dtype=dtype)
        if in_place:
            shard = full[rank * size : (rank + 1) * size]
            shard.copy_(_ints(rank, size, dtype))
        else:
            shard = _ints(rank, size, dtype)
        _finish(all_gather_flat(full, shard, async_op=async_op), async_op)
        assert torch.equal(full, expected), case
    # Bitwise for arbitrary floats, too (a gather must not touch the bits).
    full = torch.empty(world * 5)
    all_gather_flat(full, _randn(rank, 5))
    expected = torch.cat([_randn(r, 5) for r in range(world)])
    assert torch.equal(full.view(torch.int32), expected.view(torch.int32))


def _check_reduce_scatter() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for size, op, in_place, async_op, scratch in itertools.product(
        (0, 6), ("sum", "avg"), (False, True), (False, True), (False, True)
    ):
        case = f"size={size} op={op} in_place={in_place} async={async_op} scratch={scratch}"
        inputs = [_ints(r, world * size) for r in range(world)]
        reference = torch.stack(inputs).sum(0)[rank * size : (rank + 1) * size]
        if op == "avg":
            reference = reference / world
        full_in = inputs[rank].clone()
        shard_out = full_in[rank * size : (rank + 1) * size] if in_place else torch.empty(size)
        handle = reduce_scatter_flat(
            shard_out, full_in, op=op, async_op=async_op, scratch_input=scratch
        )
        _finish(handle, async_op)
        assert torch.equal(shard_out, reference), case
    # Real floats: the summation order is the backend's, so compare with a tolerance.
    size = 33
    shard_out = torch.empty(size)
    reduce_scatter_flat(shard_out, _randn(rank, world * size), op="avg")
    reference = torch.stack([_randn(r, world * size) for r in range(world)]).mean(0)
    _assert_close(shard_out, reference[rank * size : (rank + 1) * size])


def _check_reduce_scatter_is_the_all_reduce_bit_for_bit() -> None:
    """Real floats, every dtype a gradient is reduced in: this rank's segment of gloo's own
    all-reduce, which it is at W >= 3 for a scratch input; at W=2 it is an exchange of segments
    point to point (half the traffic), which a traffic counter sees as one reduce-scatter of
    the whole buffer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for dtype, op, in_place in itertools.product(
        (torch.float32, torch.bfloat16), ("sum", "avg"), (False, True)
    ):
        full_in = _randn(rank, world * 9).to(dtype)
        expected = full_in.clone()
        dist.all_reduce(expected, op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM)
        shard_out = full_in[rank * 9 : rank * 9 + 9] if in_place else torch.empty(9, dtype=dtype)
        with CollectiveCounter() as counter:
            handle = reduce_scatter_flat(
                shard_out, full_in, op=op, async_op=True, scratch_input=True
            )
            handle.wait()
        assert torch.equal(shard_out, expected[rank * 9 : rank * 9 + 9]), (dtype, op, in_place)
        kind = {1: None, 2: "reduce_scatter"}.get(world, "all_reduce")
        assert dict(counter.calls) == ({kind: 1} if kind else {}), dict(counter.calls)
        assert counter.bytes[kind] == (full_in.numel() * full_in.element_size() if kind else 0)


def _check_all_reduce() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for op, async_op in itertools.product(("sum", "avg"), (False, True)):
        tensor = _ints(rank, 12).view(3, 4)  # any dense shape is fine for an all-reduce
        reference = torch.stack([_ints(r, 12) for r in range(world)]).sum(0).view(3, 4)
        if op == "avg":
            reference = reference / world
        _finish(all_reduce_flat(tensor, op=op, async_op=async_op), async_op)
        assert torch.equal(tensor, reference), f"op={op} async={async_op}"
    tensor = _randn(rank, 50)
    all_reduce_flat(tensor, op="sum")
    reference = torch.stack([_randn(r, 50) for r in range(world)]).sum(0)
    _assert_close(tensor, reference)


def _send_count(src: int, dst: int, world: int) -> int:
    """Uneven, often zero; rank 0 sends nothing at all (when there are other ranks)."""
    if src == 0 and world > 1:
        return 0
    return (src + 2 * dst) % 3


def _payload(src: int, dst: int, world: int) -> torch.Tensor:
    return torch.arange(_send_count(src, dst, world), dtype=torch.float32) + 1000 * src + 100 * dst


def _check_all_to_all() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for async_op in (False, True):
        in_splits = [_send_count(rank, dst, world) for dst in range(world)]
        out_splits = [_send_count(src, rank, world) for src in range(world)]
        data = torch.cat([_payload(rank, dst, world) for dst in range(world)])
        received = torch.full((sum(out_splits),), -1.0)
        _finish(
            all_to_all_uneven(received, data, out_splits, in_splits, async_op=async_op), async_op
        )
        expected = torch.cat([_payload(src, rank, world) for src in range(world)])
        assert torch.equal(received, expected), f"async={async_op}"
        # And back again: the reverse move uses the transposed splits.
        back = torch.empty_like(data)
        all_to_all_uneven(back, received, in_splits, out_splits, async_op=async_op).wait()
        assert torch.equal(back, data), f"round trip async={async_op}"
    # Nobody sends anything.
    empty = torch.empty(0)
    all_to_all_uneven(empty, torch.empty(0), [0] * world, [0] * world)


def _check_many_in_flight() -> None:
    """Several async collectives outstanding at once, waited out of order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stream = mock.NonCallableMock()  # CPU tensors ignore comm_stream entirely
    full = torch.empty(world * 4)
    summed = _ints(rank, 8)
    shard = torch.empty(2)
    # two gathers on one group at once: gloo's exchanges must not swap their messages
    second = torch.empty(world * 3, dtype=torch.int64)
    handles = [
        all_gather_flat(full, _ints(rank, 4), async_op=True, comm_stream=stream),
        all_gather_flat(second, _ints(rank, 3, torch.int64), async_op=True),
        all_reduce_flat(summed, op="sum", async_op=True, comm_stream=stream),
        reduce_scatter_flat(shard, _ints(rank, world * 2), op="sum", async_op=True),
    ]
    for handle in reversed(handles):
        handle.wait()
    assert stream.method_calls == []
    assert torch.equal(full, torch.cat([_ints(r, 4) for r in range(world)]))
    assert torch.equal(second, torch.cat([_ints(r, 3, torch.int64) for r in range(world)]))
    assert torch.equal(summed, torch.stack([_ints(r, 8) for r in range(world)]).sum(0))
    expected = torch.stack([_ints(r, world * 2) for r in range(world)]).sum(0)
    assert torch.equal(shard, expected[rank * 2 : rank * 2 + 2])


def _check_a_dropped_gather_still_completes() -> None:
    """An async gather whose handle one rank drops unwaited (an error between a prefetch and
    its use, the module then deleted) still completes for every rank, and the group's next
    exchange gets the right data: gloo cancels a receive whose work dies, and the pair then
    wedges (the next receive with the tag never completes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first = torch.empty(world * 4)
    if rank == 0:
        handle = all_gather_flat(first, _ints(rank, 4), async_op=True)
        del handle  # before any peer has sent
    dist.barrier()
    if rank != 0:
        all_gather_flat(first, _ints(rank, 4))
        assert torch.equal(first, torch.cat([_ints(r, 4) for r in range(world)]))
    second = torch.empty(world * 3)
    all_gather_flat(second, _ints(rank, 3))
    assert torch.equal(second, torch.cat([_ints(r, 3) for r in range(world)]))


def _check_gather_counts_as_one_all_gather() -> None:
    """However the backend moves it (gloo: point-to-point messages), a traffic counter sees one
    all-gather of the whole buffer per call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.empty(world * 6)
    with CollectiveCounter() as counter:
        all_gather_flat(full, full[rank * 6 : rank * 6 + 6], async_op=True).wait()
    expected = {"all_gather": 4 * full.numel()} if world > 1 else {}
    assert dict(counter.bytes) == expected
    assert dict(counter.calls) == ({"all_gather": 1} if world > 1 else {})


def _check_argument_errors() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    full, shard = torch.zeros(world * 4), torch.zeros(4)
    with pytest.raises(ValueError, match="full: has"):
        all_gather_flat(torch.zeros(world * 4 + 1), shard)
    with pytest.raises(ValueError, match="full_in: has"):
        reduce_scatter_flat(shard, torch.zeros(world * 4 + 1))
    with pytest.raises(TypeError, match="shard: dtype"):
        all_gather_flat(full, shard.double())
    with pytest.raises(TypeError, match="shard_out: dtype"):
        reduce_scatter_flat(shard.bfloat16(), full)
    with pytest.raises(ValueError, match="shard: expected a 1-D"):
        all_gather_flat(full, shard.view(2, 2))
    with pytest.raises(ValueError, match="full: must be contiguous"):
        all_gather_flat(torch.zeros(world * 8)[::2], shard)
    with pytest.raises(ValueError, match="op: expected one of"):
        reduce_scatter_flat(shard, full, op="max")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="op: 'avg' needs a floating dtype"):
        all_reduce_flat(torch.zeros(3, dtype=torch.int64))
    other = (rank + 1) % world
    if other != rank:
        with pytest.raises(ValueError, match=r"shard: overlaps full but is not this rank's"):
            all_gather_flat(full, full[other * 4 : other * 4 + 4])
        with pytest.raises(ValueError, match=r"shard_out: overlaps full_in"):
            reduce_scatter_flat(full[other * 4 : other * 4 + 4], full)

    out, inp = torch.zeros(world), torch.zeros(world)
    ones = [1] * world
    with pytest.raises(ValueError, match="input_split_sizes: expected one size per rank"):
        all_to_all_uneven(out, inp, ones, [*ones, 0])
    with pytest.raises(ValueError, match="output_split_sizes: sums to"):
        all_to_all_uneven(torch.zeros(world + 1), inp, ones, ones)
    with pytest.raises(ValueError, match="input_split_sizes: sizes must be non-negative"):
        all_to_all_uneven(out, inp, ones, [2, -1, *ones[2:]] if world > 1 else [-1])
    with pytest.raises(TypeError, match="input_split_sizes: expected a sequence of ints"):
        all_to_all_uneven(out, inp, ones, [1.0] * world)
    with pytest.raises(ValueError, match="output_split_sizes: receives"):
        wrong_self = list(ones)
        wrong_self[rank] = 2
        all_to_all_uneven(torch.zeros(world + 1), inp, wrong_self, ones)
    with pytest.raises(ValueError, match="output: must not overlap input"):
        all_to_all_uneven(inp, inp, ones, ones)


def _check_world_size_one_issues_nothing() -> None:
    forbidden = AssertionError("a collective was issued at world size 1")
    names = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_to_all_single")
    with mock.patch.multiple(dist, **{name: mock.Mock(side_effect=forbidden) for name in names}):
        _check_all_gather()
        _check_reduce_scatter()
        _check_all_reduce()
        _check_all_to_all()


def _check_flat_group_mesh() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert resolve_group() is dist.group.WORLD
    for mesh in (resolve_mesh(), resolve_mesh(dist.group.WORLD)):
        assert (mesh.shard_group, mesh.shard_rank, mesh.shard_size) == (
            dist.group.WORLD,
            rank,
            world,
        )
        assert not mesh.is_hsdp
        assert (mesh.replicate_group, mesh.replicate_size) == (None, 1)
    assert resolve_mesh(mesh) is mesh
    with pytest.raises(ValueError, match="mesh_dim: only meaningful with a DeviceMesh"):
        resolve_group(dist.group.WORLD, mesh_dim=0)
    with pytest.raises(TypeError, match="mesh: expected a DeviceMesh"):
        resolve_mesh("world")  # type: ignore[arg-type]


def _check_device_meshes() -> None:
    rank = dist.get_rank()
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    mesh = resolve_mesh(hsdp)
    assert mesh.is_hsdp and mesh.device_mesh is hsdp
    assert (mesh.shard_rank, mesh.shard_size) == (rank % 2, 2)
    assert (mesh.replicate_rank, mesh.replicate_size) == (rank // 2, 2)
    assert dist.get_process_group_ranks(mesh.shard_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(mesh.replicate_group) == [rank % 2, rank % 2 + 2]
    assert resolve_group(hsdp) is mesh.shard_group
    assert resolve_group(hsdp, "replicate") is mesh.replicate_group
    assert resolve_group(hsdp, 0) is mesh.replicate_group

    # HSDP gradient reduction: reduce-scatter over shards, all-reduce over replicas = global mean.
    grads = [_ints(r, 8) for r in range(4)]
    shard = torch.empty(4)
    reduce_scatter_flat(shard, grads[rank].clone(), mesh.shard_group, op="avg")
    all_reduce_flat(shard, mesh.replicate_group, op="avg")
    expected = torch.stack(grads).mean(0)[mesh.shard_rank * 4 : mesh.shard_rank * 4 + 4]
    assert torch.equal(shard, expected)

    flat = resolve_mesh(init_device_mesh("cpu", (4,)))
    assert not flat.is_hsdp and (flat.shard_rank, flat.shard_size) == (rank, 4)

    cube = init_device_mesh("cpu", (1, 2, 2))
    with pytest.raises(ValueError, match=r"mesh: expected a 1-D .* got a 3-D mesh"):
        resolve_mesh(cube)
    with pytest.raises(ValueError, match="mesh_dim: 2 is out of range"):
        resolve_group(hsdp, 2)


def _strict(check: Callable[[], None]) -> None:
    """Run a check with warnings as errors: e.g. the deprecated ``*_tensor`` collectives warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check()


@pytest.mark.parametrize(
    "check",
    [
        _check_all_gather,
        _check_reduce_scatter,
        _check_reduce_scatter_is_the_all_reduce_bit_for_bit,
        _check_all_reduce,
        _check_all_to_all,
        _check_many_in_flight,
        _check_a_dropped_gather_still_completes,
        _check_gather_counts_as_one_all_gather,
        _check_argument_errors,
        _check_flat_group_mesh,
    ],
    ids=lambda f: f.__name__.removeprefix("_check_"),
)
def test_collectives(pool: WorkerPool, check) -> None:
    pool.run(_strict, check)


def test_world_size_one_issues_no_collective(dist_pool) -> None:
    dist_pool(1).run(_strict, _check_world_size_one_issues_nothing)


def test_device_mesh_hsdp_2x2(dist_pool) -> None:
    dist_pool(4).run(_strict, _check_device_meshes)


def test_single_process_without_process_group() -> None:
    """No process group at all: the trivial mesh, and every collective is a local copy."""
    assert not dist.is_initialized()
    mesh = resolve_mesh()
    assert mesh == ShardMesh(shard_group=None, shard_rank=0, shard_size=1)
    assert resolve_group() is None
    full, shard = torch.zeros(5), _ints(0, 5)
    all_gather_flat(full, shard).wait()
    assert torch.equal(full, shard)
    out = torch.zeros(5)
    reduce_scatter_flat(out, shard, op="avg", async_op=True).wait()
    assert torch.equal(out, shard)
    all_reduce_flat(out, mesh.shard_group).wait()
    assert torch.equal(out, shard)
    moved = torch.zeros(5)
    all_to_all_uneven(moved, shard, [5], [5]).wait()
    assert torch.equal(moved, shard)
    with pytest.raises(ValueError, match="output_split_sizes: receives 4"):
        all_to_all_uneven(torch.zeros(4), shard, [4], [5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_comm_stream_protocol_on_cuda() -> None:
    """The stream hand-offs of ``launch``, with a kernel standing in for the collective.

    Wrong orderings give different values: (0*3+1)+1 = 2 if the comm stream does not wait for
    the current one, (1+1)*3 = 6 if the current stream does not wait for the handle.
    """
    x = torch.zeros(1 << 24, device="cuda")
    comm_stream = torch.cuda.Stream()

    def issue(async_op: bool) -> None:
        assert torch.cuda.current_stream() == comm_stream
        x.mul_(3)

    x.add_(1)
    handle = launch(issue, (x,), True, comm_stream)
    handle.wait()
    handle.wait()
    x.add_(1)
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 4.0))
