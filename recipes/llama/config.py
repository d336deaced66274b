"""The recipe's configuration: one dataclass, presets as TOML files, ``--key value`` overrides.

The defaults are the tiny CPU demo, so ``torchrun ... -m recipes.llama.train`` with no arguments
runs it. ``--config NAME`` loads ``configs/NAME.toml`` (or any ``.toml`` / ``.json`` path) first,
or, for a MoE preset name (``moe_config.MOE_PRESETS``: ``moe_tiny``, ``mixtral_8x7b``, ...),
makes the model that MoE shape; the other ``--key value`` / ``--key=value`` pairs then override
it, in order. Keys are the field names below with ``-`` or ``_`` (``--wandb-mode offline``),
model fields are ``--model.<name>`` (the MoE ones, such as ``--model.top-k``, on a MoE model).
A file holds top-level keys and a ``[model]`` table. Files are read with ``tomllib`` / ``json``
only: a config can set values, never run code.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from recipes.llama.model_config import ConfigError, ModelConfig, MoEConfig
from recipes.llama.moe_config import MOE_PRESETS, moe_preset
from recipes.llama.pipeline_checks import check_pp

__all__ = [
    "USAGE_ERROR",
    "Config",
    "ConfigError",
    "ModelConfig",
    "check_ep",
    "parse_args",
    "usage",
]

PRESET_DIR = Path(__file__).parent / "configs"
USAGE_ERROR = 2  # exit status of a run refused with a one-line message (argparse's status)


Optimizer = Literal["adamw", "adamw8bit", "muon", "shampoo", "soap"]


@dataclass
class Config:
    """Everything a run needs; see ``usage()`` for the list with help."""

    # run
    run_dir: Annotated[str, "outputs: metrics, plot, checkpoints, wandb run"] = "runs/tiny"
    seed: Annotated[int, "one seed for init and data order, the same on every rank"] = 0
    steps: Annotated[int, "optimizer steps in total (a resumed run continues to this)"] = 200
    model: ModelConfig = field(default_factory=ModelConfig)
    # data
    data_dir: Annotated[str, "train.bin, val.bin, meta.json (default: made on first use)"] = (
        "runs/data/default"
    )
    seq_len: Annotated[int, "tokens per sequence"] = 128
    batch_size: Annotated[int, "sequences per optimizer step, over all ranks"] = 16
    micro_batch_size: Annotated[int, "sequences per forward/backward on one rank"] = 8
    # optimizer and schedule
    optimizer: Annotated[Optimizer, "adamw | adamw8bit | muon | shampoo | soap"] = "adamw"
    lr: Annotated[float, "peak learning rate (AdamW and Muon's non-matrix parameters)"] = 3e-3
    muon_lr: Annotated[float, "peak learning rate of Muon's matrices"] = 0.02
    min_lr_ratio: Annotated[float, "final learning rate as a fraction of the peak"] = 0.1
    lr_schedule: Annotated[Literal["cosine", "wsd"], "cosine | wsd (warmup-stable-decay)"] = (
        "cosine"
    )
    warmup_steps: Annotated[int, "linear warmup steps"] = 20
    decay_fraction: Annotated[float, "wsd: fraction of the steps spent decaying"] = 0.2
    weight_decay: Annotated[float, "decoupled weight decay of matrices (not norms)"] = 0.1
    beta1: Annotated[float, "Adam beta1 (Muon momentum)"] = 0.9
    beta2: Annotated[float, "Adam beta2"] = 0.95
    eps: Annotated[float, "Adam epsilon"] = 1e-8
    grad_clip: Annotated[float, "max global gradient norm (0: no clipping)"] = 1.0
    preconditioner_dim: Annotated[
        int,
        "Shampoo/SOAP block side (max_preconditioner_dim); with --tp/--ep, blocks the split "
        "cuts are computed on owners (one dividing the TP/EP blocks moves nothing)",
    ] = 1024
    # parallelism and memory
    fsdp: Annotated[Literal["raggedfsdp", "fsdp2"], "raggedfsdp | fsdp2 (PyTorch)"] = "raggedfsdp"
    whole_experts: Annotated[
        bool, "MoE: every expert matrix whole on one rank even where it pads (default: up to 0.1 %)"
    ] = False
    dp_replicate: Annotated[int, "HSDP replicas (mesh dim 0); 1 = plain FSDP over all ranks"] = 1
    tp: Annotated[int, "tensor-parallel degree (last mesh dim, torchtitan's Llama plan)"] = 1
    loss_parallel: Annotated[
        bool, "--tp: logits and cross-entropy sharded over the vocabulary (torchtitan's)"
    ] = False
    ep: Annotated[
        int, "MoE: expert-parallel degree (E / ep whole experts per rank, all-to-all)"
    ] = 1
    pp: Annotated[int, "pipeline-parallel degree (first mesh dim): layers split in stages"] = 1
    pp_schedule: Annotated[
        Literal["gpipe", "1f1b", "interleaved"], "--pp: gpipe | 1f1b | interleaved (1F1B)"
    ] = "1f1b"
    pp_stages_per_rank: Annotated[int, "--pp-schedule interleaved: stages per pp rank"] = 2
    microbatches: Annotated[
        int, "--pp: microbatches per step (0: each dp rank's rows / micro_batch_size)"
    ] = 0
    mixed_precision: Annotated[Literal["none", "bf16"], "bf16: bf16 compute, fp32 master"] = "none"
    all_gather: Annotated[
        Literal["param", "fp8", "mxfp8"],
        "fp8: 128x128 block-wise FP8 weight all-gather; mxfp8: 1x32 MX blocks (raggedfsdp)",
    ] = "param"
    activation_checkpointing: Annotated[bool, "recompute each block's activations"] = False
    compile: Annotated[bool, "torch.compile each block before wrapping it (as torchtitan)"] = False
    device: Annotated[Literal["auto", "cpu", "cuda"], "auto: cuda when available"] = "auto"
    # evaluation, checkpoints, logging
    eval_every: Annotated[int, "validation every N steps (and at the end; 0: never)"] = 50
    eval_batches: Annotated[int, "global batches per validation"] = 2
    checkpoint_every: Annotated[
        int, "checkpoint every N steps and at the end (0: only on SIGINT/SIGTERM)"
    ] = 100
    keep_checkpoints: Annotated[int, "complete checkpoints kept (older ones are deleted)"] = 2
    resume: Annotated[str, "auto (latest in run_dir) | never | path of a checkpoint"] = "auto"
    export_weights: Annotated[
        bool, "at the end, write the full weights to run_dir/model.pt (rank 0, a plain state dict)"
    ] = False
    wandb_mode: Annotated[Literal["online", "offline", "disabled"], "wandb mode"] = "offline"
    wandb_project: Annotated[str, "wandb project"] = "raggedfsdp"
    peak_tflops: Annotated[float, "per-device peak for MFU (0: GPU table / measured on CPU)"] = 0.0
    progress: Annotated[bool, "tqdm progress bar on rank 0"] = True

    def check(self) -> None:
        """Checks that need no process group (the batch split is checked at start-up)."""
        self.model.check()
        positive = (
            "steps",
            "seq_len",
            "batch_size",
            "micro_batch_size",
            "dp_replicate",
            "tp",
            "ep",
            "pp",
            "pp_stages_per_rank",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.seed < 0:
            raise ConfigError(f"seed={self.seed} must be >= 0")
        if self.all_gather != "param" and self.fsdp != "raggedfsdp":
            raise ConfigError(
                f"all_gather={self.all_gather} needs --fsdp raggedfsdp (FSDP2 gathers bf16 only)"
            )
        if not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.decay_fraction <= 1:
            raise ConfigError("min_lr_ratio and decay_fraction must be in [0, 1]")
        check_ep(self)
        check_tp(self.model, self.seq_len, self.tp, self.all_gather)
        if self.loss_parallel and self.tp == 1:
            raise ConfigError(
                "--loss-parallel needs --tp N > 1 (it shards the logits over the TP ranks): "
                "add --tp 2 (or another degree) or drop --loss-parallel"
            )
        check_pp(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tp_split_dims(model: ModelConfig, seq_len: int) -> dict[str, int]:
    """The sizes ``tensor_parallel``'s plan cuts into ``--tp`` equal parts, by the key that sets
    each."""
    swiglu = "SwiGLU width (model.dim, model.ffn_dim_multiplier, model.multiple_of)"
    dims = {
        "model.n_heads": model.n_heads,
        "model.n_kv_heads": model.n_kv_heads,
        swiglu: model.ffn_hidden,
        "model.vocab_size": model.vocab_size,
        "seq_len": seq_len,  # sequence-parallel activations between the blocks
    }
    if isinstance(model, MoEConfig):  # every expert's (and the shared one's) d_ff is split
        dims["model.moe_hidden"] = model.moe_hidden
        if model.n_dense_layers == 0:  # no dense SwiGLU to split
            del dims[swiglu]
    return dims


def _degrees(dims: dict[str, int]) -> str:
    """The TP degrees (up to the smallest dim) that divide every dim, for the error's fix."""
    fits = [
        str(d) for d in range(1, min(dims.values()) + 1) if all(v % d == 0 for v in dims.values())
    ]
    return f"{', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else fits[0]


def check_tp(model: ModelConfig, seq_len: int, tp: int, all_gather: str) -> None:
    """Refuse a ``--tp`` the model cannot be split by (``tensor_parallel``'s plan), in one line
    naming ``--tp`` and the fix, while the command line is parsed."""
    if tp == 1:
        return
    if model.tie_embeddings:
        raise ConfigError(
            f"--tp {tp} with --model.tie-embeddings: the TP plan shards the embedding and the "
            "head as two parameters (torchtitan's Llama does not tie them); drop "
            "--model.tie-embeddings or use --tp 1"
        )
    if all_gather != "param":
        raise ConfigError(
            f"--tp {tp} with --all-gather {all_gather}: raggedfsdp's FP8 all-gathers refuse "
            "tensor-parallel weights (the FP8 tiles of a whole weight do not exist on one TP "
            "rank); drop --all-gather or use --tp 1"
        )
    dims = tp_split_dims(model, seq_len)
    bad = [f"{key}={size}" for key, size in dims.items() if size % tp]
    if bad:
        raise ConfigError(
            f"--tp {tp} does not divide {', '.join(bad)} (TP splits each into {tp} equal parts): "
            f"use --tp {_degrees(dims)}, or change those sizes"
        )


def check_ep(cfg: Config) -> None:
    """Refuse an ``--ep`` the run cannot use, in one line naming ``--ep`` and the fix, while the
    command line is parsed (the world size is checked at start-up: ``parallel.check_ep_world``)."""
    ep = cfg.ep
    if ep == 1:
        return
    if not isinstance(cfg.model, MoEConfig):
        raise ConfigError(
            f"--ep {ep} with a dense model: expert parallelism splits a MoE model's experts; "
            "start from a MoE preset (--config moe_tiny) or use --ep 1"
        )
    experts = cfg.model.n_experts
    if experts % ep:
        fits = [str(d) for d in range(1, experts + 1) if experts % d == 0]
        raise ConfigError(
            f"--ep {ep} does not divide model.n_experts={experts} (each EP rank holds "
            f"n_experts / ep whole experts): use --ep {', '.join(fits[:-1])} or {fits[-1]}"
        )


def _keys(cls: type) -> dict[str, Any]:
    """Field name -> type, with ``model.<name>`` for the model's fields (the MoE model's, a
    superset of the dense one's)."""
    hints = typing.get_type_hints(cls)  # without the Annotated help
    keys: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "model":
            keys.update({f"model.{k}": t for k, t in _keys(MoEConfig).items()})
        else:
            keys[f.name] = hints[f.name]
    return keys


KEYS = _keys(Config)


def _coerce(key: str, kind: Any, value: Any) -> Any:
    """``value`` (a string from the command line, or a TOML/JSON value) as the field's type."""
    choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
    try:
        if choices is not None:
            if value not in choices:
                raise ValueError(f"expected one of {', '.join(choices)}")
            return value
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError("expected true or false")
            return text in ("true", "1", "yes")
        if kind is int and isinstance(value, float | bool):
            raise ValueError("expected an integer")
        if kind is float and isinstance(value, bool):
            raise ValueError("expected a number")
        return kind(value)
    except ValueError as err:
        raise ConfigError(f"{key}={value!r}: {err}") from None


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, KEYS, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    valid = ", ".join(["config", *KEYS])
    return ConfigError(f"unknown config key {key!r}{hint}. Valid keys: {valid}")


def _set(cfg: Config, key: str, value: Any) -> None:
    key = key.replace("-", "_")
    if key not in KEYS:
        raise _unknown(key)
    target, name = (cfg.model, key[6:]) if key.startswith("model.") else (cfg, key)
    if target is cfg.model and name not in {f.name for f in dataclasses.fields(cfg.model)}:
        raise ConfigError(
            f"{key} is a MoE setting but the model is dense: start from a MoE preset "
            f"(--config moe_tiny; MoE presets: {', '.join(MOE_PRESETS)}), then override"
        )
    setattr(target, name, _coerce(key, KEYS[key], value))


def _flatten(table: dict[str, Any], source: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            if key != "model":
                raise ConfigError(f"{source}: table [{key}] is unknown; only [model] is valid")
            flat.update({f"model.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def load_file(name: str) -> dict[str, Any]:
    """A preset name (``configs/<name>.toml``) or a ``.toml`` / ``.json`` path, as flat keys."""
    path = Path(name)
    if not path.suffix:
        path = PRESET_DIR / f"{name}.toml"
        if not path.is_file():
            names = [*sorted(p.stem for p in PRESET_DIR.glob("*.toml")), *MOE_PRESETS]
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"no preset {name!r}; {hint}presets: {', '.join(names)} (or give a file path)"
            )
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        if path.suffix == ".json":
            table = json.loads(path.read_text())
        elif path.suffix == ".toml":
            import tomllib  # Python 3.11+

            table = tomllib.loads(path.read_text())
        else:
            raise ConfigError(f"config file {str(path)!r}: use a .toml or .json file")
    except (ValueError, ModuleNotFoundError) as err:  # tomllib/json decode errors subclass it
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"config file {str(path)!r} cannot be read: {err}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a table of keys")
    return _flatten(table, str(path))


def _parser() -> argparse.ArgumentParser:
    """Every key as an option in both spellings, its value kept as text for ``_coerce``.

    argparse does the command line's grammar (``--key value``, ``--key=value``, a bare
    ``--flag`` for booleans, a missing value); options not given stay out of the result
    (``SUPPRESS``), so they do not undo a ``--config`` file's values.
    """
    parser = argparse.ArgumentParser(
        prog="recipes.llama.train",
        add_help=False,
        allow_abbrev=False,
        exit_on_error=False,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", action="append", metavar="NAME|PATH")
    for key, kind in KEYS.items():
        spellings = dict.fromkeys((f"--{key.replace('_', '-')}", f"--{key}"))
        if kind is bool:
            parser.add_argument(*spellings, dest=key, nargs="?", const="true", metavar="BOOL")
        else:
            parser.add_argument(*spellings, dest=key, metavar="VALUE")
    return parser


def _options(argv: list[str]) -> dict[str, Any]:
    """The command line's options as {key: value}, the last one winning (``config``: a list)."""
    try:
        given, rest = _parser().parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise ConfigError(f"{err} (see --help)") from None
    if rest:
        if rest[0].startswith("--") and rest[0] != "--":
            raise _unknown(rest[0][2:].partition("=")[0].replace("-", "_"))
        raise ConfigError(f"expected --key value, got {rest[0]!r} (see --help)")
    return vars(given)


def parse_args(argv: list[str]) -> Config:
    """Defaults, then every ``--config`` file in order, then the other options."""
    options = _options(argv)
    cfg = Config()
    for name in options.pop("config", []):
        if name in MOE_PRESETS:  # the whole model becomes that MoE shape
            cfg.model = moe_preset(name)
            continue
        for file_key, file_value in load_file(name).items():
            _set(cfg, file_key, file_value)
    for key, value in options.items():
        _set(cfg, key, value)
    cfg.check()
    return cfg


def usage() -> str:
    """Every key with its default and help, for ``--help``."""
    lines = [
        "--config NAME|PATH             preset (configs/*.toml), a .toml/.json file, or a MoE "
        f"preset ({', '.join(MOE_PRESETS)})"
    ]
    dense = {f.name for f in dataclasses.fields(ModelConfig)}
    for owner, prefix in ((Config(), ""), (MoEConfig(), "model.")):
        hints = typing.get_type_hints(type(owner), include_extras=True)
        for f in dataclasses.fields(owner):
            if f.name == "model":
                continue
            name = f"--{prefix}{f.name.replace('_', '-')}"
            help_text = hints[f.name].__metadata__[0]
            if prefix and f.name not in dense:
                help_text = f"MoE: {help_text}"
            lines.append(f"{name:<30} {getattr(owner, f.name)!s:<18} {help_text}")
    return "\n".join(lines)
