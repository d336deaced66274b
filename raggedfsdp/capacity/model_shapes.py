"""What the capacity planner plans: a model as an ordered list of FSDP groups of named shapes.

The format is ``raggedfsdp/data/model_shapes.json``'s: a model has ``groups``, each with a
``name``, a ``repeat`` count (32 identical transformer blocks are one group repeated 32 times, so
they are planned once) and ``tensors`` as ``[name, shape]`` pairs in model order. One optional
key is added: ``"root": true`` marks the group of the root module (e.g. tied embeddings), which
``fully_shard`` keeps unsharded from the first forward to the end of backward.

Three sources produce one: a preset name (the models of ``model_shapes.json`` and the Hugging
Face configs of :mod:`raggedfsdp.capacity.presets`), a shapes file in that format, or a Hugging Face
``config.json`` (:mod:`raggedfsdp.capacity.hf_config`). Every input error is a :class:`PlanError`
naming the input and the fix, because the CLI shows it to a user as is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "Group",
    "ModelShapes",
    "PlanError",
    "bundled_names",
    "load_bundled",
    "load_json",
    "parse_shapes",
]


class PlanError(ValueError):
    """Bad planner input; the message names the input and says how to fix it."""


Shape = tuple[int, ...]


@dataclass(frozen=True)
class Group:
    """One FSDP communication group (one ``fully_shard`` call), ``repeat`` times in a row.
    ``experts``: the routed experts of a MoE block under expert parallelism, sharded over the
    ``dp_shard_mod_ep`` ranks instead of all of ``dp_shard`` (``capacity/ep_plan.py``)."""

    name: str
    repeat: int
    tensors: tuple[tuple[str, Shape], ...]
    root: bool = False
    experts: bool = False

    @property
    def numel(self) -> int:
        """Elements of one instance of the group."""
        return sum(math.prod(shape) for _, shape in self.tensors)


@dataclass(frozen=True)
class ModelShapes:
    """A model: its groups in forward order. ``source`` says where the shapes came from."""

    name: str
    source: str
    groups: tuple[Group, ...]

    @property
    def numel(self) -> int:
        return sum(g.repeat * g.numel for g in self.groups)

    @property
    def num_fsdp_groups(self) -> int:
        return sum(g.repeat for g in self.groups)


def load_json(path: Path, what: str) -> Any:
    """Read a JSON file, turning every failure into a :class:`PlanError` that names the file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanError(f"{what} {str(path)!r}: no such file") from None
    except OSError as exc:
        raise PlanError(f"{what} {str(path)!r}: cannot read it ({exc.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"{what} {str(path)!r}: not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}); fix the file or regenerate it"
        ) from None


def _bundled_models() -> list[dict[str, Any]]:
    text = resources.files("raggedfsdp").joinpath("data/model_shapes.json").read_text()
    return json.loads(text)["models"]


def bundled_names() -> list[str]:
    return [m["name"] for m in _bundled_models()]


def load_bundled(name: str) -> ModelShapes | None:
    """The ``model_shapes.json`` model called ``name``, or None."""
    for model in _bundled_models():
        if model["name"] == name:
            return parse_shapes(model, "raggedfsdp/data/model_shapes.json")
    return None


def parse_shapes(data: Any, where: str, model: str | None = None) -> ModelShapes:
    """Validate shapes data: ``{"models": [...]}`` (pick one with ``model`` if there are several)
    or a single model object ``{"name": ..., "groups": [...]}``."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a JSON object with 'models' or 'groups'")
    if "models" in data:
        models = data["models"]
        if not isinstance(models, list) or not models:
            raise PlanError(f"{where}: 'models' must be a non-empty list of models")
        names = [m.get("name") if isinstance(m, dict) else None for m in models]
        if model is not None:
            if model not in names:
                raise PlanError(f"{where}: no model named {model!r}; the file has {names}")
            index = names.index(model)
        elif len(models) == 1:
            index = 0
        else:
            raise PlanError(f"{where}: holds {len(models)} models {names}; pick one with --model")
        return _parse_model(models[index], f"{where}: models[{index}]", where)
    if model is not None and data.get("name") != model:
        raise PlanError(f"{where}: holds one model {data.get('name')!r}, not {model!r}")
    return _parse_model(data, where, where)


def _parse_model(data: Any, where: str, source: str) -> ModelShapes:
    if not isinstance(data, dict):
        raise PlanError(f"{where}: a model must be an object with 'name' and 'groups'")
    name = data.get("name", "model")
    groups = data.get("groups")
    if not isinstance(groups, list) or not groups:
        raise PlanError(f"{where}: 'groups' must be a non-empty list of FSDP groups")
    parsed = tuple(_parse_group(g, f"{where}.groups[{i}]") for i, g in enumerate(groups))
    return ModelShapes(str(name), str(data.get("source", source)), parsed)


def _parse_group(data: Any, where: str) -> Group:
    if not isinstance(data, dict):
        raise PlanError(f"{where}: a group must be an object with 'name', 'repeat', 'tensors'")
    repeat = data.get("repeat", 1)
    if not _is_int(repeat) or repeat < 1:
        raise PlanError(f"{where}: 'repeat' must be a positive integer, got {repeat!r}")
    root = data.get("root", False)
    if not isinstance(root, bool):
        raise PlanError(f"{where}: 'root' must be true or false, got {root!r}")
    tensors = data.get("tensors")
    if not isinstance(tensors, list) or not tensors:
        raise PlanError(f"{where}: 'tensors' must be a non-empty list of [name, shape] pairs")
    parsed: list[tuple[str, Shape]] = []
    for i, item in enumerate(tensors):
        ok = isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)
        shape = item[1] if ok else None
        if not ok or not isinstance(shape, list | tuple):
            raise PlanError(f"{where}.tensors[{i}]: expected [name, [d0, d1, ...]], got {item!r}")
        if not all(_is_int(d) and d >= 0 for d in shape):
            raise PlanError(
                f"{where}.tensors[{i}] ({item[0]!r}): shape {shape!r} must be a list of "
                "non-negative integers"
            )
        parsed.append((item[0], tuple(shape)))
    names = [n for n, _ in parsed]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PlanError(f"{where}: tensor names repeat within the group: {dupes}")
    return Group(str(data.get("name", "group")), repeat, tuple(parsed), root)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
