"""``raggedfsdp plan`` on the real ``config.json`` of one public model per supported family.

The files under ``configs/`` hold every key of the published Hugging Face config (named
``ORG--MODEL.json`` after the repository), not only the keys the planner reads: a key the
planner misreads or wrongly requires shows up here. Each model's parameter count is checked
against the count its publisher gives:

* total: to half a unit of the published figure's last digit (``"30.5"``: within 0.05 B);
* active (MoE): within 2.5 %, since cards give two digits; DeepSeek's leave out the
  embedding table (a lookup, no matmul), the others count it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from raggedfsdp.capacity import ModelShapes, load_model
from raggedfsdp.capacity.cli import main
from raggedfsdp.capacity.hf_config import SUPPORTED_MODEL_TYPES

CONFIGS = Path(__file__).with_name("configs")
ACTIVE_REL = 0.025
ROUTED = re.compile(r"(^|\.)experts\.\d+\.")


@dataclass(frozen=True)
class Published:
    """A model's counts as its card (or the HF page's safetensors count) prints them."""

    total: str  # billions, as printed
    active: str | None = None  # billions activated per token (MoE)
    embedding_active: bool = True  # whether ``active`` counts the embedding table


MODELS = {
    "meta-llama--Meta-Llama-3-8B": Published("8.03"),
    "mistralai--Mistral-7B-v0.1": Published("7.24"),
    "mistralai--Mixtral-8x7B-v0.1": Published("46.7", "12.9"),
    "Qwen--Qwen2-7B": Published("7.62"),
    "Qwen--Qwen2-57B-A14B": Published("57.4", "14"),
    "Qwen--Qwen3-8B": Published("8.2"),
    "Qwen--Qwen3-30B-A3B": Published("30.5", "3.3"),
    "google--gemma-7b": Published("8.54"),
    "google--gemma-2-9b": Published("9.24"),
    "google--gemma-3-1b-pt": Published("1.00"),
    "microsoft--Phi-3-mini-4k-instruct": Published("3.82"),
    "deepseek-ai--DeepSeek-V2-Lite": Published("15.7", "2.4", embedding_active=False),
    "deepseek-ai--DeepSeek-V3": Published("671", "37", embedding_active=False),
}


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def _billions(printed: str) -> tuple[float, float]:
    """The printed figure and half a unit of its last digit, in parameters."""
    decimals = len(printed.partition(".")[2])
    return float(printed) * 1e9, 0.5 * 10.0**-decimals * 1e9


def _active(model: ModelShapes, cfg: dict, embedding: bool) -> float:
    """Parameters one token runs through: all but the routed experts it is not sent to."""
    routed = lookup = 0
    for g in model.groups:
        for name, shape in g.tensors:
            n = g.repeat * math.prod(shape)
            routed += n if ROUTED.search(name) else 0
            lookup += n if name == "embed_tokens.weight" else 0
    experts = next(
        cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in cfg
    )
    active = model.numel - routed + routed * cfg["num_experts_per_tok"] / experts
    return active if embedding else active - lookup


def test_every_listed_family_has_a_public_config() -> None:
    families = {_config(name)["model_type"] for name in MODELS}
    assert families == set(SUPPORTED_MODEL_TYPES)
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameters_match_the_published_count(name: str) -> None:
    model, published = load_model(str(CONFIGS / f"{name}.json")), MODELS[name]
    total, tolerance = _billions(published.total)
    assert model.numel == pytest.approx(total, abs=tolerance)
    if published.active is not None:
        active = _active(model, _config(name), published.embedding_active)
        assert active == pytest.approx(float(published.active) * 1e9, rel=ACTIVE_REL)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_cli_plans_it(capsys, name: str) -> None:
    """Per-expert and fused MoE tensors hold the same parameters; both plan."""
    cfg, path = _config(name), str(CONFIGS / f"{name}.json")
    layouts = [[], ["--experts", "fused"]] if "num_experts_per_tok" in cfg else [[]]
    for experts in layouts:
        assert main([path, "-w", "64", "--json", *experts]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["model"]["params"] == load_model(path).numel, experts


def test_qwen3_moe_has_no_shared_expert_and_is_the_preset() -> None:
    """Qwen3-MoE dropped Qwen2-MoE's shared expert: no ``shared_expert_intermediate_size``,
    and the layers are those of the ``qwen3-30b-a3b`` preset (written from the checkpoint)."""
    model = load_model(str(CONFIGS / "Qwen--Qwen3-30B-A3B.json"))
    preset = load_model("qwen3-30b-a3b")
    assert [(g.name, g.repeat) for g in model.groups] == [(g.name, g.repeat) for g in preset.groups]
    for ours, theirs in zip(model.groups, preset.groups, strict=True):
        assert dict(ours.tensors) == dict(theirs.tensors), ours.name
    qwen2 = dict(load_model(str(CONFIGS / "Qwen--Qwen2-57B-A14B.json")).groups[1].tensors)
    assert qwen2["mlp.shared_expert.up_proj.weight"] == (20480, 3584)
    assert qwen2["mlp.shared_expert_gate.weight"] == (1, 3584)


def test_llama3_config_has_the_presets_shapes() -> None:
    """Meta's checkpoint names differ from ``transformers``'; the shapes do not."""
    model = load_model(str(CONFIGS / "meta-llama--Meta-Llama-3-8B.json"))
    preset = load_model("llama3-8b")
    for ours, theirs in zip(model.groups, preset.groups, strict=True):
        assert ours.repeat == theirs.repeat
        assert sorted(s for _, s in ours.tensors) == sorted(s for _, s in theirs.tensors)
