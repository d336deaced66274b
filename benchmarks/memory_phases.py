"""Where a training step's memory peaks: resident memory at every phase of one step of
raggedfsdp.fully_shard or FSDP2 on the fsdp_vs_fsdp2 model (CPU, gloo).

    python benchmarks/memory_phases.py {ours,fsdp2} [--wrap torchtitan] [--mixed-precision]
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
import os
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from fsdp_vs_fsdp2 import MALLOC_ENV, add_model_arguments, build, free_port, status_kib


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    # the embedding's input needs no gradient: its backward hooks fire on outputs, as intended
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.set_num_threads(max(1, os.cpu_count() // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model, opt = build(args.system, args)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    rows: list[tuple[str, float, float]] = []
    base = [0]

    def mark(label: str) -> None:
        rss, hwm = status_kib("VmRSS"), status_kib("VmHWM")
        rows.append((label, (rss - base[0]) / 1024, (hwm - base[0]) / 1024))
        _reset_peak()

    parts = [("embed", model.embed), *((f"layers.{i}", b) for i, b in enumerate(model.layers))]
    for name, module in [*parts, ("norm", model.norm), ("head", model.head)]:
        module.register_forward_pre_hook(lambda *_, n=name: mark(f"forward {n} start"))
        module.register_forward_hook(lambda *_, n=name: mark(f"forward {n} end"))
        module.register_full_backward_pre_hook(lambda *_, n=name: mark(f"backward {n} start"))
        module.register_full_backward_hook(lambda *_, n=name: mark(f"backward {n} end"))

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        mark("loss")
        loss.backward()
        mark("backward done")
        opt.step()
        mark("optimizer step")
        opt.zero_grad()
        mark("zero_grad")

    for _ in range(3):  # warm-up: optimizer state, allocator, gloo connections
        step()
    rows.clear()
    _reset_peak()
    base[0] = status_kib("VmRSS")
    step()
    if rank == 0:
        summit = max(peak for _, _, peak in rows)
        print(f"{args.system}, W={world}: resident MiB above the post-warm-up level")
        print(f"{'phase':28s} {'now':>8s} {'peak since previous row':>24s}")
        for label, now, peak in rows:
            print(f"{label:28s} {now:8.1f} {peak:24.1f}{'  <==' if peak == summit else ''}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=("ours", "fsdp2"))
    add_model_arguments(parser)
    args = parser.parse_args()
    os.environ.update(MALLOC_ENV)  # read by glibc when each rank starts
    mp.start_processes(
        _worker,
        args=(args.world_size, free_port(), args),
        nprocs=args.world_size,
        start_method="spawn",
    )


if __name__ == "__main__":
    main()
