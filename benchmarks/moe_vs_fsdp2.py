"""raggedfsdp.fully_shard vs PyTorch FSDP2 on a Mixture-of-Experts model (CPU, gloo).

The model is the recipe's ``MoETransformer`` (``recipes/llama/moe.py``: fused ``(E, d_ff, d)``
experts, top-k softmax router; by default a shared expert and one dense first block, as the
recipe's ``moe_tiny``; ``--shared-experts 0 --dense-layers 0`` with a wide ``--moe-hidden``
gives real MoE models' proportions, experts ~95 % of the parameters), built with the same
seed for both systems and wrapped the same way: each block, then the root. The expert count
``E`` is chosen so that ``W`` does not divide it (W=4 with E=6, W=3 with E=8): FSDP2's even
dim-0 split then gives every rank room for ``ceil(E/W)`` experts of every fused tensor
(padding), while our planner pads nothing and keeps whole experts on ranks wherever that adds
no padding.

Every rank builds both and alternates them (A B A B, the order rotating each round) over the
same batches. Reported per system and as ratios ours / FSDP2 (lower is better):

* ``step``: a training step (forward, backward, optimizer step), median; ``optim``: the
  optimizer step alone;
* ``all_gather`` / ``reduce_scatter``: calls and bytes of one step, counted exactly at the
  runtimes' collective calls (``measure.CollectiveBytes``: gathered buffer / unreduced input);
* ``static_tensors``: the storage bytes of this rank's parameters, gradients and optimizer
  state (each storage once, FSDP2's padding included), what a GPU holds between steps;
  ``static``: the same as resident memory, what the resident set drops by when the system is
  deleted after the run (glibc's heap trimmed before each reading: ``measure.trimmed_rss_kib``);
* ``transient``: peak resident memory above the post-warm-up level during a step (ranks
  started with ``MALLOC_*`` set, ``VmHWM`` reset before the step: ``measure.py``), median;
  memory figures are the maximum over ranks (FSDP2's first ranks hold whole chunks);
* final losses and their difference, and with AdamW the same loss trained in one process on
  every rank's batch (``one_process_loss``), to tell a gap between the systems from both
  drifting;
* with ``--optimizer muon``: ours is ``raggedfsdp.optim.Muon`` (hidden matrices and every
  fused expert orthogonalised per expert; embedding, head and norms on AdamW) with the bytes
  its owner exchange moved (``last_step_stats``, summed over ranks) and the Muon matrices
  cut between ranks (each expert counted on its own; whole ones move nothing); FSDP2's is
  ``torch.optim.Muon`` on the 2-D hidden matrices and ``torch.optim.AdamW`` on the rest,
  the 3-D fused experts included: torch's Muon takes 2-D parameters only and a DTensor
  sharded on dim 0 has no per-expert view, so FSDP2 cannot orthogonalise the experts (its
  optimizer does less work than ours).
  Where torch's Muon fails on FSDP2's shards the error is reported instead. Every AdamW, ours
  inside Muon and torch's, runs with the same ``ADAMW`` settings (betas, eps, lr, decay).
* with ``--ep N`` (expert parallelism, ``recipes/llama/expert_parallel.py``): the fused
  experts are ``Shard(0)`` DTensors over an ``ep`` dim of the ``(dp_shard_mod_ep, ep)`` mesh and
  tokens reach them by all-to-all (the recipe's ``dispatch``, the same code on both sides).
  Ours wraps each MoE block with ``shard_ep_block`` (our ``fully_shard`` on the experts over
  ``dp_shard_mod_ep``, then on the block over every rank), FSDP2's with
  ``shard_ep_block_fsdp2`` (torch's ``fully_shard``, torchtitan's wrapping); the dense blocks
  and the root over every rank on both. ``all_to_all``: calls and bytes this rank sends
  (``dist.all_to_all_single`` inputs, the count exchanges included).
* with ``--ep N --tp M`` (EP x TP, torchtitan's ``(dp_shard_mod_ep, ep, tp)`` mesh): every
  block gets the recipe's TP plan on ``tp`` first (``tensor_parallel.apply_tp_to_block``,
  the root ``apply_tp_to_root``), the experts then become DTensors on ``mesh["ep", "tp"]``
  (each EP rank's experts, their ``d_ff`` split over ``tp``), and both FSDPs shard the TP
  ranks' local tensors as with ``--ep`` alone. The ranks of a TP group train on the same
  batch (one per data-parallel rank). TP's own collectives (the MoE layers' sequence gather
  and reduce-scatter over ``tp``, DTensor's redistributions) are the same code on both sides
  and are not counted, nor are ours over a one-rank group (at W=4, ``dp_shard_mod_ep``: a
  copy; FSDP2 makes no call there): ``all_gather`` / ``reduce_scatter`` stay FSDP's traffic.

    python benchmarks/moe_vs_fsdp2.py [--world-size 4] [--experts 6] [--mixed-precision]
        [--optimizer {adamw,muon}] [--steps 8] [--dim 256] [--layers 4] [--moe-hidden 256]
        [--shared-experts 1] [--dense-layers 1] [--vocab 4096] [--batch 2] [--seq 64]
    python benchmarks/moe_vs_fsdp2.py --ep 2 [--world-size 4 --experts 6] [--optimizer muon]
    python benchmarks/moe_vs_fsdp2.py --ep 2 --tp 2 [--mixed-precision]
    python benchmarks/moe_vs_fsdp2.py --part capacity --world-size 4 --batch 1 --seq 8 [--ep 2]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from measure import (
    Both,
    CollectiveBytes,
    alternate_rounds,
    init_gloo,
    peak_allocated,
    spawn_ranks,
    train_step,
    trimmed_rss_kib,
)
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the recipe's model, for a script run from benchmarks/
    sys.path.insert(0, str(REPO))
from raggedfsdp.sharding.ep_split import check_ep, ep_complement  # noqa: E402
from recipes.llama.moe import MoEBlock, MoETransformer  # noqa: E402
from recipes.llama.moe_config import MoEConfig  # noqa: E402

SYSTEMS = ("ours", "fsdp2")
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
#: torch.optim.AdamW's settings on FSDP2's side, and our Muon's AdamW groups' (``adamw_*``).
ADAMW = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8}


def config(args: argparse.Namespace) -> MoEConfig:
    """The benchmark's MoE shape (the per-expert loop: the CPU path of the recipe)."""
    return MoEConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=max(1, args.dim // 64),
        n_kv_heads=max(1, args.dim // 128),
        vocab_size=args.vocab,
        n_experts=args.experts,
        top_k=args.top_k,
        moe_hidden=args.moe_hidden,
        n_shared_experts=args.shared_experts,
        n_dense_layers=args.dense_layers,
        expert_impl="loop",
    )


def make_model(args: argparse.Namespace) -> MoETransformer:
    model = MoETransformer(config(args), args.seq)
    model.init_weights(seed=0)
    return model


def build(system: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MoE model wrapped by ``system`` per block and at the root, with its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp.optim import Muon

    if system == "ours":
        from raggedfsdp import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kwargs: dict[str, Any] = {}
    if args.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    if system == "ours" and args.optimizer == "muon":
        kwargs["shard_policy"] = Muon.shard_policy()
    model = make_model(args)
    if args.ep > 1:
        wrap_ep(system, model, args.ep, fully_shard, kwargs, args.tp)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
    return model, optimizer(system, model, args)


def wrap_ep(
    system: str, model: nn.Module, ep: int, fully_shard, kwargs: dict[str, Any], tp: int = 1
) -> None:
    """``model`` under expert parallelism, as the recipe wraps it (``parallel.build_model``'s
    order): with ``tp`` above 1 each block's TP plan first; the experts ``Shard(0)`` over
    ``ep`` (EP x TP: on ``("ep", "tp")``), each MoE block by ``shard_ep_block`` (ours) or
    ``shard_ep_block_fsdp2`` (FSDP2 x EP, torchtitan's), the dense blocks over every rank of
    ``dp_shard``; then the root's TP plan and the root."""
    from recipes.llama.expert_parallel import (
        distribute_experts,
        ep_meshes,
        shard_ep_block,
        shard_ep_block_fsdp2,
    )
    from recipes.llama.tensor_parallel import apply_tp_to_block, apply_tp_to_root

    mesh, dp = ep_meshes(ep, tp=tp)
    shard_block = shard_ep_block if system == "ours" else shard_ep_block_fsdp2
    for layer in model.layers:
        if tp > 1:
            apply_tp_to_block(layer, mesh["tp"])
        if isinstance(layer, MoEBlock):
            distribute_experts(layer, mesh["ep", "tp"] if tp > 1 else mesh["ep"])
            shard_block(layer, mesh, dp, **kwargs)
        else:
            fully_shard(layer, mesh=dp, **kwargs)
    if tp > 1:
        apply_tp_to_root(model, mesh["tp"])
    fully_shard(model, mesh=dp, **kwargs)


def optimizer(system: str, model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    from raggedfsdp.optim import Muon, split_muon_params

    if args.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), **ADAMW)
    groups = split_muon_params(model)
    if system == "ours":
        adamw = {"adamw_lr": ADAMW["lr"], "adamw_betas": ADAMW["betas"], "adamw_eps": ADAMW["eps"]}
        return Muon(groups, **MUON, **adamw)
    matrices = [p for g in groups if g["use_muon"] for _, p in g["params"] if p.ndim == 2]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    return Both(torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **ADAMW))


def tensor_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Storage bytes of this rank's parameters, gradients and optimizer state (each storage
    once), and with mixed precision our groups' bf16 copies of their segments (the input of
    their all-gathers, refreshed once per optimizer step): what a system keeps between steps,
    padding included."""
    return sum(storage_bytes(model, opt).values())


def storage_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[int, int]:
    """``tensor_bytes``' storages, each once: data pointer -> bytes (their sizes tell which
    the allocator put in the heap and which in their own mappings)."""
    storages: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            local = getattr(t, "local", None)
            local = t._local_tensor if hasattr(t, "_local_tensor") else local
            t = local if isinstance(local, torch.Tensor) else t
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for module in model.modules():  # ours: a group's param-dtype copy of its segment
        for group in module._fsdp_state().groups if hasattr(module, "_fsdp_state") else []:
            add(group.compute.shard)
    for o in getattr(opt, "optimizers", [opt]):
        for state in o.state.values():
            for value in state.values():
                add(value)
    return storages


def rank_tokens(args: argparse.Namespace, rank: int) -> torch.Tensor:
    """The batch data-parallel rank ``rank`` trains on at every step (its own seed); under TP
    every rank of a TP group (neighbouring ranks: ``rank // tp``) has the same."""
    gen = torch.Generator().manual_seed(rank)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)


def one_process_loss(args: argparse.Namespace) -> float:
    """What an AdamW run's reported loss is in one process: the model trained on every rank's
    batch at once for the steps each system took before its counted one (2 warm-up, the
    rounds), then rank 0's loss (the report is rank 0's). Both systems are judged by how far
    they land from it, so a gap between them can be told apart from both drifting."""
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    dp = args.world_size // args.tp
    step = _round(args, torch.cat([rank_tokens(args, r) for r in range(dp)]))
    for _ in range(2 + args.steps):
        step(model, opt)
    tokens = rank_tokens(args, 0)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).item()


def _round(args: argparse.Namespace, tokens: torch.Tensor):
    """The step function of one (model, optimizer) pair: returns (loss, optimizer seconds)."""

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[float, float]:
        logits = model(tokens[:, :-1])
        return train_step(
            F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()), opt
        )

    return step


def _build(args: argparse.Namespace, step) -> dict[str, dict[str, Any]]:
    """Both systems, each warmed up by two steps (optimizer state created), or the error that
    stopped its first steps."""
    systems = {}
    for name in SYSTEMS:
        model, opt = build(name, args)
        error = None
        try:
            for _ in range(2):
                step(model, opt)
        except Exception as e:  # torch's Muon on FSDP2's uneven DTensor shards
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        systems[name] = {"model": model, "opt": opt, "error": error}
        systems[name]["static_tensors"] = tensor_bytes(model, opt) / 2**20
    return systems


def _static_resident(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The resident memory each system holds between steps: what the resident set drops by
    when it is deleted (memory a backend keeps for itself, such as gloo's, stays), read with
    glibc's heap trimmed (``measure.trimmed_rss_kib``: FSDP2's small per-parameter tensors
    free inside the heap, and an untrimmed reading would still count them)."""
    static = {}
    for name in SYSTEMS:
        before = trimmed_rss_kib()
        del systems[name]["model"], systems[name]["opt"]
        static[name] = (before - trimmed_rss_kib()) / 1024
    return static


def _warm_up(args: argparse.Namespace, step) -> None:
    """Both systems on a one-block copy of the model, then dropped: the one-off costs (imports,
    kernels, autograd and gloo threads, the allocator's arenas) are not charged to the first
    system measured."""
    small = argparse.Namespace(**{**vars(args), "layers": 1})
    for name in SYSTEMS:
        model, opt = build(name, small)
        for _ in range(2):
            try:
                step(model, opt)
            except Exception:  # measured (and reported) on the real model
                break
        del model, opt
    gc.collect()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port)
    tokens = rank_tokens(args, rank // args.tp)
    step = _round(args, tokens)
    _warm_up(args, step)
    systems = _build(args, step)
    runs = [n for n in SYSTEMS if systems[n]["error"] is None]
    rounds = alternate_rounds(systems, runs, args.steps, step)
    report = {name: _last_step(systems[name], step) for name in SYSTEMS}
    for name in runs:
        report[name] |= rounds[name]
    for name, static in _static_resident(systems).items():
        report[name]["static"] = static
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, report)
    if rank == 0:  # memory: the rank that holds most (FSDP2's first ranks hold whole chunks)
        for name in SYSTEMS:
            for key in ("static", "static_tensors", "transient"):
                if key in report[name]:
                    report[name][key] = max(r[name][key] for r in everyone)
            if "optimizer_bytes" in report[name]:  # Muon's exchange: all ranks together
                report[name]["optimizer_bytes"] = sum(r[name]["optimizer_bytes"] for r in everyone)
        out.put(report)
    dist.barrier()  # leave together: gloo may abort a rank that tears down while a peer runs
    dist.destroy_process_group()


def _last_step(system: dict[str, Any], step) -> dict[str, Any]:
    """One more step with its collectives counted: calls, MiB, the loss, Muon's exchange."""
    entry = {"static_tensors": system["static_tensors"], "error": system["error"]}
    if system["error"] is not None:
        return entry
    model, opt = system["model"], system["opt"]
    counter = CollectiveBytes()
    ep_groups = [m.ep_mesh.get_group() for m in model.modules() if hasattr(m, "ep_mesh")]
    tp_groups = [m.tp_mesh.get_group() for m in model.modules() if getattr(m, "tp_mesh", None)]
    uncounted = {(owner, name): getattr(owner, name) for owner, name in _uncounted_calls()}
    with (
        counter.counting(),
        counting_all_to_all(counter, ep_groups),
        passing_uncounted(tp_groups, uncounted),
    ):
        entry["loss"] = step(model, opt)[0]
    entry["calls"] = dict(counter.calls)
    entry["bytes"] = {k: v / 2**20 for k, v in counter.bytes.items()}
    stats = getattr(opt, "last_step_stats", {})
    if "bytes_sent" in stats:
        entry["optimizer_bytes"] = stats["bytes_sent"] + stats["bytes_received"]
        entry["muon_cut"] = muon_cut(model, opt)
    return entry


def _uncounted_calls() -> list[tuple[Any, str]]:
    """What ``CollectiveBytes`` counts that moves no FSDP bytes here: the MoE layers' TP
    collectives over ``tp`` (``tensor_parallel.moe_tp_forward``'s sequence gather and
    reduce-scatter) and our all-gathers and reduce-scatters over a one-rank group (EP x TP at
    W=4 leaves ``dp_shard_mod_ep`` one rank: ours then copies, FSDP2 makes no call)."""
    from raggedfsdp.fsdp import param_group

    ours = [(param_group, "all_gather_flat"), (param_group, "reduce_scatter_flat")]
    return [(dist, "all_gather_single"), (dist, "reduce_scatter_single"), *ours]


@contextmanager
def passing_uncounted(
    tp_groups: list[Any], uncounted: dict[tuple[Any, str], Any]
) -> Iterator[None]:
    """Route the ``_uncounted_calls`` over one of the TP ``tp_groups`` or a one-rank group to
    ``uncounted`` (the functions as they were before ``CollectiveBytes.counting``), so that
    the all-gather and reduce-scatter figures are FSDP's communication alone; every other
    call goes on to the counter."""
    counted = {(owner, name): getattr(owner, name) for owner, name in _uncounted_calls()}

    def route(key: tuple[Any, str]) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            skip = any(group is g for g in tp_groups) or (group is not None and group.size() == 1)
            return (uncounted if skip else counted)[key](*args, **kwargs)

        return call

    for owner, name in counted:
        setattr(owner, name, route((owner, name)))
    try:
        yield
    finally:
        for (owner, name), fn in counted.items():
            setattr(owner, name, fn)


@contextmanager
def counting_all_to_all(counter: CollectiveBytes, groups: list[Any]) -> Iterator[Counter[str]]:
    """Count EP's ``dist.all_to_all_single`` calls (those over one of the EP ``groups``) into
    ``counter`` as ``all_to_all``: calls and the bytes this rank sends (its input, the part it
    keeps for itself included), the token dispatch, the combine, their backward and the count
    exchanges alike. Our Muon's owner exchange is an all-to-all too, over other groups: it is
    reported as ``optimizer_bytes``, not here."""
    original = dist.all_to_all_single

    def counted(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if any(kwargs.get("group") is g for g in groups):
            counter.calls["all_to_all"] += 1
            counter.bytes["all_to_all"] += input.numel() * input.element_size()
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counted
    try:
        yield counter.calls
    finally:
        dist.all_to_all_single = original


def muon_cut(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Muon matrices of ours cut between ranks, by parameter (each expert of a fused tensor
    counted on its own): those travel to their owner and back; whole ones move nothing."""
    names = {id(p): n for n, p in model.named_parameters()}
    cut = {}
    for group in opt.param_groups:
        for p in group["params"] if group.get("use_muon") else []:
            bounds = p.ragged_shard.bounds
            pieces = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
            size = math.prod(p.shape[1:]) if p.ndim == 3 else p.numel()
            split = [
                sum(a < start + size and start < b for a, b in pieces) > 1
                for start in range(0, p.numel(), size)
            ]
            if any(split):
                cut[names[id(p)]] = sum(split)
    return cut


def model_shapes(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark's wrapping in the capacity planner's shapes format: every block a group,
    the root (embedding, final norm, head) the root group."""
    model = make_model(args)
    root = [[n, list(p.shape)] for n, p in model.named_parameters() if not n.startswith("layers.")]
    groups = [{"name": "root", "repeat": 1, "root": True, "tensors": root}]
    for i, layer in enumerate(model.layers):
        tensors = [[n, list(p.shape)] for n, p in layer.named_parameters()]
        groups.append({"name": f"layers.{i}", "repeat": 1, "tensors": tensors})
    return {"name": "moe-benchmark", "groups": groups}


def predicted(args: argparse.Namespace) -> dict[str, float]:
    """The capacity planner's per-rank memory for this run (no activations), in MiB."""
    from raggedfsdp.capacity import Mesh, Precision, Settings, estimate, parse_shapes

    param = "bfloat16" if args.mixed_precision else "float32"
    settings = Settings(
        Mesh(1, args.world_size, 1, args.ep),
        precision=Precision(param=param),
        backend="gloo",
        tokens_per_rank=args.batch * args.seq,
        top_k=args.top_k,
    )
    est = estimate(parse_shapes(model_shapes(args), "moe_vs_fsdp2"), settings)
    return {k: v / 2**20 for k, v in est.memory.items()} | {"peak_phase": est.peak_phase}


def _capacity_worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    """Ours only: this rank's live tensor bytes between steps and their peak during a step
    (the profiler's allocator events), the quantities the planner estimates."""
    init_gloo(rank, world, port)
    tokens = rank_tokens(args, rank)
    step = _round(args, tokens)
    model, opt = build("ours", args)
    for _ in range(2):
        step(model, opt)
    persistent = tensor_bytes(model, opt) / 2**20
    peak = peak_allocated(lambda: step(model, opt))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (persistent, persistent + peak))
    if rank == 0:
        out.put({"persistent": max(e[0] for e in everyone), "total": max(e[1] for e in everyone)})
    dist.barrier()
    dist.destroy_process_group()


def capacity(args: argparse.Namespace) -> None:
    """Predicted beside measured per-rank memory, one JSON line and a table row."""
    measured = spawn_ranks(_capacity_worker, args, args.world_size)
    plan = predicted(args)
    row = {"benchmark": "moe_capacity", "args": vars(args), "measured": measured}
    row |= {"predicted": plan, "ratio": plan["total"] / measured["total"]}
    print(json.dumps(row))
    persistent = plan["params"] + plan["optimizer"]
    print(
        f"W={args.world_size}: persistent predicted {persistent:.2f}"
        f" / measured {measured['persistent']:.2f} MiB; peak predicted {plan['total']:.2f} / "
        f"measured {measured['total']:.2f} MiB ({row['ratio']:.3f}; at {plan['peak_phase']})"
    )


def ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """ours / FSDP2 of every figure both have."""
    keys = ("step", "optim", "static", "static_tensors", "transient")
    out = {k: ours[k] / peer[k] for k in keys if k in ours and k in peer and peer[k]}
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        if kind in ours.get("bytes", {}) and peer.get("bytes", {}).get(kind):
            out[f"{kind}_bytes"] = ours["bytes"][kind] / peer["bytes"][kind]
    return out


def print_table(result: dict[str, Any]) -> None:
    ours, peer, a = result["ours"], result["fsdp2"], result["args"]
    ep = f" x ep {a['ep']}" if a.get("ep", 1) > 1 else ""
    ep += f" x tp {a['tp']}" if a.get("tp", 1) > 1 else ""
    print(
        f"\nW={a['world_size']}{ep}, E={a['experts']}, {result['params'] / 1e6:.1f}M parameters, "
        f"{'bf16/fp32' if a['mixed_precision'] else 'fp32'}, {a['optimizer']}, "
        f"medians of {a['steps']} rounds"
    )
    if peer["error"]:
        print(f"FSDP2 failed: {peer['error']}")
        return
    print(f"{'':30s}{'raggedfsdp':>12s}{'FSDP2':>12s}{'ratio':>8s}")
    rows = [
        ("training step (ms)", lambda r: 1e3 * r["step"]),
        ("optimizer step (ms)", lambda r: 1e3 * r["optim"]),
        ("all-gather MiB / step", lambda r: r["bytes"].get("all_gather", 0.0)),
        ("all-gathers / step", lambda r: r["calls"].get("all_gather", 0)),
        ("reduce-scatter MiB / step", lambda r: r["bytes"].get("reduce_scatter", 0.0)),
        ("static resident (MiB)", lambda r: r["static"]),
        ("static tensor bytes (MiB)", lambda r: r["static_tensors"]),
        ("transient peak (MiB)", lambda r: r["transient"]),
    ]
    if ep:
        rows[5:5] = [
            ("EP all-to-all MiB sent / step", lambda r: r["bytes"].get("all_to_all", 0.0)),
            ("EP all-to-alls / step", lambda r: r["calls"].get("all_to_all", 0)),
        ]
    for label, get in rows:
        mine, theirs = get(ours), get(peer)
        ratio = f"{mine / theirs:8.2f}" if theirs else f"{'':8s}"
        print(f"{label:30s}{mine:12.2f}{theirs:12.2f}{ratio}")
    if "optimizer_bytes" in ours:
        print(f"Muon owner exchange (ours, bytes all ranks moved): {ours['optimizer_bytes']}")
        print(f"Muon matrices cut between ranks (ours; experts each count): {ours['muon_cut']}")
    print(f"final loss: raggedfsdp {ours['loss']:.6f}, FSDP2 {peer['loss']:.6f}", end="")
    if "one_process_loss" in result:
        print(f", one process (fp32) {result['one_process_loss']:.6f}", end="")
    print()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--experts", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--moe-hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shared-experts", type=int, default=1)
    parser.add_argument("--dense-layers", type=int, default=1, help="leading dense blocks")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 reduce")
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert parallelism: experts over an ep dim, FSDP over the world / ep ranks left "
        "(FSDP2 x EP on the other side); must divide --world-size and --experts",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="with --ep: EP x TP, the recipe's TP plan on a tp dim last (W = dp_shard_mod_ep x "
        "ep x tp); must divide the heads, widths, vocabulary and --seq",
    )
    parser.add_argument(
        "--part",
        choices=("compare", "capacity"),
        default="compare",
        help="capacity: ours alone, the capacity planner's per-rank memory beside the measured "
        "live tensor bytes (use a tiny batch: the planner leaves activations out)",
    )
    args = parser.parse_args(argv)
    try:
        config(args).check()  # bad shapes fail here, in one line, before any process starts
    except ValueError as e:
        parser.error(str(e))
    if args.world_size < 2:
        parser.error(f"--world-size {args.world_size}: compare at 2 ranks or more")
    if args.ep != 1:
        try:  # the runtime's own rules, before any process starts
            check_ep(args.experts, args.ep)
            ep_complement(args.world_size, args.ep)
        except ValueError as e:
            parser.error(f"--ep {args.ep}: {e}")
    if args.tp != 1:
        check_tp_args(parser, args)
    return args


def check_tp_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--tp``'s rules, the recipe's own (``config.check_tp``, ``parallel.check_ep_world``),
    before any process starts: EP x TP only (``tp_vs_fsdp2.py`` compares dense TP), the
    comparison only, a degree that splits the model and the world."""
    from recipes.llama.config import check_tp
    from recipes.llama.parallel import check_ep_world

    if args.tp < 1:
        parser.error(f"--tp {args.tp}: give a tensor-parallel degree of 1 or more")
    if args.ep == 1:
        parser.error(f"--tp {args.tp} needs --ep: use benchmarks/tp_vs_fsdp2.py for dense TP")
    if args.part != "compare":
        parser.error(f"--tp {args.tp} with --part {args.part}: the planner row is EP alone")
    try:
        check_tp(config(args), args.seq, args.tp, "param")
        check_ep_world(args.ep, args.world_size, args.experts, tp=args.tp)
    except ValueError as e:
        parser.error(str(e))


def main() -> None:
    args = parse_args()
    if args.part == "capacity":
        capacity(args)
        return
    report = spawn_ranks(_worker, args, args.world_size)
    params = sum(p.numel() for p in make_model(args).parameters())
    result = {"benchmark": "moe_vs_fsdp2", "args": vars(args), "params": params, **report}
    if report["fsdp2"]["error"] is None:
        result["ratio"] = ratios(report["ours"], report["fsdp2"])
        result["loss_diff"] = abs(report["ours"]["loss"] - report["fsdp2"]["loss"])
    if args.optimizer == "adamw":
        result["one_process_loss"] = one_process_loss(args)
    print(json.dumps(result))
    print_table(result)


if __name__ == "__main__":
    main()
