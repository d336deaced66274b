"""Where a training step's memory peaks: resident memory at every phase of one step of
raggedfsdp.fully_shard or FSDP2 on the fsdp_vs_fsdp2 model (CPU, gloo), or of the no-FSDP
floor (``floor``: forward and backward of the unsharded model with its gradients allocated,
what every FSDP holds on top of its own buffers; see fsdp_vs_fsdp2.py).

    python benchmarks/memory_phases.py {ours,fsdp2,floor} [--wrap torchtitan] [--mixed-precision]
        [--activation-checkpointing] [--world-size 2] [--dim 512] ...

One row per hook of the step (forward pre/post and backward pre/post of the embedding, each
block, the final norm and the head; then the loss, the end of backward, the optimizer step and
``zero_grad``): the resident memory above the post-warm-up level at that moment, and the highest
level since the previous row (VmHWM, reset at every row; glibc set up as in fsdp_vs_fsdp2.py so
that freed tensors leave the resident set). ``<==`` marks the step's summit. The memory
analysis in BENCHMARKS.md reads these tables: which phase peaks, and what is alive there.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_vs_fsdp2 import (
    PhaseRecorder,
    add_model_arguments,
    build,
    build_floor,
    gathered_bytes,
)
from measure import init_gloo, start_ranks

from raggedfsdp.comm.launch import serving_store


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    init_gloo(rank, world, port)
    if args.system == "floor":  # no FSDP, no optimizer: what every FSDP holds on top of its own
        model, opt = build_floor(args), None
    else:
        model, opt = build(args.system, args)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    phases = PhaseRecorder(model)

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        phases.mark("loss")
        loss.backward()
        phases.mark("backward done")
        if opt is not None:
            opt.step()
            phases.mark("optimizer step")
            opt.zero_grad()
            phases.mark("zero_grad")

    for _ in range(3):  # warm-up: optimizer state, allocator, gloo connections
        step()
    phases.start()
    step()
    if rank == 0:
        summit = max(peak for _, _, peak in phases.rows)
        print(f"{args.system}, W={world}: resident MiB above the post-warm-up level")
        print(f"{'phase':28s} {'now':>8s} {'peak since previous row':>24s}")
        for label, now, peak in phases.rows:
            print(f"{label:28s} {now:8.1f} {peak:24.1f}{'  <==' if peak == summit else ''}")
        if args.system == "floor":
            bound = phases.bound(gathered_bytes(model, args))
            print(f"bound for {args.wrap} wrapping (each row + the group it needs): {bound:.1f}")
    dist.barrier()  # leave together: gloo may abort a rank that tears down while a peer runs
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=("ours", "fsdp2", "floor"))
    add_model_arguments(parser)
    args = parser.parse_args()
    with serving_store() as port:
        start_ranks(_worker, (args.world_size, port, args), args.world_size)


if __name__ == "__main__":
    main()
