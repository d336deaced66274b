"""Block-wise FP8 all-gather vs PyTorch FSDP2's bf16 all-gather, side by side (CPU, gloo).

Four systems wrap the same LLaMA-style model (``fsdp_vs_fsdp2.Model``: same init, same data,
same ``torch.optim.AdamW``) per block and at the root, all with fp32 master weights, bf16
compute and fp32 gradient reduction:

* ``fp8``: ``raggedfsdp.fully_shard`` with ``MixedPrecisionPolicy(all_gather=Float8Blocks(128))``;
* ``mxfp8``: the same with ``MXFP8Blocks()`` (1x32 blocks, e8m0 scales, whole-row units);
* ``bf16``: ``raggedfsdp.fully_shard`` gathering bf16 (the same policy without ``all_gather``);
* ``fsdp2``: PyTorch's ``fully_shard`` (bf16 all-gather).

Reported per rank: the bytes of every all-gather of one training step (the gathered buffers,
``CollectiveBytes``) and the ratio fp8 / FSDP2 (the goal is <= 0.55); the step time, measured
alternately (fp8 mxfp8 bf16 fsdp2 fp8 ...), as ratios of medians (FP8 costs a quantization of the
rank's tiles and a dequantization of the whole group per gather, on the CPU); and the losses
of the last step (the FP8 run trains on quantized weights, so it differs a little).

    python benchmarks/fp8_all_gather.py [--world-size 2] [--dim 256] [--layers 2] [--steps 6]
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
from fsdp_vs_fsdp2 import Model
from measure import CollectiveBytes, init_gloo, spawn_ranks

SYSTEMS = ("fp8", "mxfp8", "bf16", "fsdp2")


def build(system: str, args: argparse.Namespace) -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model(args.vocab, args.dim, args.layers)
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    else:
        from raggedfsdp import MixedPrecisionPolicy, fully_shard
        from raggedfsdp.fsdp import Float8Blocks, MXFP8Blocks

        fp8 = {"fp8": Float8Blocks(128), "mxfp8": MXFP8Blocks()}.get(system)
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, all_gather=fp8)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    init_gloo(rank, world, port)
    warnings.filterwarnings("ignore")
    systems = {name: build(name, args) for name in SYSTEMS}
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)

    def step(name: str) -> tuple[float, float]:
        model, opt = systems[name]
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start, loss.item()

    gathered, times, losses = {}, {name: [] for name in SYSTEMS}, {}
    for name in SYSTEMS:  # warm-up step, counted
        with CollectiveBytes().counting() as counter:
            step(name)
        gathered[name] = counter.bytes["all_gather"]
    for _ in range(args.steps):
        for name in SYSTEMS:
            elapsed, losses[name] = step(name)
            times[name].append(elapsed)
    if rank == 0:
        median = {name: statistics.median(t) for name, t in times.items()}
        out.put(
            {
                "world_size": world,
                "all_gather_bytes_per_step": gathered,
                "all_gather_ratio_fp8_vs_fsdp2": gathered["fp8"] / gathered["fsdp2"],
                "all_gather_ratio_fp8_vs_bf16": gathered["fp8"] / gathered["bf16"],
                "step_s_median": median,
                "step_ratio_fp8_vs_fsdp2": median["fp8"] / median["fsdp2"],
                "step_ratio_fp8_vs_bf16": median["fp8"] / median["bf16"],
                "all_gather_ratio_mxfp8_vs_fsdp2": gathered["mxfp8"] / gathered["fsdp2"],
                "step_ratio_mxfp8_vs_fsdp2": median["mxfp8"] / median["fsdp2"],
                "step_ratio_mxfp8_vs_fp8": median["mxfp8"] / median["fp8"],
                "last_loss": losses,
            }
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(json.dumps(spawn_ranks(_worker, args, args.world_size)))


if __name__ == "__main__":
    main()
