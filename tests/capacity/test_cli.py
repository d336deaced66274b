"""``raggedfsdp plan`` and ``python -m raggedfsdp.capacity plan``: output, JSON, speed, errors."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from raggedfsdp.capacity import preset_names
from raggedfsdp.capacity.cli import EXAMPLES, PROG, console_main, main
from tests.support.work import counted_lines

NUMBER = (int, float)
#: The --json schema: key -> type, or a nested schema.
SCHEMA = {
    "model": {
        "name": str,
        "source": str,
        "params": int,
        "distinct_groups": int,
        "fsdp_groups": int,
    },
    "mesh": {"replicate": int, "shard": int, "tp": int, "world": int},
    "unit": str,
    "optimizer": str,
    "precision": {"param": str, "master": str, "reduce": str},
    "reshard_after_forward": bool,
    "backend": str,
    "memory_bytes": {
        k: NUMBER
        for k in (
            "params",
            "grads",
            "optimizer",
            "optimizer_mean",
            "peak_unsharded",
            "total",
        )
    },
    "memory_excludes": list,
    "peak_phase": str,
    "padding": {
        k: NUMBER
        for k in (
            "elements",
            "pct",
            "lower_bound_elements",
            "lower_bound_pct",
            "fsdp2_elements",
            "fsdp2_pct",
            "fsdp2_cut_tensors",
            "tensors",
        )
    },
    "traffic_bytes": {
        k: NUMBER
        for k in (
            "all_gather",
            "reduce_scatter",
            "all_reduce",
            "fsdp2_all_gather",
            "fsdp2_reduce_scatter",
            "fsdp2_all_reduce",
        )
    },
    "traffic_excludes": list,
    "muon": (dict, type(None)),
    "all_gather": str,
    "float8_all_gather_bytes": (dict, type(None)),
    "groups": list,
    "notes": list,
    "planning_time_s": NUMBER,
    "elapsed_s": NUMBER,
}
GROUP = {
    "name": str,
    "instances": int,
    "tensors": int,
    "numel": int,
    "segment_elements": int,
    "padding_pct": NUMBER,
    "lower_bound_pct": NUMBER,
    "fsdp2_padding_pct": NUMBER,
    "fsdp2_cut_tensors": int,
    "empty_ranks": int,
    "plan_ms": NUMBER,
    "notes": list,
}
MUON = {
    "matrices": int,
    "max_cost": NUMBER,
    "mean_cost": NUMBER,
    "max_over_mean": NUMBER,
    "bound_over_mean": NUMBER,
    "local_matrices": int,
    "moved_bytes_max_rank": NUMBER,
    "moved_bytes_mean_rank": NUMBER,
}


def _check(obj: dict, schema: dict, where: str = "") -> None:
    assert set(obj) == set(schema), f"{where}: keys {sorted(set(obj) ^ set(schema))}"
    for key, kind in schema.items():
        if isinstance(kind, dict):
            _check(obj[key], kind, f"{where}.{key}")
        else:
            assert isinstance(obj[key], kind), f"{where}.{key} = {obj[key]!r}"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _json(capsys, *argv: str) -> dict:
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_answers_with_the_json_schema(capsys, preset: str) -> None:
    result = _json(capsys, preset, "-w", "8")
    _check(result, SCHEMA)
    for group in result["groups"]:
        _check(group, GROUP, "groups[]")
    assert result["muon"] is None
    assert result["memory_bytes"]["total"] > 0 and result["mesh"]["world"] == 8


def test_human_report(capsys) -> None:
    code, out, _ = _run(
        capsys,
        "llama3-70b",
        "--mesh",
        "2x64",
        "--unit-rows",
        "16",
        "--optimizer",
        "muon",
        "--gpu-memory",
        "80",
    )
    assert code == 0
    for needle in (
        "mesh 2 x 64 (replicate x shard) = 128 ranks",
        "Per-rank memory",
        "sharded parameters (float32)",
        "total at peak",
        "fits in 80 GiB: yes",
        "Padding (% of parameters)",
        "all-gather (forward + backward)",
        "all-reduce (replicate dim)",
        "Muon owners: 560 matrices",
        "Groups (S = elements per rank)",
        "unit: 16 rows",
    ):
        assert needle in out, needle


def test_the_default_unit_is_fully_shards_and_pads_no_more_than_fsdp2(capsys) -> None:
    result = _json(capsys, "llama3-70b", "--world-size", "1024")  # the README's example
    assert result["unit"] == "1 element, whole experts within a 0.1 % padding budget"
    assert result["padding"]["pct"] <= result["padding"]["fsdp2_pct"]
    assert result["traffic_bytes"]["all_gather"] <= result["traffic_bytes"]["fsdp2_all_gather"]
    assert _json(capsys, "llama3-8b", "-w", "8", "--unit-rows", "16")["unit"] == "16 rows"


def test_optimizer_options_reach_the_units(capsys) -> None:
    tiled = _json(capsys, "llama3-8b", "-w", "8", "--optimizer", "adamw8bit", "--tile", "32x32")
    blocks = _json(capsys, "llama3-8b", "-w", "8", "--optimizer", "adamw8bit")
    assert tiled["memory_bytes"]["optimizer"] != blocks["memory_bytes"]["optimizer"]
    never = _json(
        capsys, "llama3-8b", "-w", "8", "--optimizer", "muon", "--whole-matrices", "never"
    )
    auto = _json(capsys, "llama3-8b", "-w", "8", "--optimizer", "muon")
    assert never["muon"]["local_matrices"] < auto["muon"]["local_matrices"]
    with pytest.raises(SystemExit):
        main(["llama3-8b", "-w", "8", "--tile", "32"])


def test_muon_and_fit_in_json(capsys, tmp_path: Path) -> None:
    result = _json(
        capsys, "qwen1.5-moe-a2.7b", "-w", "16", "--optimizer", "muon", "--gpu-memory", "0.5"
    )
    _check(result["muon"], MUON)
    assert result["fits"]["fits"] is False
    assert result["optimizer"] == "muon"


def test_hf_config_and_shapes_file_inputs(capsys, tmp_path: Path) -> None:
    config = tmp_path / "tiny-moe" / "config.json"
    config.parent.mkdir()
    config.write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_local_experts": 4,
                "vocab_size": 256,
            }
        )
    )
    fused = _json(capsys, str(config), "-w", "4", "--experts", "fused", "--unit", "expert")
    assert fused["model"]["name"] == "tiny-moe"
    assert "experts fused" in fused["model"]["source"]
    assert fused["unit"] == "whole experts, 1 row elsewhere"
    shapes = tmp_path / "shapes.json"
    shapes.write_text(
        json.dumps(
            {
                "models": [
                    {
                        "name": "mine",
                        "groups": [
                            {"name": "g", "repeat": 2, "tensors": [["w", [64, 64]], ["b", [64]]]}
                        ],
                    }
                ]
            }
        )
    )
    result = _json(
        capsys,
        str(shapes),
        "-w",
        "3",
        "--optimizer",
        "adamw8bit",
        "--param-dtype",
        "fp32",
        "--backend",
        "gloo",
    )
    assert result["model"] == {
        "name": "mine",
        "source": str(shapes),
        "params": 2 * 4160,
        "distinct_groups": 1,
        "fsdp_groups": 2,
    }
    assert result["backend"] == "gloo"


def test_w_100k_answers_in_seconds(capsys) -> None:
    """About a second here; bounded in lines of the package's Python (deterministic under
    load, where a wall-clock bound flaked): a few dozen per rank and Muon matrix, where a scan
    of the ranks per matrix would run billions."""
    with counted_lines() as work:
        result = _json(capsys, "deepseek-v3", "-w", "100000", "--optimizer", "muon")
    assert result["mesh"]["shard"] == 100_000 and result["muon"]["matrices"] > 45_000
    assert work.lines <= 40 * (100_000 + result["muon"]["matrices"]), f"{work.lines:,} lines"


def _console_script() -> list[str]:
    """The ``raggedfsdp`` console script as the installer writes it: import the entry point that
    the installed metadata names (``pyproject.toml``'s ``[project.scripts]``) and exit with it."""
    (script,) = entry_points(group="console_scripts", name="raggedfsdp")
    module, _, func = script.value.partition(":")
    launcher = f"import sys; from {module} import {func} as run; sys.exit(run())"
    return [sys.executable, "-c", launcher]


#: The two ways to start the program, and the name each one's messages use.
FORMS = {
    "raggedfsdp": _console_script,
    "python -m raggedfsdp.capacity": lambda: [sys.executable, "-m", "raggedfsdp.capacity"],
}


def _start(form: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*FORMS[form](), *argv], capture_output=True, text=True, timeout=120, check=False
    )


def _same_text(out: str, form: str) -> str:
    """``out`` with the program's name spelled as the console script's, wrapping ignored
    (argparse wraps usage at a width that depends on the name's length)."""
    return " ".join(out.replace(form, "raggedfsdp").split())


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"]])
def test_both_forms_print_the_same_full_help(argv: list[str]) -> None:
    helps = {}
    for form in FORMS:
        proc = _start(form, *argv)
        assert (proc.returncode, proc.stderr) == (0, ""), (form, proc.stderr)
        helps[form] = _same_text(proc.stdout, form)
    assert len(set(helps.values())) == 1, helps
    text = helps["raggedfsdp"]
    assert "usage: raggedfsdp plan [-h]" in text and "(-w WORLD_SIZE | --mesh MESH)" in text
    assert "raggedfsdp plan llama3-70b --world-size 1024" in text  # the examples
    if argv == ["--help"]:
        assert "usage: raggedfsdp [-h] COMMAND" in text and "plan plan a model's" in text


def test_both_forms_plan_alike() -> None:
    """``python -m raggedfsdp.capacity plan ...`` answers as ``raggedfsdp plan ...`` does,
    at 8 and at 100,000 ranks (timings aside)."""
    timings = ("planning_time_s", "elapsed_s")
    for argv in (
        ["llama3-8b", "-w", "8"],
        ["llama3-405b", "--mesh", "8x12500"],
    ):
        results = []
        for form in FORMS:
            proc = _start(form, "plan", *argv, "--json")
            assert proc.returncode == 0, (form, proc.stderr)
            out = json.loads(proc.stdout)
            for group in out["groups"]:
                group.pop("plan_ms")
            results.append({k: v for k, v in out.items() if k not in timings})
        assert results[0] == results[1], argv
    assert results[0]["mesh"] == {"replicate": 8, "shard": 12500, "tp": 1, "world": 100_000}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_both_forms_report_errors_under_their_name(capsys, form: str) -> None:
    """The subcommand is required; a model without it, or an unknown option, gets one line
    that names the fix, in the words of the command that was typed."""
    for argv, message in (
        ([], f"{form}: error: the following arguments are required: COMMAND"),
        (["llama3-8b", "-w", "8"], "invalid choice: 'llama3-8b' (choose from 'plan')"),
        (
            ["plan", "llama3-8b", "-w", "8", "--bogus"],
            f"{form} plan: error: unrecognized arguments: --bogus (see {form} plan --help)",
        ),
        (["plan", "llama3-7b", "-w", "8"], f"{form} plan: error: unknown preset 'llama3-7b'"),
    ):
        try:
            code = console_main(argv, prog=form)
        except SystemExit as exc:  # argparse's errors
            code = exc.code
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), (argv, out)
        assert message in err and err.count("\n") == 1, (argv, err)


def test_the_help_examples_on_presets_run(capsys) -> None:
    """The examples ``--help`` prints are commands that work (the ones on presets)."""
    ran = 0
    for line in EXAMPLES.format(prog=PROG).splitlines():
        argv = shlex.split(line)[2:]  # after "raggedfsdp plan"
        if argv and argv[0] in preset_names():
            assert main(argv) == 0, line
            ran += 1
    capsys.readouterr()
    assert ran >= 3


def test_console_main_is_the_program(capsys) -> None:
    assert console_main(["plan", "llama3-8b", "-w", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "llama3-8b"
    with pytest.raises(SystemExit) as exc:
        console_main(["--help"])
    assert exc.value.code == 0 and "usage: raggedfsdp plan" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["llama3-7b", "-w", "8"], "unknown preset 'llama3-7b'; valid presets: llama3-8b"),
        (["llama3-8b", "--mesh", "4x"], "--mesh '4x': expected SHARD or REPLICATExSHARD"),
        (["llama3-8b", "--mesh", "0x64"], "every dimension must be >= 1"),
        (["llama3-8b", "-w", "8", "--unit", "expert"], "has no expert tensors"),
        (
            ["llama3-8b", "-w", "8", "--unit", "elements", "--unit-rows", "16"],
            "--unit-rows applies to --unit rows or expert",
        ),
        (["llama3-8b", "-w", "8", "--reduce-dtype", "fp12"], "--reduce-dtype 'fp12': unknown"),
        (["gpt-oss-120b", "-w", "8", "--experts", "fused"], "--experts applies to Hugging Face"),
        (["nowhere/config.json", "-w", "8"], "no such file"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and not out
    assert err.startswith("raggedfsdp plan: error: ") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["llama3-8b"],
        ["llama3-8b", "-w", "8", "--mesh", "2x4"],
        ["llama3-8b", "-w", "0"],
        ["llama3-8b", "-w", "eight"],
        ["llama3-8b", "-w", "8", "--optimizer", "sgd"],
    ],
)
def test_argument_errors_exit_2(capsys, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["llama3-8b", "-w", "8"], ["llama3-8b", "-w", "8", "--json"]])
def test_a_reader_that_stops_early_ends_the_run_quietly(argv: list[str]) -> None:
    """``raggedfsdp plan ... | head``: no BrokenPipeError traceback, the status ``cat`` gets.
    The pipe's read end is closed before the planner starts, so its first write fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "raggedfsdp.capacity", "plan", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, "")
