"""One entry point for every model source: a preset name, a shapes file or a HF config.json."""

from __future__ import annotations

import os
from pathlib import Path

from raggedfsdp.capacity.hf_config import is_hf_config, shapes_from_hf_config
from raggedfsdp.capacity.model_shapes import (
    ModelShapes,
    PlanError,
    bundled_names,
    load_bundled,
    load_json,
    parse_shapes,
)
from raggedfsdp.capacity.presets import HF_PRESETS

__all__ = ["load_model", "preset_names"]


def preset_names() -> list[str]:
    """Every preset: the models of ``model_shapes.json``, then the built-in HF configs."""
    return bundled_names() + sorted(HF_PRESETS)


def load_model(spec: str, *, model: str | None = None, experts: str | None = None) -> ModelShapes:
    """The model named by ``spec``: an existing JSON file (a HF ``config.json`` or a shapes file,
    told apart by their keys) or a preset name.

    Args:
        model: which model of a shapes file holding several.
        experts: ``"per-expert"`` (default) or ``"fused"`` MoE tensors; HF configs only, since a
            shapes file or a ``model_shapes.json`` preset fixes its tensors already.
    """
    path = Path(spec)
    if path.is_file():
        data = load_json(path, "model file")
        if is_hf_config(data):
            _only_for_shapes_files(model, spec)
            name = path.parent.name if path.name == "config.json" and path.parent.name else None
            return shapes_from_hf_config(
                data, spec, experts=experts or "per-expert", name=name or path.stem
            )
        _only_for_hf(experts, spec)
        return parse_shapes(data, spec, model)
    if spec in HF_PRESETS:
        _only_for_shapes_files(model, spec)
        return shapes_from_hf_config(
            HF_PRESETS[spec], f"preset {spec}", experts=experts or "per-expert", name=spec
        )
    found = load_bundled(spec)
    if found is not None:
        _only_for_hf(experts, spec)
        _only_for_shapes_files(model, spec)
        return found
    if path.suffix == ".json" or os.sep in spec:
        raise PlanError(f"model file {spec!r}: no such file; check the path")
    raise PlanError(
        f"unknown preset {spec!r}; valid presets: {', '.join(preset_names())}. "
        "Or pass the path of a Hugging Face config.json or of a shapes file"
    )


def _only_for_hf(experts: str | None, spec: str) -> None:
    if experts is not None:
        raise PlanError(
            f"--experts applies to Hugging Face configs and their presets; {spec!r} lists its "
            "tensors already (edit the shapes instead)"
        )


def _only_for_shapes_files(model: str | None, spec: str) -> None:
    if model is not None:
        raise PlanError(f"--model picks a model inside a shapes file; {spec!r} is not one")
