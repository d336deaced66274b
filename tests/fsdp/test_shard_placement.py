"""fully_shard(shard_placement_fn=...): FSDP2's per-parameter placement as units (Shard(0): whole
dim-0 slices, Shard(d): whole dim-d indices, noted), combined with the shard policy, training as
one process, and one-line refusals that leave the module untouched."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import Replicate, Shard

from raggedfsdp import fully_shard
from raggedfsdp.fsdp import FSDPModule
from raggedfsdp.sharding import element_units, row_units
from tests.support.fsdp_training import full_params, shard_blocks, train
from tests.support.tiny_models import make_model


def _shard0(param: nn.Parameter) -> Shard:
    return Shard(0)


def _largest_dim(param: nn.Parameter) -> Shard:
    """torch's test_train_parity_shard_placement_fn_shard_largest_dim: the largest dim."""
    sizes = list(param.shape)
    return Shard(sizes.index(max(sizes)) if sizes else 0)


def _wide_on_dim1(param: nn.Parameter) -> Shard | None:
    """FSDP2-style code: Shard(1) for the weights wider than tall (w2, 16 x 40), else default."""
    return Shard(1) if param.ndim == 2 and param.shape[1] > param.shape[0] else None


# ----------------------------------------------------------------------------- (a) AdamW bitwise
def _adamw_shard0_vs_default(steps: int) -> dict:
    runs = {}
    for name, fn in (("default", None), ("shard0", _shard0)):
        model = shard_blocks(make_model(), shard_placement_fn=fn)
        losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), steps)
        units = {n: p.ragged_shard.unit for n, p in model.named_parameters()}
        runs[name] = (losses, full_params(model), units)
    (ref_losses, ref, ref_units), (losses, params, units) = runs["default"], runs["shard0"]
    return {
        "units_differ": units != ref_units,
        "losses_equal": losses == ref_losses,
        "params_equal": all(torch.equal(params[n], ref[n]) for n in ref),
        "params_diff": max((params[n] - ref[n]).abs().max().item() for n in ref),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_shard0_trains_like_default_units_with_adamw(pool, world_size):
    """AdamW is element-wise, so another plan changes no arithmetic but the reduction's: gloo's
    ring all-reduce adds an element's W terms in an order set by its offset in the buffer,
    which the plan moves. Two terms add the same either way (bitwise at W = 2); at W = 3 the
    averaged gradients differ in the last bit (measured: embed and head, ~1e-9)."""
    for res in pool.run(_adamw_shard0_vs_default, 3):
        assert res["units_differ"], res  # a different plan...
        if world_size == 2:
            assert res["losses_equal"] and res["params_equal"], res  # ...the same math
        else:
            assert res["params_diff"] < 1e-6, res


# ----------------------------------------------------------------------------- (b) the units
class _Cube(nn.Module):
    """A 3-D weight (Shard(1) keeps each dim-1 index, 4 elements, whole), a 2-D one sharded on
    its last dim (elements) and a vector."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cube = nn.Parameter(torch.randn(6, 5, 4))
        self.mat = nn.Parameter(torch.randn(7, 3))
        self.vec = nn.Parameter(torch.randn(9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.cube.sum(0) @ x) @ self.mat[:4] + self.vec[:3]


def _cuts(param: nn.Parameter) -> list[int]:
    return list(param.ragged_shard.bounds)


def _units_and_notes() -> dict:
    out = {}
    model = shard_blocks(make_model(), shard_placement_fn=_shard0)
    out["shard0"] = {
        n: (tuple(p.shape), p.ragged_shard.unit, _cuts(p)) for n, p in model.named_parameters()
    }
    placements = {"cube": Shard(1), "mat": Shard(-1), "vec": None}
    for key, policy in (("plain", element_units()), ("row_units(2)", row_units(2))):
        cube = _Cube()
        names = {id(p): n for n, p in cube.named_parameters()}
        fully_shard(
            cube,
            shard_policy=policy,
            shard_placement_fn=lambda p, names=names: placements[names[id(p)]],
        )
        params = dict(cube.named_parameters())
        out[key] = {
            "units": {n: p.ragged_shard.unit for n, p in params.items()},
            "cuts": {n: _cuts(p) for n, p in params.items()},
            "notes": cube._raggedfsdp_state.group.notes,
        }
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_units_keep_the_placement_dims_whole_and_notes_say_so(pool):
    for res in pool.run(_units_and_notes):
        for name, (shape, unit, cuts) in res["shard0"].items():
            slice_numel = max(1, math.prod(shape[1:]))  # every cut on a dim-0 slice boundary
            assert unit == slice_numel and all(c % slice_numel == 0 for c in cuts), name
        plain = res["plain"]
        assert plain["units"] == {"cube": 4, "mat": 1, "vec": 1}, plain
        assert all(c % 4 == 0 for c in plain["cuts"]["cube"])  # on dim-1 index boundaries
        combined = res["row_units(2)"]  # LCM with the policy: 2 rows of 4, 2 rows of 3, 2
        assert combined["units"] == {"cube": 8, "mat": 6, "vec": 2}, combined
        assert all(c % 8 == 0 for c in combined["cuts"]["cube"])
        for group_notes, unit in ((plain["notes"], 4), (combined["notes"], 8)):
            notes = [n for n in group_notes if ": Shard(" in n]  # (the expert notes aside)
            assert len(notes) == 2, notes  # cube and mat (Shard(-1) is Shard(1)); vec is dim 0
            cube_note = next(n for n in notes if n.startswith("cube (6, 5, 4): Shard(1)"))
            assert "block of dim 1 in every leading index" in cube_note, cube_note
            assert f"whole dim-1 indices (unit {unit} elements = {unit // 4} of them)" in cube_note
            assert any(n.startswith("mat (7, 3): Shard(1)") for n in notes), notes


def test_notes_summarise_one_placement_shared_by_many_tensors():
    model = shard_blocks(make_model(), shard_placement_fn=_wide_on_dim1)
    notes = model.layers[0]._raggedfsdp_state.group.notes
    assert notes == (notes[0],) and notes[0].startswith("w2.weight (16, 40): Shard(1)"), notes
    for layers, expected in ((3, 3), (5, 1)):  # one group; more than MAX_NOTE_LINES (4): 1
        wide = make_model(layers=layers)
        fully_shard(wide, shard_placement_fn=_wide_on_dim1)
        wide_notes = wide._raggedfsdp_state.group.notes
        assert len(wide_notes) == expected, wide_notes
    assert wide_notes[0].startswith("5 tensors (layers.0.w2.weight (16, 40), ..., layers.4.w2")
    assert not fully_shard(make_model())._raggedfsdp_state.group.notes  # no fn: no notes


# ----------------------------------------------------------------------------- (c) FSDP2 code
def _fsdp2_style_vs_one_process(steps: int, fn_name: str) -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    fn = {"largest": _largest_dim, "wide": _wide_on_dim1}[fn_name]
    world = dist.get_world_size()
    reference = make_model()
    ref_losses = train(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), steps, sharded=False
    )
    expected = {n: q.detach() for n, q in reference.named_parameters()}
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    runs = [("ours", fn, fully_shard), ("default", None, fully_shard)]
    if world == 2:  # FSDP2 needs dim d > 0 to split evenly: w2's 40 columns do not at W = 3
        runs.append(("fsdp2", fn, fsdp2_fully_shard))
    for name, placement, wrap in runs:
        model = shard_blocks(make_model(), wrap, mesh=mesh, shard_placement_fn=placement)
        losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), steps)
        full = full_params(model)  # (ours or FSDP2's: RaggedTensor or DTensor)
        out[name] = {
            "params": max((full[n] - q).abs().max().item() for n, q in expected.items()),
            "losses": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "falls": losses[-1] < losses[-3],
        }
        if name == "ours":
            out["w2_unit"] = model.layers[0].w2.weight.ragged_shard.unit
            ours = full
        if name == "fsdp2":
            out["vs_fsdp2"] = max((ours[n] - full[n]).abs().max().item() for n in full)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("fn_name", ["largest", "wide"])
def test_fsdp2_placement_code_matches_one_process(pool, world_size, fn_name):
    """Losses within 1e-6 of one process; parameters as close as the default-units run's (the
    data-parallel average's rounding, through AdamW's first steps, measured 3.1e-6 at W = 2
    and 5.2e-7 at W = 3 for both), and bitwise FSDP2 with the same function where it runs
    (W = 2: at W = 3 FSDP2 refuses w2's uneven dim-1 split, which runs here)."""
    for res in pool.run(_fsdp2_style_vs_one_process, 4, fn_name):
        ours = res["ours"]
        assert ours["losses"] < 1e-6 and ours["falls"], res
        assert ours["params"] <= res["default"]["params"] + 1e-7 and ours["params"] < 5e-6, res
        assert res["w2_unit"] == 1, res  # w2 (16, 40) on Shard(1): one element per column
        if world_size == 2:
            assert res["vs_fsdp2"] == 0.0, res  # bitwise FSDP2 (two terms add alike)


# ----------------------------------------------------------------------------- (d) refusals
def _refused(fn, error: type[Exception], match: str) -> str:
    model = make_model()
    before = dict(model.named_parameters())
    with pytest.raises(error, match=match) as info:
        fully_shard(model, shard_placement_fn=fn)
    message = str(info.value)
    assert "\n" not in message, message
    assert dict(model.named_parameters()) == before  # the same tensors, in place
    assert not isinstance(model, FSDPModule) and not hasattr(model, "_raggedfsdp_state")
    fully_shard(model)  # and it can be wrapped afterwards
    return message


def test_bad_placements_are_refused_in_one_line_before_anything_changes():
    _refused(Shard(0), TypeError, r"shard_placement_fn=Shard\(dim=0\)\): expected FSDP2's callable")

    def raising(param: nn.Parameter) -> Shard:
        raise KeyError("no rule\nfor this one")

    _refused(
        raising,
        RuntimeError,
        r"raised KeyError\(.*\) for parameter 'embed\.weight' of shape \(32, 16\).*return "
        r"Shard\(d\) or None",
    )
    _refused(
        lambda p: Replicate(),
        ValueError,
        r"returned Replicate\(\) for parameter 'embed\.weight'.*FSDP2 \(which refuses it too\)",
    )
    _refused(lambda p: 1, ValueError, r"returned 1 for parameter 'embed\.weight'")
    _refused(
        lambda p: Shard(2) if p.ndim == 2 else None,
        ValueError,
        r"Shard\(dim=2\) for parameter 'embed\.weight'.*out of range for a 2-D tensor; return "
        r"Shard\(d\) with -2 <= d < 2",
    )
    _refused(lambda p: Shard(-3) if p.ndim == 1 else None, ValueError, r"'layers\.0\.attn_norm")
    foreign = ShardPlacementResult(placement=Shard(0), mesh_info=object())
    _refused(lambda p: foreign, NotImplementedError, r"ShardPlacementResult on another mesh")


def _placement_results() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    same = ShardPlacementResult(placement=Shard(1), mesh_info=FSDPMeshInfo(mesh, shard_mesh_dim=0))
    model = make_model()
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: same if p.ndim == 2 else None)
    units = {n: p.ragged_shard.unit for n, p in model.named_parameters()}
    other = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("ep", "dp"))
    expert = ShardPlacementResult(Shard(0), FSDPMeshInfo(other, shard_mesh_dim=1))  # 1 rank
    try:
        fully_shard(make_model(), mesh=mesh, shard_placement_fn=lambda p: expert)
        refusal = "accepted"
    except NotImplementedError as error:
        refusal = str(error)
    return {"units": units, "refusal": refusal}


@pytest.mark.parametrize("world_size", [2])
def test_placement_result_on_the_own_mesh_is_its_placement_another_mesh_is_refused(pool):
    for res in pool.run(_placement_results):
        assert res["units"]["embed.weight"] == 1 and res["units"]["norm.weight"] == 1, res
        assert "\n" not in res["refusal"], res["refusal"]
        assert "for parameter 'embed.weight'" in res["refusal"], res["refusal"]
        assert "own fully_shard(module, mesh=<that mesh>) call" in res["refusal"], res["refusal"]


def test_a_strict_policy_refuses_a_placement_the_layout_cannot_honour():
    """Under ``strict(...)``, FSDP2's strided ``Shard(1)`` is an error naming the tensor and
    the fix, raised before anything changes; ``Shard(0)`` stays accepted."""
    from raggedfsdp.sharding import element_units, strict

    model = make_model()
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"strict shard policy: .*Shard\(1\).*Return Shard\(0\)"):
        fully_shard(model, shard_placement_fn=_wide_on_dim1, shard_policy=strict(element_units()))
    assert dict(model.named_parameters()) == before and not isinstance(model, FSDPModule)
    fully_shard(model, shard_placement_fn=_shard0, shard_policy=strict(element_units()))
