"""raggedfsdp.fully_shard vs PyTorch FSDP2, side by side in one process run (CPU, gloo).

Both wrap the same LLaMA-style model (same init, same data, same torch.optim.AdamW) per block
and at the root. Measured alternately (A B A B ...) in every rank, reported as ratios of
medians (ours / FSDP2, lower is better):

* unshard + reshard of one block (the all-gather path: FSDP2 copies shards in and the
  gathered result out; ours gathers in place into the parameters' storage);
* a full training step (forward, backward, optimizer step);
* peak resident memory above the post-warm-up level during a step (unsharded parameters,
  gradient buffers, copies, activations), measured with glibc returning freed memory to the OS
  (MALLOC_* variables set before the ranks start, VmHWM reset per step: ``measure.py``);
* peak allocated tensor bytes above the step's start, from the profiler's allocator events in
  one extra step: the view a GPU's caching allocator has (a buffer counts in full once
  allocated, where the kernel makes a CPU buffer resident page by page as it is written);
* what no FSDP can go below. The *floor*: both peaks of the same forward and backward on the
  rank's batch by the unsharded model (same compute dtype and checkpointing) whose parameters
  and gradients are all allocated beforehand (gradients accumulate in place): activations and
  autograd's temporaries only, which every FSDP holds on top of its own buffers. The *bound*:
  the floor's resident peak between every two forward/backward boundaries of its modules plus
  the bytes of the group an FSDP wrapped as ``--wrap`` says must have gathered there (the one
  holding the weights the module computes with; the embedding's backward reads none, so in
  backward a group's embedding is not counted), the highest of these. bound / FSDP2 is the
  lowest peak ratio any FSDP can reach with that wrapping, one that gathers each group only
  while its modules compute (FSDP2 keeps the root from forward through the loss's backward,
  and prefetches the next group during the current one's backward).

    python benchmarks/fsdp_vs_fsdp2.py [--world-size 2] [--dim 512] [--layers 4] [--steps 8]
        [--activation-checkpointing] [--mixed-precision] [--wrap {blocks,torchtitan}]

``--mixed-precision`` is the standard LLM setting (the veScale-FSDP paper's evaluation and
torchtitan's default): fp32 sharded master weights, bf16 all-gather and compute, fp32 gradient
reduction, the same ``MixedPrecisionPolicy`` for both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from measure import init_gloo, peak_above_now, peak_allocated, reset_peak, spawn_ranks, status_kib
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.norm1(x)).view(b, t, 3, self.heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(
            *(z.transpose(1, 2) for z in (q, k, v)), is_causal=True
        )
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, d))
        gate, up = self.w13(self.norm2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, 3 * dim, max(1, dim // 64)) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class PhaseRecorder:
    """Resident memory at every forward/backward boundary of a ``Model``'s embedding, blocks,
    final norm and head, and wherever ``mark`` is called: rows of (label, MiB now, MiB peak
    since the previous row), above the level at ``start()`` (VmHWM reset at every row)."""

    def __init__(self, model: Model) -> None:
        # the embedding's input needs no gradient: its backward hooks fire on outputs, as meant
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.rows: list[tuple[str, float, float]] = []
        self._base = 0
        for name, module in model_parts(model).items():
            module.register_forward_pre_hook(lambda *_, n=name: self.mark(f"forward {n} start"))
            module.register_forward_hook(lambda *_, n=name: self.mark(f"forward {n} end"))
            module.register_full_backward_pre_hook(
                lambda *_, n=name: self.mark(f"backward {n} start")
            )
            module.register_full_backward_hook(lambda *_, n=name: self.mark(f"backward {n} end"))

    def start(self) -> None:
        self.rows.clear()
        reset_peak()
        self._base = status_kib("VmRSS")

    def mark(self, label: str) -> None:
        rss, hwm = status_kib("VmRSS"), status_kib("VmHWM")
        self.rows.append((label, (rss - self._base) / 1024, (hwm - self._base) / 1024))
        reset_peak()

    def bound(self, needs: dict[str, int]) -> float:
        """The highest peak with ``needs[label]`` bytes added to the interval ending at
        ``label``."""
        return max(peak + needs.get(label, 0) / 2**20 for label, _, peak in self.rows)


def model_parts(model: Model) -> dict[str, nn.Module]:
    """The modules the phase rows are named after, in forward order."""
    blocks = {f"layers.{i}": block for i, block in enumerate(model.layers)}
    return {"embed": model.embed, **blocks, "norm": model.norm, "head": model.head}


def gathered_bytes(model: Model, args: argparse.Namespace) -> dict[str, int]:
    """What an FSDP wrapped as ``args.wrap`` must have gathered while each module computes:
    the bytes (compute dtype) of the group holding its weights, keyed by the ``PhaseRecorder``
    label that ends that interval. The embedding's backward reads no weight, so in backward a
    group's embedding need not be gathered with the rest (fully_shard plans it apart)."""
    parts = model_parts(model)
    blocks = [[name] for name in parts if name.startswith("layers.")]
    if args.wrap == "torchtitan":
        groups = [["embed"], *blocks, ["norm", "head"]]
    else:
        groups = [["embed", "norm", "head"], *blocks]
    size = 2 if args.mixed_precision else 4

    def nbytes(names: list[str]) -> int:
        return size * sum(p.numel() for name in names for p in parts[name].parameters())

    needs = {}
    for names in groups:
        read_in_backward = [name for name in names if name != "embed"]
        for name in names:
            needs[f"forward {name} end"] = nbytes(names)
            if name != "embed":
                needs[f"backward {name} end"] = nbytes(read_in_backward)
    return needs


def _model(args: argparse.Namespace) -> Model:
    """The benchmark model, seeded, its blocks wrapped for activation checkpointing if asked."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = Model(args.vocab, args.dim, args.layers)
    if args.activation_checkpointing:  # torchtitan style: shard the checkpoint wrapper
        model.layers = nn.ModuleList(checkpoint_wrapper(layer) for layer in model.layers)
    return model


def build_floor(args: argparse.Namespace) -> Model:
    """The no-FSDP floor's model: unsharded, in the compute dtype, every gradient allocated."""
    model = _model(args).to(torch.bfloat16 if args.mixed_precision else torch.float32)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def build(system: str, args: argparse.Namespace) -> tuple[Model, torch.optim.Optimizer]:
    """The benchmark model wrapped by ``system`` ("ours" or "fsdp2") as ``args`` say, with its
    optimizer; every rank and both systems start from the same weights."""
    from torch.distributed.device_mesh import init_device_mesh

    if system == "ours":
        from raggedfsdp import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kwargs = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
    if args.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    model = _model(args)
    if args.wrap == "torchtitan":  # the embedding alone; norm + output kept for backward
        fully_shard(model.embed, **kwargs)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    if args.wrap == "torchtitan":
        fully_shard([model.norm, model.head], **kwargs, reshard_after_forward=False)
    fully_shard(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, data and wrapping flags (shared with ``memory_phases.py``)."""
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 reduce")
    parser.add_argument(
        "--wrap",
        choices=("blocks", "torchtitan"),
        default="blocks",
        help="blocks: each block, then the root; torchtitan: its apply_fsdp (embedding, blocks, "
        "[norm, output] kept unsharded after forward, root)",
    )


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port)
    models = {name: build(name, args) for name in ("ours", "fsdp2")}
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)

    floor = build_floor(args)
    phases = PhaseRecorder(floor)

    def floor_peaks() -> tuple[float, float]:
        phases.start()
        forward_backward(floor)
        phases.mark("backward done")
        return max(peak for _, _, peak in phases.rows), phases.bound(gathered_bytes(floor, args))

    def forward_backward(model: nn.Module) -> float:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.item()

    def step(name: str) -> float:
        model, opt = models[name]
        loss = forward_backward(model)
        opt.step()
        opt.zero_grad()
        return loss

    def unshard_reshard(name: str) -> None:
        block = models[name][0].layers[0]
        block.unshard()
        block.reshard()

    for name in models:  # warm-up: optimizer state, allocator, gloo connections
        step(name)
        step(name)
    times: dict[str, dict[str, list[float]]] = {
        n: {"step": [], "gather": [], "mem": []} for n in models
    }
    losses = {}
    for _ in range(args.steps):
        for name in models:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.gather_repeats):
                unshard_reshard(name)
            times[name]["gather"].append((time.perf_counter() - t0) / args.gather_repeats)
            dist.barrier()
            t0 = time.perf_counter()
            times[name]["mem"].append(peak_above_now(lambda n=name: losses.__setitem__(n, step(n))))
            times[name]["step"].append(time.perf_counter() - t0)
    allocated = {name: peak_allocated(lambda n=name: step(n)) for name in models}
    forward_backward(floor)  # warm-up
    runs = [floor_peaks() for _ in range(3)]
    floor_mem, bound = (statistics.median(run[i] for run in runs) for i in (0, 1))
    floor_allocated = peak_allocated(lambda: forward_backward(floor))
    if rank == 0:
        out.put(
            {
                n: {k: statistics.median(v) for k, v in d.items()}
                | {"loss": losses[n], "allocated": allocated[n]}
                for n, d in times.items()
            }
            | {"floor": {"mem": floor_mem, "allocated": floor_allocated, "bound": bound}}
        )
    dist.barrier()  # leave together: gloo may abort a rank that tears down while a peer runs
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--gather-repeats", type=int, default=5)
    args = parser.parse_args()
    res = spawn_ranks(_worker, args, args.world_size)
    ours, peer, floor = res["ours"], res["fsdp2"], res["floor"]
    ratios = {
        "unshard_reshard": ours["gather"] / peer["gather"],
        "step": ours["step"] / peer["step"],
        "peak_memory": ours["mem"] / peer["mem"],
        "peak_allocated": ours["allocated"] / peer["allocated"],
        "floor_peak_memory": floor["mem"] / peer["mem"],
        "floor_peak_allocated": floor["allocated"] / peer["allocated"],
        "bound_peak_memory": floor["bound"] / peer["mem"],
    }
    params = sum(p.numel() for p in Model(args.vocab, args.dim, args.layers).parameters())
    print(
        json.dumps(
            {
                "benchmark": "fsdp_vs_fsdp2",
                "args": vars(args),
                "params": params,
                "ours": ours,
                "fsdp2": peer,
                "floor": floor,
                "ratio": ratios,
            }
        )
    )
    ac = ", activation checkpointing" if args.activation_checkpointing else ""
    ac += ", bf16 compute / fp32 reduce" if args.mixed_precision else ", fp32"
    ac += f", {args.wrap} wrapping"
    print(
        f"\nW={args.world_size}, {params / 1e6:.1f}M parameters{ac}, medians of {args.steps} rounds"
    )
    print(f"{'':28s}{'raggedfsdp':>12s}{'FSDP2':>12s}{'ratio':>8s}")
    rows = [
        ("unshard+reshard (ms)", "gather", 1e3),
        ("training step (ms)", "step", 1e3),
        ("peak above resident (MiB)", "mem", 1.0),
        ("peak allocated (MiB)", "allocated", 1.0),
    ]
    for label, key, scale in rows:
        print(
            f"{label:28s}{ours[key] * scale:12.2f}{peer[key] * scale:12.2f}"
            f"{ours[key] / peer[key]:8.2f}"
        )
    print("what no FSDP goes below (ratio: to FSDP2's peak), and each one's memory above it:")
    lowest = [
        ("bound, this wrapping (MiB)", floor["bound"], peer["mem"]),
        ("floor, resident (MiB)", floor["mem"], peer["mem"]),
        ("floor, allocated (MiB)", floor["allocated"], peer["allocated"]),
    ]
    for label, value, reference in lowest:
        print(f"{label:28s}{value:12.2f}{'':12s}{value / reference:8.2f}")
    for label, key in (("above floor, resident", "mem"), ("above floor, allocated", "allocated")):
        mine, theirs = ours[key] - floor[key], peer[key] - floor[key]
        print(f"{label:28s}{mine:12.2f}{theirs:12.2f}{mine / max(theirs, 1e-9):8.2f}")
    print(f"final loss: raggedfsdp {ours['loss']:.6f}, FSDP2 {peer['loss']:.6f}")


if __name__ == "__main__":
    main()
