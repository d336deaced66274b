"""Process groups, the device mesh, and wrapping the model with raggedfsdp or PyTorch FSDP2.

The recipe runs under ``torchrun`` (one process per device, any number of nodes) or as a plain
``python -m`` process (a world of one). ``--fsdp fsdp2`` swaps ``raggedfsdp.fully_shard`` for
``torch.distributed.fsdp.fully_shard`` with the same wrapping and mixed precision, so
the two can be compared on the same run. ``--tp N`` adds a tensor-parallel mesh dim
(``tensor_parallel``'s plan) under either; ``--ep N`` (MoE, raggedfsdp) splits the experts over
an ``ep`` dim (``expert_parallel``'s mesh and wrapping).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import raggedfsdp
from raggedfsdp.comm.launch import pin_gloo_to_loopback
from raggedfsdp.fsdp import Float8Blocks, MXFP8Blocks
from raggedfsdp.sharding import ShardPolicy
from raggedfsdp.state_dict import StateDictOptions, get_model_state_dict
from recipes.llama.config import Config, ConfigError
from recipes.llama.expert_parallel import (
    _is_moe,
    distribute_experts,
    ep_meshes,
    fsdp2_clip_grad_norm_,
    shard_ep_block,
    shard_ep_block_fsdp2,
)
from recipes.llama.model import Transformer
from recipes.llama.model_config import MoEConfig
from recipes.llama.moe import model_class
from recipes.llama.pipeline_checks import check_pp_world
from recipes.llama.tensor_parallel import apply_tp_to_block, apply_tp_to_root

__all__ = [
    "Env",
    "build_model",
    "check_ep_world",
    "check_expert_split",
    "check_world",
    "clip_gradients",
    "distributed",
    "failing_together",
    "fsdp_wrapper",
    "make_env",
    "set_threads",
    "thread_count",
]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Env:
    """Where this process sits: global rank and size, its device, the data-parallel mesh
    (``fully_shard``'s ``mesh``) and, with ``--tp`` above 1, the tensor-parallel one.

    ``dp_rank`` / ``dp_size`` pick this process's rows of every global batch: the TP ranks of
    one data-parallel index compute the same sequences, so they read the same rows.

    With ``--ep`` above 1, ``ep_mesh`` is the 2-D ``("dp_shard_mod_ep", "ep")`` mesh and
    ``mesh`` its flattening (``"dp_shard"``, every rank; with ``--dp-replicate`` the 3-D
    ``("dp_replicate", "dp_shard_mod_ep", "ep")`` mesh and the 2-D HSDP ``(dp_replicate,
    dp_shard)``): every rank is a data-parallel rank of
    the dense weights and reads its own rows (the EP ranks see different tokens), so
    ``dp_rank`` / ``dp_size`` are the rank and the world, as without EP."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    tp_mesh: DeviceMesh | None = None
    ep_mesh: DeviceMesh | None = None
    pp_mesh: DeviceMesh | None = None  # --pp above 1: the ranks of one stage's pipeline

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.mesh.size()

    @property
    def dp_rank(self) -> int:
        """This rank's index in the data-parallel mesh, row-major over its dims (replicate,
        shard): the rank itself without TP."""
        index = 0
        for size, coordinate in zip(self.mesh.shape, self.mesh.get_coordinate(), strict=True):
            index = index * size + coordinate
        return index

    def mesh_shape(self) -> dict[str, int]:
        """Every mesh dim by name (the data-parallel ones, then ``tp``; with EP the 2-D
        ``dp_shard_mod_ep`` x ``ep`` mesh), for the banner."""
        meshes = [self.mesh] if self.tp_mesh is None else [self.mesh, self.tp_mesh]
        if self.ep_mesh is not None:
            meshes = [self.ep_mesh]
        if self.pp_mesh is not None:
            meshes = [self.pp_mesh, self.mesh]
        return {
            name: size
            for mesh in meshes
            for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True)
        }


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch reads these at start-up


def thread_count(environ: Mapping[str, str], cores: int, load: float) -> tuple[int | None, str]:
    """Intra-op threads for one process of the recipe: (the count to set, or None to keep the
    one the user chose; why, for the start-up banner).

    Why: torch starts one OpenMP thread per core, and OpenMP's threads wait for each other at
    every parallel region. When other processes keep cores busy, a thread that is off its core
    stalls the rest: on a loaded 2-core machine a one-process run was 13-19x slower with torch's
    2 threads than with 1. torchrun sets ``OMP_NUM_THREADS=1`` for more than one process per
    node but leaves a single process alone, so the rule is the cores that are idle (the usable
    ``cores`` minus the 1-minute ``load`` average, rounded, at least 1) shared among this
    node's processes (``LOCAL_WORLD_SIZE``). ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` in
    ``environ`` wins: torch has already applied it.
    """
    for name in THREAD_VARIABLES:
        if environ.get(name):
            return None, f"{name}={environ[name]}"
    local = max(1, int(environ.get("LOCAL_WORLD_SIZE") or 1))
    idle = min(cores, max(1, round(cores - load)))
    why = f"OMP_NUM_THREADS unset: {idle} of {cores} cores idle (load {load:.1f})"
    return max(1, idle // local), f"{why} / {local} local process{'es' if local > 1 else ''}"


def set_threads(environ: Mapping[str, str] = os.environ) -> str:
    """Apply ``thread_count`` to this process; returns the banner's ``threads: N (why)``.

    Called where the recipe owns the process (``python -m recipes.llama.train``, torchrun's
    workers), not by ``train()``, so code that calls ``train()`` itself keeps the thread
    count it set with ``torch.set_num_threads``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    count, why = thread_count(environ, cores or 1, load)
    if count is not None:
        torch.set_num_threads(count)
    return f"threads: {torch.get_num_threads()} ({why})"


def _device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but torch sees no CUDA device")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _pin_gloo_to_loopback() -> None:
    """A rendezvous on 127.0.0.1 means one machine: keep gloo's sockets on loopback too
    (otherwise gloo binds the address the hostname resolves to)."""
    if os.environ.get("MASTER_ADDR", "127.0.0.1") in LOOPBACK:
        pin_gloo_to_loopback()


def make_env(
    device: torch.device,
    local_rank: int,
    replicate: int = 1,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
) -> Env:
    """This rank's ``Env`` in the default process group: a 1-D ``shard`` mesh, ``(replicate,
    shard)`` for HSDP; with ``tp`` above 1 torchtitan's ``(dp_shard, tp)`` or ``(dp_replicate,
    dp_shard, tp)`` mesh, ``tp`` last so that a TP group is neighbouring ranks; with ``ep``
    above 1 ``expert_parallel.ep_meshes``' ``(dp_shard_mod_ep, ep)`` mesh, the dense weights
    and the batch over both dims flattened (every rank), ``(dp_replicate, dp_shard_mod_ep,
    ep)`` with HSDP; with ``tp`` as well (EP x TP) a ``tp`` dim last, the dense weights' TP
    mesh, the experts on ``("ep", "tp")``."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if ep > 1:
        check_ep_world(ep, world_size, replicate=replicate, tp=tp)
        mesh, dp = ep_meshes(ep, device.type, world_size, replicate, tp)
        tp_mesh = mesh["tp"] if tp > 1 else None
        return Env(rank, world_size, local_rank, device, dp, tp_mesh, ep_mesh=mesh)
    if world_size % replicate:
        raise ConfigError(
            f"dp_replicate={replicate} must divide the number of processes ({world_size})"
        )
    check_world(tp, replicate, world_size)
    if pp > 1:  # (pp, [dp_replicate,] dp_shard): pp first, so a stage's dp ranks are neighbours
        return pipeline_env(device, local_rank, pp, replicate)
    shard = world_size // (replicate * tp)
    if tp > 1:
        dims = ("dp_replicate", "dp_shard", "tp") if replicate > 1 else ("dp_shard", "tp")
        shape = (replicate, shard, tp) if replicate > 1 else (shard, tp)
        full = init_device_mesh(device.type, shape, mesh_dim_names=dims)
        dp = full["dp_replicate", "dp_shard"] if replicate > 1 else full["dp_shard"]
        return Env(rank, world_size, local_rank, device, dp, full["tp"])
    if replicate == 1:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    else:
        shape = (replicate, shard)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return Env(rank, world_size, local_rank, device, mesh)


def pipeline_env(device: torch.device, local_rank: int, pp: int, replicate: int) -> Env:
    """``--pp``'s ``Env``: the mesh ``(pp, dp_shard)`` or ``(pp, dp_replicate, dp_shard)``;
    ``mesh`` is the data-parallel part (each stage is ``fully_shard``ed over it) and
    ``pp_mesh`` this rank's pipeline (one rank per stage)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    check_pp_world(pp, replicate, world_size)
    shard = world_size // (pp * replicate)
    dims = ("pp", "dp_replicate", "dp_shard") if replicate > 1 else ("pp", "dp_shard")
    shape = (pp, replicate, shard) if replicate > 1 else (pp, shard)
    full = init_device_mesh(device.type, shape, mesh_dim_names=dims)
    dp = full["dp_replicate", "dp_shard"] if replicate > 1 else full["dp_shard"]
    return Env(rank, world_size, local_rank, device, dp, pp_mesh=full["pp"])


def check_world(tp: int, replicate: int, world_size: int) -> None:
    """Refuse a ``--tp`` (with ``--dp-replicate``) that does not divide the processes, before
    the process group is touched."""
    if tp == 1 or world_size % (tp * replicate) == 0:
        return
    fits = [str(d) for d in range(1, world_size + 1) if world_size % (d * replicate) == 0]
    degrees = f"{', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else "".join(fits) or "1"
    with_replicas = f" x --dp-replicate {replicate}" if replicate > 1 else ""
    raise ConfigError(
        f"--tp {tp}{with_replicas} does not divide the {world_size} processes into "
        f"data-parallel groups: use --tp {degrees}, or launch a multiple of {tp * replicate} "
        "processes"
    )


def check_ep_world(
    ep: int, world_size: int, n_experts: int | None = None, replicate: int = 1, tp: int = 1
) -> None:
    """Refuse an ``--ep`` that does not divide the processes (the mesh is ``(processes / ep,
    ep)``, ``(dp_replicate, processes / (dp_replicate * ep), ep)`` with HSDP, a ``tp`` dim
    last with ``--tp``), before the process group is touched; the fix lists the degrees that
    divide the processes (and ``n_experts``, when given)."""
    if ep == 1 or world_size % (ep * replicate * tp) == 0:
        return
    if tp > 1 and world_size % tp == 0:
        raise ConfigError(
            f"--ep {ep} x --tp {tp} does not divide the {world_size} processes (the mesh is "
            f"(dp_shard_mod_ep, ep, tp)): launch a multiple of {ep * replicate * tp} "
            "processes, or lower --ep or --tp"
        )
    if replicate > 1 and world_size % ep == 0:
        raise ConfigError(
            f"--ep {ep} x --dp-replicate {replicate} does not divide the {world_size} processes "
            f"(the mesh is (dp_replicate, processes / (dp_replicate * ep), ep)): launch a "
            f"multiple of {ep * replicate} processes, or lower --dp-replicate or --ep"
        )
    fits = [
        str(d)
        for d in range(1, world_size + 1)
        if world_size % d == 0 and (n_experts is None or n_experts % d == 0)
    ]
    degrees = f"{', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else "".join(fits)
    raise ConfigError(
        f"--ep {ep} does not divide the {world_size} processes (the mesh is (processes / ep, "
        f"ep)): use --ep {degrees}, or launch a multiple of {ep} processes"
    )


def check_expert_split(cfg: Config, world_size: int) -> None:
    """Refuse ``--whole-experts`` where the sharding cannot keep experts whole: FSDP2 splits
    dim 0 of every parameter evenly over the shard group, which cuts through expert matrices
    unless the group's size divides the number of experts. raggedfsdp always can (at the cost of
    padding). Needs only the world size, so it runs before the process group is touched."""
    if not cfg.whole_experts or cfg.fsdp != "fsdp2" or not isinstance(cfg.model, MoEConfig):
        return
    shard = world_size // cfg.dp_replicate if world_size % cfg.dp_replicate == 0 else world_size
    experts = cfg.model.n_experts
    if experts % shard:
        raise ConfigError(
            f"--whole-experts with --fsdp fsdp2: FSDP2 splits the {experts} experts evenly over "
            f"{shard} ranks, cutting through expert matrices; use --fsdp raggedfsdp, a shard group "
            f"size dividing {experts}, or drop --whole-experts"
        )


@contextmanager
def distributed(cfg: Config, agreed: tuple[type[BaseException], ...] = ()) -> Iterator[Env]:
    """Join (or create) the default process group for the run, and leave what we created.

    ``agreed`` are errors that every rank raises at once (a refused run). On those and on a
    normal end the ranks leave the group together (a barrier before tearing it down): gloo
    aborts a rank whose peer closes its connections while it is still tearing down its own.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _device(cfg.device, local_rank)
    created = not dist.is_initialized()
    world = int(os.environ.get("WORLD_SIZE", 1)) if created else dist.get_world_size()
    check_expert_split(cfg, world)
    check_world(cfg.tp, cfg.dp_replicate, world)
    check_pp_world(cfg.pp, cfg.dp_replicate, world)
    if isinstance(cfg.model, MoEConfig):
        check_ep_world(cfg.ep, world, cfg.model.n_experts, cfg.dp_replicate, cfg.tp)
    if created:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ:  # torchrun
            if backend == "gloo":
                _pin_gloo_to_loopback()
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    together = True
    try:
        yield make_env(device, local_rank, cfg.dp_replicate, cfg.tp, cfg.ep, cfg.pp)
    except agreed:
        raise
    except BaseException:
        together = False  # a peer may be gone: waiting for it could hang
        raise
    finally:
        if created:
            if together and dist.get_world_size() > 1:
                dist.barrier()
            dist.destroy_process_group()


@contextmanager
def failing_together(*errors: type[Exception]) -> Iterator[None]:
    """Run the block on every rank; if it raises one of ``errors`` on any rank, raise it on all.

    A check that can fail on some ranks only (a data directory one node cannot read) would
    otherwise end those ranks while the others wait in the next collective until a timeout,
    and print the message once per failing rank. Here every rank raises the lowest failing
    rank's error, so the run ends at once and rank 0 alone can report it. Collective.
    """
    failure: Exception | None = None
    try:
        yield
    except errors as err:
        failure = err
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if failure is None else (type(failure), str(failure)))
    failed = [rank for rank, item in enumerate(found) if item is not None]
    if failed:
        kind, message = found[failed[0]]
        if len(failed) < len(found):
            message += f" (on {len(failed)} of {len(found)} ranks, the first rank {failed[0]})"
        raise kind(message) from failure


def _ragged_kwargs(cfg: Config, policy: ShardPolicy | None) -> dict[str, Any]:
    """raggedfsdp's ``fully_shard`` keywords but the mesh: mixed precision (and FP8
    all-gathers) and the optimizer's unit rule."""
    bf16 = cfg.mixed_precision == "bf16"
    fp8 = {"fp8": Float8Blocks(), "mxfp8": MXFP8Blocks()}.get(cfg.all_gather)
    dtypes = (torch.bfloat16, torch.float32) if bf16 else (None, None)
    mp = raggedfsdp.MixedPrecisionPolicy(*dtypes, all_gather=fp8)
    return {"mp_policy": mp, "shard_policy": policy}


def fsdp_wrapper(
    cfg: Config, mesh: DeviceMesh, policy: ShardPolicy | None
) -> Callable[[nn.Module], Any]:
    """``fully_shard`` of raggedfsdp or FSDP2 with the run's mesh and mixed precision.

    ``policy`` is the optimizer's unit rule (8-bit blocks, whole Muon matrices); it applies to
    raggedfsdp only, since FSDP2 always cuts even rows.
    """
    bf16 = cfg.mixed_precision == "bf16"
    if cfg.fsdp == "raggedfsdp":
        return partial(raggedfsdp.fully_shard, mesh=mesh, **_ragged_kwargs(cfg, policy))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp2 = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    return partial(fully_shard, mesh=mesh, mp_policy=mp2)


def _shard_ep_block(cfg: Config, env: Env, policy: ShardPolicy | None, block: nn.Module) -> None:
    """``--ep``'s wrapping of a MoE block, with the keywords ``fsdp_wrapper`` gives the run's
    FSDP: raggedfsdp's ``shard_ep_block`` or FSDP2's ``shard_ep_block_fsdp2`` (torchtitan's)."""
    kwargs = {k: v for k, v in fsdp_wrapper(cfg, env.mesh, policy).keywords.items() if k != "mesh"}
    shard = shard_ep_block if cfg.fsdp == "raggedfsdp" else shard_ep_block_fsdp2
    shard(block, env.ep_mesh, env.mesh, **kwargs)


def build_model(cfg: Config, env: Env, policy: ShardPolicy | None) -> Transformer:
    """The sharded model, wrapped as torchtitan's ``apply_fsdp`` does.

    Built on the meta device, then each block is allocated, initialised and wrapped in turn (one
    communication group per block), so no process ever holds more than one unsharded block
    beyond its shards and a 70B model starts like a tiny one. Then the embedding alone (freed
    after forward and not gathered again for backward, which does not read it) and the final
    norm with the output projection as one group kept unsharded after forward (backward needs
    them first), so the root does not hold them, nor the output's gradient, through the whole
    backward; tied embeddings stay in the root's group. With ``--tp`` each block gets the TP
    plan once its weights exist (whole, from the seed), before it is wrapped, so both FSDPs
    shard this rank's TP blocks over ``env.mesh`` as torchtitan does. With ``--ep`` each MoE
    block's experts become ``Shard(0)`` DTensors over ``ep`` once they exist (every rank keeps
    its ``E / ep``: ``distribute_experts``), and ``shard_ep_block`` wraps the experts over
    ``dp_shard_mod_ep`` and the rest of the block over every rank.

    Wrapped alone, those parameters are named ``weight`` (``0.weight``, ``1.weight``), so a
    name-based policy such as Muon's cannot tell them from hidden matrices; its default "auto"
    mode still leaves them in element units, since a whole-matrix unit would add padding."""
    with torch.device("meta"):
        model = model_class(cfg.model)(cfg.model, cfg.seq_len, cfg.activation_checkpointing)
    wrap = fsdp_wrapper(cfg, env.mesh, policy)
    for index, block in enumerate(model.layers):
        model.materialize_block(index, env.device, cfg.seed)
        if env.tp_mesh is not None:  # whole weights in, this rank's TP blocks out
            apply_tp_to_block(block, env.tp_mesh)
        moe_ep = env.ep_mesh is not None and any(_is_moe(m) for m in block.modules())
        if moe_ep:  # whole experts in, this rank's E / ep experts out (EP x TP: on ep, tp)
            distribute_experts(block, env.ep_mesh["ep", "tp"] if env.tp_mesh else env.ep_mesh["ep"])
        if cfg.compile:  # blocks of one shape share one graph; FSDP's hooks stay outside it
            block.compile()
        if moe_ep:
            _shard_ep_block(cfg, env, policy, block)
        else:
            wrap(block)
    model.materialize_root(env.device, cfg.seed)
    if env.tp_mesh is not None:
        apply_tp_to_root(model, env.tp_mesh, cfg.loss_parallel)
    if not cfg.model.tie_embeddings:
        # an embedding's backward needs the token ids, not its weight: no all-gather for it
        wrap(model.tok_embeddings).set_unshard_in_backward(False)
        wrap([model.norm, model.output], reshard_after_forward=False)
    wrap(model)
    return model


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors on rank 0 (``{}`` on the others), for an
    unsharded model or another framework. raggedfsdp's ``state_dict`` is torch's with
    RaggedTensors gathered too, so it serves ``--fsdp fsdp2``'s DTensors as well."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def clip_gradients(model: nn.Module, cfg: Config) -> float:
    """Clip to ``cfg.grad_clip`` (0: measure only) and return the global norm before it."""
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    if cfg.fsdp == "raggedfsdp":
        return raggedfsdp.clip_grad_norm_(model.parameters(), max_norm).item()
    if cfg.ep > 1:  # the experts' gradients live on another mesh than the dense ones
        return fsdp2_clip_grad_norm_(model.parameters(), max_norm).item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item()
