"""Command line: the ``raggedfsdp`` program, whose one subcommand so far is ``plan``.

The console script (``raggedfsdp plan MODEL ...``) and ``python -m raggedfsdp.capacity plan
MODEL ...`` are one program built by :func:`build_parser`; only the name in the messages differs.

Errors in the input (unknown preset, malformed config or shapes file, impossible mesh, bad unit)
are reported as one line naming the input and the fix, with exit status 2, like argparse's own.
``--verify`` also runs the case with the runtime (``raggedfsdp.capacity.verify``, imported only
then: the planner itself never imports torch) and prints estimate vs runtime per line.
A reader that stops early (``raggedfsdp plan ... | head``) ends the run quietly, as it ends
``cat``: status 141 (128 + SIGPIPE), no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from raggedfsdp.capacity.float8 import ALL_GATHER_KINDS
from raggedfsdp.capacity.hf_config import EXPERT_LAYOUTS
from raggedfsdp.capacity.loader import load_model, preset_names
from raggedfsdp.capacity.memory import estimate
from raggedfsdp.capacity.model_shapes import ModelShapes, PlanError
from raggedfsdp.capacity.policies import OPTIMIZERS, UNIT_KINDS, OptimizerSpec, UnitPolicy
from raggedfsdp.capacity.report import render
from raggedfsdp.capacity.settings import BACKENDS, Mesh, Precision, Settings
from raggedfsdp.sharding.units import DEFAULT_MAX_EXTRA_PADDING

if TYPE_CHECKING:
    from raggedfsdp.capacity.verify import Comparison

__all__ = ["MODULE_PROG", "PROG", "build_parser", "console_main", "main"]

#: The program's name as the console script (``pyproject.toml``) and as a module.
PROG = "raggedfsdp"
MODULE_PROG = "python -m raggedfsdp.capacity"
SIGPIPE_STATUS = 141  # 128 + SIGPIPE (13): a shell's status for a process a closed pipe ended

DESCRIPTION = """\
Capacity planner: per-rank memory, padding, traffic and Muon balance of a model
under raggedfsdp's structure-aware sharding, before you rent the GPUs."""
EXAMPLES = """examples:
  {prog} plan llama3-70b --world-size 1024
  {prog} plan deepseek-v3 --mesh 8x256 --unit-rows 128 --optimizer adamw8bit
  {prog} plan llama3-70b --mesh 4x32x8
  {prog} plan deepseek-v3 --mesh dp_replicate=1,dp_shard=256,ep=32 --top-k 8
  {prog} plan path/to/config.json -w 64 --experts fused --optimizer muon --json
  {prog} plan shapes.json --model my-model -w 8 --gpu-memory 80
  {prog} plan deepseek-v3 -w 256 --all-gather fp8
"""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, like the planner's own: the option, what is wrong
    and the fix, then where the full usage is, instead of a screen of usage above the line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give one >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be an integer >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number > 0, e.g. 80")
    return value


def _tile(text: str) -> tuple[int, int]:
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected ROWSxCOLS with integers >= 1, e.g. 32x32"
        )
    return int(parts[0]), int(parts[1])


_WHOLE = {"auto": "auto", "always": True, "never": False}


def _add_all_gather(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--all-gather",
        choices=ALL_GATHER_KINDS,
        default="param",
        help="what the all-gather moves: the param dtype, fp8 (128x128 block-wise FP8 "
        "weights with fp32 tile scales, 128-row units; Float8Blocks(128)) or mxfp8 (1x32 "
        "blocks with e8m0 scales, whole-row units; MXFP8Blocks())",
    )


def _add_whole_units(parser: argparse.ArgumentParser) -> None:
    """Muon's ``whole_matrices`` and the padding budget it shares with the default unit."""
    parser.add_argument(
        "--whole-matrices",
        choices=tuple(_WHOLE),
        default="auto",
        help="muon: keep its matrices whole on one rank always, never, or within "
        "--max-extra-padding (auto, Muon.shard_policy()'s default)",
    )
    parser.add_argument(
        "--max-extra-padding",
        type=float,
        default=DEFAULT_MAX_EXTRA_PADDING,
        metavar="F",
        help="padding whole experts (default unit) and Muon's auto matrices may add, as a "
        "fraction of a group's elements (default 0.001; 0: none)",
    )


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The whole program, ``PROG plan ...``: one parser for the console script and the module,
    so their usage, help and errors are the same. Its help shows ``plan``'s usage line too,
    since that is the command everyone runs."""
    examples = EXAMPLES.format(prog=prog)
    parser = _Parser(
        prog=prog,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", required=True
    )
    plan = commands.add_parser(
        "plan",
        help="plan a model's FSDP layout and estimate its per-rank memory and traffic",
        description=DESCRIPTION,
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_plan_arguments(plan)
    plan.set_defaults(parser=plan)  # for errors that only the whole command line shows
    parser.epilog = (
        f"{plan.format_usage()}\n{examples}\n'{prog} plan --help' explains every option."
    )
    return parser


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help=f"a preset ({', '.join(preset_names())}), a Hugging Face config.json or a shapes "
        "file in raggedfsdp/data/model_shapes.json's format",
    )
    parser.add_argument("--model", dest="model_name", help="model to take from a shapes file")
    parser.add_argument(
        "--experts",
        choices=EXPERT_LAYOUTS,
        help="MoE tensors of a HF config: one per expert (default) or fused (E, m, n) stacks",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("-w", "--world-size", type=_positive_int, help="FSDP ranks")
    where.add_argument(
        "--mesh",
        help="HSDP mesh REPLICATExSHARD, e.g. 4x256, or REPLICATExSHARDxTP with a "
        "tensor-parallel dim (torchtitan's Llama plan), e.g. 4x32x8, or torchtitan's dim names "
        "with an expert-parallel dim borrowed from dp_shard, e.g. "
        "dp_replicate=1,dp_shard=16,ep=8 (tp= too)",
    )
    parser.add_argument(
        "--top-k",
        type=_positive_int,
        help="with an ep dim: routed experts per token (num_experts_per_tok), for the all-to-all",
    )
    parser.add_argument(
        "--tokens-per-rank",
        type=_positive_int,
        default=4096,
        help="with an ep dim: tokens each rank routes per step (batch x sequence; default 4096)",
    )
    parser.add_argument(
        "--unit",
        choices=UNIT_KINDS,
        help="unit policy (default: elements, fully_shard's default: whole experts within "
        "--max-extra-padding; rows with --unit-rows)",
    )
    parser.add_argument(
        "--unit-rows", type=_positive_int, help="rows per unit for 'rows' and 'expert' (default 1)"
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument(
        "--block-size",
        type=_positive_int,
        default=256,
        help="adamw8bit quantization block (elements)",
    )
    parser.add_argument(
        "--tile",
        type=_tile,
        metavar="RxC",
        help="adamw8bit: quantize tensors of 2+ dims in RxC tiles (e.g. 32x32)",
    )
    parser.add_argument(
        "--max-preconditioner-dim", type=_positive_int, default=1024, help="shampoo block size b"
    )
    _add_whole_units(parser)
    parser.add_argument("--param-dtype", default="bf16", help="all-gather / compute dtype")
    _add_all_gather(parser)
    parser.add_argument("--master-dtype", default="fp32", help="sharded master weights")
    parser.add_argument("--reduce-dtype", default="fp32", help="gradient reduce-scatter dtype")
    parser.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="keep gathered parameters from forward to backward",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="nccl",
        help="collective backend the runtime will use (memory differs a little)",
    )
    parser.add_argument(
        "--gpu-memory",
        type=_positive_float,
        metavar="GIB",
        help="say whether the estimate fits in this much memory per GPU",
    )
    _add_output(parser)


def _add_output(parser: argparse.ArgumentParser) -> None:
    """What is printed: the report or ``--json``, and ``--verify``'s side-by-side table."""
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also run the case with the runtime itself (one rank on torch's fake process "
        "group, fake tensors; needs torch) and print estimate vs runtime per line",
    )


def _settings(args: argparse.Namespace) -> Settings:
    unit = args.unit or ("rows" if args.unit_rows is not None else "elements")
    if unit in ("elements", "matrix") and args.unit_rows is not None:
        raise PlanError(f"--unit-rows applies to --unit rows or expert, not --unit {unit}")
    mesh = Mesh.parse(args.mesh) if args.mesh is not None else Mesh(1, args.world_size)
    return Settings(
        mesh=mesh,
        units=UnitPolicy(unit, args.unit_rows or 1, args.max_extra_padding),
        optimizer=OptimizerSpec(
            args.optimizer,
            block_size=args.block_size,
            tile=args.tile,
            preconditioner_dim=args.max_preconditioner_dim,
            whole_matrices=_WHOLE[args.whole_matrices],
            max_extra_padding=args.max_extra_padding,
        ),
        precision=Precision(args.param_dtype, args.master_dtype, args.reduce_dtype),
        reshard_after_forward=not args.no_reshard_after_forward,
        backend=args.backend,
        all_gather=args.all_gather,
        tokens_per_rank=args.tokens_per_rank,
        top_k=args.top_k,
    )


def main(argv: Sequence[str], prog: str = PROG) -> int:
    """``PROG plan ARGV``: the plan command, for library use and tests."""
    return console_main(["plan", *argv], prog)


def console_main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The program (the ``raggedfsdp`` console script, ``python -m raggedfsdp.capacity``);
    returns the exit status (0, 2 for bad input, 141 for a closed pipe)."""
    try:
        try:
            args, unknown = build_parser(prog).parse_known_args(argv)
            if unknown:  # the subcommand's error: its usage is the one to read
                args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            return _plan(args, args.parser.prog)
        finally:  # also after --help: a closed pipe fails here, not at the interpreter's exit
            sys.stdout.flush()
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """stdout's reader closed it early (``| head``): stop quietly, as ``cat`` would. stdout
    now points at /dev/null, so the interpreter's final flush of what is still buffered
    cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_STATUS


def _plan(args: argparse.Namespace, prog: str) -> int:
    try:
        settings = _settings(args)
        model = load_model(args.model, model=args.model_name, experts=args.experts)
        result = estimate(model, settings)
        checked = _verify(model, settings) if args.verify else None
    except PlanError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        if args.gpu_memory is not None:
            limit = args.gpu_memory * 1024**3
            out["fits"] = {"gpu_memory_bytes": limit, "fits": out["memory_bytes"]["total"] <= limit}
        if checked is not None:
            out["verify_rank"] = checked.rank
            out["verify"] = [
                {"line": r.label, "estimate": r.estimate, "runtime": r.runtime, "ratio": r.ratio}
                for r in checked
            ]
        print(json.dumps(out))
    else:
        print(render(result, args.gpu_memory))
        if checked is not None:
            from raggedfsdp.capacity.verify import render_comparison

            print(f"\n{render_comparison(checked)}")
    return 0


def _verify(model: ModelShapes, settings: Settings) -> Comparison:
    """``--verify``: the dry run of the same case. Imported here, so that the planner without
    ``--verify`` never imports torch."""
    from raggedfsdp.capacity.verify import check_verifiable, verify

    check_verifiable(model, settings)
    return verify(model, settings)
