"""FlatBuffer: views share the buffer's storage, and ragged shards round-trip through the
in-place collectives at world sizes 1-4."""

import pytest
import torch
import torch.distributed as dist

from raggedfsdp.comm import all_gather_flat, reduce_scatter_flat
from raggedfsdp.sharding import FlatBuffer, TensorSpec, plan_layout

# Uneven on purpose: a tensor with fewer units than ranks (empty shards), a zero-size tensor,
# a 1-D tensor, a short last unit (10 rows in 4-row units) and a 3-D expert stack.
SHAPES = {
    "embed": (10, 6),
    "tiny": (2, 6),
    "empty": (0, 6),
    "norm": (6,),
    "experts": (3, 4, 6),
}


def _is_view_at(view: torch.Tensor, base: torch.Tensor, offset: int) -> bool:
    """``view`` starts ``offset`` elements into ``base``'s memory (empty views have no address)."""
    return view.numel() == 0 or view.data_ptr() == base.data_ptr() + offset * base.element_size()


def _specs(rows: int, dtype: str = "float32") -> list[TensorSpec]:
    return [TensorSpec.rows(n, s, dtype, rows) for n, s in SHAPES.items()]


def _full_tensors(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # small integers: sums across 4 ranks stay exact in any reduction order, bf16 included
    return {n: torch.randint(-8, 8, s, generator=gen).to(dtype) for n, s in SHAPES.items()}


# ----------------------------------------------------------------------------- single process
def test_views_share_the_buffer_storage_and_survive_free():
    layout = plan_layout(_specs(rows=4), 3)
    buf = FlatBuffer(layout, rank=1, dtype=torch.float32)
    views = dict(buf.full_views)
    assert not buf.is_full_allocated
    full = buf.alloc_full()
    assert buf.is_full_allocated
    for name, view in views.items():
        assert view is buf.full_view(name)
        assert view.shape == SHAPES[name]
        assert _is_view_at(view, full, layout.offsets[name])
    views["embed"].fill_(3.0)
    assert full[layout.offsets["embed"]].item() == 3.0  # writes land in the buffer
    buf.free_full()
    assert not buf.is_full_allocated and views["embed"].untyped_storage().nbytes() == 0
    buf.alloc_full()
    views["embed"].fill_(1.0)  # the same view objects work again
    for name, seg_off, _, length in layout.local_pieces(1):
        piece = buf.shard_view(name)
        assert piece.numel() == length
        assert _is_view_at(piece, buf.shard, seg_off)


def test_persistent_full_makes_the_shard_a_view_of_the_full_buffer():
    layout = plan_layout(_specs(rows=1), 2)
    buf = FlatBuffer(layout, rank=1, dtype=torch.float64, persistent_full=True)
    assert _is_view_at(buf.shard, buf.full, layout.segment_size)
    with pytest.raises(RuntimeError, match="persistent_full"):
        buf.free_full()


def test_load_full_tensors_checks_names_and_shapes():
    layout = plan_layout(_specs(rows=2), 2)
    buf = FlatBuffer(layout, rank=0, dtype=torch.float32)
    tensors = _full_tensors(torch.float32)
    with pytest.raises(KeyError, match="norm"):
        buf.load_full_tensors({k: v for k, v in tensors.items() if k != "norm"})
    with pytest.raises(ValueError, match="tensor 'embed' has shape \\(5, 12\\)"):
        buf.load_full_tensors({**tensors, "embed": tensors["embed"].reshape(5, 12)})
    with pytest.raises(ValueError, match="rank=2 is outside the layout planned for 2 ranks: "):
        FlatBuffer(layout, rank=2, dtype=torch.float32)


def test_padding_is_zero_in_a_fresh_gradient_buffer():
    layout = plan_layout(_specs(rows=4), 3)
    buf = FlatBuffer(layout, rank=0, dtype=torch.float32)
    full = buf.alloc_full()
    full.fill_(float("nan"))  # memory handed back after a free holds garbage
    buf.zero_full_padding()
    for start, stop in layout.gaps():
        assert torch.count_nonzero(full[start:stop]) == 0


# ----------------------------------------------------------------------------- multi-process
def _round_trip(rows: int, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = plan_layout(_specs(rows, dtype_name), world)
    layout.check()
    full = _full_tensors(dtype)

    params = FlatBuffer(layout, rank, dtype)
    params.load_full_tensors(full)  # scatter: each rank keeps its ragged pieces
    views = {n: params.full_view(n) for n in SHAPES}  # taken before the gather
    all_gather_flat(params.alloc_full(), params.shard)
    gathered_ok = all(torch.equal(views[n], full[n]) for n in SHAPES)
    in_place = all(_is_view_at(v, params.full, layout.offsets[n]) for n, v in views.items())

    grads = FlatBuffer(layout, rank, dtype)
    grads.alloc_full()
    grads.zero_full_padding()
    for name, view in grads.full_views.items():
        view.copy_((rank + 1) * full[name])  # rank r's gradient: (r + 1) * x
    reduce_scatter_flat(grads.shard, grads.full, op="sum")
    total = world * (world + 1) // 2
    sum_ok = all(
        torch.equal(grads.shard_view(n), (total * full[n]).reshape(-1)[lo : lo + k])
        for n, _, lo, k in layout.local_pieces(rank)
    )
    for name, view in grads.full_views.items():
        view.copy_((rank + 1) * full[name])
    reduce_scatter_flat(grads.shard, grads.full, op="avg")
    avg_ok = all(
        torch.allclose(grads.shard_view(n), (total / world * full[n]).reshape(-1)[lo : lo + k])
        for n, _, lo, k in layout.local_pieces(rank)
    )
    padding_ok = all(
        torch.count_nonzero(grads.shard[max(a, s0) - s0 : min(b, s1) - s0]) == 0
        for a, b in layout.gaps()
        for s0, s1 in [layout.segment(rank)]
        if a < s1 and b > s0
    )
    params.free_full()
    return {
        "gathered": gathered_ok,
        "in_place": in_place,
        "sum": sum_ok,
        "avg": avg_ok,
        "padding": padding_ok,
        "freed": not params.is_full_allocated,
        "empty_ranks": sum(length == 0 for length in layout.shards["tiny"].lengths),
    }


@pytest.mark.parametrize(("rows", "dtype"), [(1, "float32"), (4, "float64"), (2, "bfloat16")])
def test_ragged_round_trip(pool, world_size, rows, dtype):
    results = pool.run(_round_trip, rows, dtype)
    for rank, res in enumerate(results):
        empty = res.pop("empty_ranks")
        assert all(res.values()), f"rank {rank}: {res}"
    if world_size >= 3 and rows == 4:
        assert empty >= 1, "expected some ranks to hold none of a 1-unit tensor"


def _persistent_in_place(rows: int) -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = plan_layout(_specs(rows), world)
    full = _full_tensors(torch.float32, seed=1)
    buf = FlatBuffer(layout, rank, torch.float32, persistent_full=True)
    buf.load_full_tensors(full)
    all_gather_flat(buf.full, buf.shard).wait()  # shard is a view of full: no copy at all
    return all(torch.equal(buf.full_view(n), full[n]) for n in SHAPES)


def test_persistent_in_place_all_gather(pool):
    assert all(pool.run(_persistent_in_place, 2))


def test_loading_parameters_that_require_grad_records_no_autograd_history():
    linear = torch.nn.Linear(4, 3)
    layout = plan_layout([TensorSpec(n, tuple(p.shape)) for n, p in linear.named_parameters()], 1)
    buf = FlatBuffer(layout, rank=0, dtype=torch.float32)
    buf.load_full_tensors(dict(linear.named_parameters()))
    assert not buf.shard.requires_grad and buf.shard.grad_fn is None
    assert torch.equal(buf.shard_view("weight"), linear.weight.detach().reshape(-1))


def _world_mismatches() -> list[str]:
    """FlatBuffer's errors on 2 running ranks: a layout planned for 8, and rank 1 of a layout
    planned for 1 (fewer ranks than running is legal for a shard group, a rank outside it not)."""
    errors = []
    for planned, rank in ((8, dist.get_rank()), (1, 1)):
        try:
            FlatBuffer(plan_layout(_specs(rows=1), planned), rank, torch.float32)
        except ValueError as err:
            errors.append(str(err))
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_a_layout_planned_for_another_world_size_is_refused_naming_both(pool):
    for errors in pool.run(_world_mismatches):
        assert errors[0] == (
            "FlatBuffer: layout planned for 8 ranks, running on 2: plan with world_size=2 "
            "(or run on 8 ranks)"
        )
        assert len(errors) == 2, errors
        assert "rank=1 is outside the layout planned for 1 ranks, running on 2" in errors[1]


def test_without_a_process_group_any_layout_serves_any_of_its_ranks():
    layout = plan_layout(_specs(rows=1), 8)
    assert FlatBuffer(layout, rank=7, dtype=torch.float32).shard.numel() == layout.segment_size
