"""What the human report says, and that ``--json`` carries the same figures."""

from __future__ import annotations

import json

import pytest

from raggedfsdp.capacity.cli import main


def _run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _json(capsys, *argv: str) -> dict:
    return json.loads(_run(capsys, *argv, "--json"))


def test_fp8_report_compares_with_fsdp2_and_names_the_better_format(capsys) -> None:
    """Llama-3-8B at W = 256: 128-row units pad 288 %, so the FP8 payload, half the bf16 gather
    of its own layout, is 1.94x FSDP2's bf16 gather; 1x32 MXFP8 blocks pad ~1 % (0.52x)."""
    argv = ("llama3-8b", "-w", "256", "--all-gather", "fp8")
    report = _run(capsys, *argv)
    for needle in (
        "unit: 1 element, whole experts within a 0.1 % padding budget; 128-row units for fp8's "
        "tiles |",
        "FP8 all-gather: fp8 (128x128 tiles, fp32 scales, 128-row units)\n",
        "  per step 1.94x the bytes of FSDP2's bfloat16 all-gather (57.79 GiB vs 29.80 GiB sent "
        "per rank); padding is 74.2 % of the payload\n",
        "  mxfp8 would move 0.52x FSDP2's bytes here (--all-gather mxfp8)\n",
        "the payload is 0.5001x the bfloat16 gather of the same layout",
    ):
        assert needle in report, needle
    out = _json(capsys, *argv)
    fp8, traffic = out["float8_all_gather_bytes"], out["traffic_bytes"]
    assert out["unit"].endswith("; 128-row units for fp8's tiles")
    assert (fp8["format"], fp8["tile"], fp8["scale_bytes"], fp8["units"]) == (
        "fp8",
        [128, 128],
        4,
        "128-row units",
    )
    assert fp8["fsdp2_ratio"] == pytest.approx(traffic["all_gather"] / traffic["fsdp2_all_gather"])
    assert fp8["fsdp2_ratio"] == pytest.approx(1.939, abs=1e-3)
    assert fp8["payload_padding_pct"] == pytest.approx(100 * fp8["padding"] / fp8["payload"])
    assert fp8["suggested"] == "mxfp8" and set(fp8["fsdp2_ratios"]) == {"param", "fp8", "mxfp8"}
    assert 0.5 < fp8["ratio"] < 0.501  # the figure kept from before, against its own layout


def test_each_kinds_ratio_is_what_that_kind_reports(capsys) -> None:
    """The alternatives are planned as a run with that ``--all-gather`` plans them."""
    argv = ("llama3-8b", "-w", "256", "--all-gather")
    fp8 = _json(capsys, *argv, "fp8")["float8_all_gather_bytes"]
    mx = _json(capsys, *argv, "mxfp8")["float8_all_gather_bytes"]
    assert mx["fsdp2_ratio"] == fp8["fsdp2_ratios"]["mxfp8"]
    assert mx["fsdp2_ratios"] == fp8["fsdp2_ratios"] and mx["suggested"] is None
    plain = _json(capsys, "llama3-8b", "-w", "256")["traffic_bytes"]
    assert fp8["fsdp2_ratios"]["param"] == plain["all_gather"] / plain["fsdp2_all_gather"]
    report = _run(capsys, *argv, "mxfp8")
    best = "mxfp8 moves the fewest bytes of the --all-gather kinds here (param 1.00x, fp8 1.94x)"
    assert best in report
    assert "1-row units for mxfp8's tiles" in report and "e8m0 block scales" in report


def test_plain_gather_has_no_fp8_section(capsys) -> None:
    out = _json(capsys, "llama3-8b", "-w", "256")
    assert out["float8_all_gather_bytes"] is None and out["all_gather"] == "param"
    assert out["unit"] == "1 element, whole experts within a 0.1 % padding budget"
    assert "FP8 all-gather" not in _run(capsys, "llama3-8b", "-w", "256")


def test_notes_heading_only_with_notes(capsys) -> None:
    """Llama-3-70B at W = 8 plans without padding notes: the report ends with the timing."""
    quiet = _run(capsys, "llama3-70b", "-w", "8")
    assert _json(capsys, "llama3-70b", "-w", "8")["notes"] == []
    assert "Notes" not in quiet and quiet.rstrip().splitlines()[-1].startswith("planned in")
    noisy = _run(capsys, "llama3-8b", "-w", "256", "--unit-rows", "128")
    assert "\nNotes\n  - embed: " in noisy and "\n  - layer: " in noisy
