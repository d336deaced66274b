"""The real-shape MoE presets build on the meta device with the published parameter counts
(``raggedfsdp/data/model_shapes.json``): exactly, once the parts each preset's comment names as
not modelled are left out of the published side (and, for DeepSeek-V3, attention of ours)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import raggedfsdp
from recipes.llama.moe import MoETransformer
from recipes.llama.moe_config import moe_preset

SHAPES = Path(raggedfsdp.__file__).parent / "data" / "model_shapes.json"

# preset -> (model_shapes.json name, published tensors not modelled, our parameters left out)
CASES = {
    "qwen3_30b_a3b": ("qwen3-30b-a3b", r"\.(q|k)_norm\.", None),
    "gpt_oss_120b": ("gpt-oss-120b", r"bias$|sinks$", None),
    # multi-head latent attention is not modelled: compare everything but attention
    "deepseek_v3": ("deepseek-v3", r"^self_attn\.|e_score_correction_bias$", r"\.attention\."),
}


def _published(model: str, skip: str) -> int:
    (entry,) = (m for m in json.loads(SHAPES.read_text())["models"] if m["name"] == model)
    return sum(
        group.get("repeat", 1) * math.prod(shape)
        for group in entry["groups"]
        for name, shape in group["tensors"]
        if not re.search(skip, name)
    )


@pytest.mark.parametrize("preset", list(CASES))
def test_real_moe_preset_has_the_published_parameter_count(preset):
    model_name, not_modelled, ours_left_out = CASES[preset]
    with torch.device("meta"):
        model = MoETransformer(moe_preset(preset), 4096)
    ours = sum(
        p.numel()
        for name, p in model.named_parameters()
        if ours_left_out is None or not re.search(ours_left_out, name)
    )
    assert ours == _published(model_name, not_modelled)


def test_the_parts_left_out_are_small_where_attention_is_modelled():
    """Qwen3's QK-norm (12,288) and GPT-OSS's biases and sinks (40M) are < 0.1 % of the model."""
    for preset in ("qwen3_30b_a3b", "gpt_oss_120b"):
        model_name, not_modelled, _ = CASES[preset]
        total = _published(model_name, r"^$")
        assert total - _published(model_name, not_modelled) < 1e-3 * total
