"""One rank of a fault-injection run (tests/comm/test_faults.py): trains a tiny sharded model; on
``--kill-rank`` dies by SIGKILL at the ``--at``-th call of ``--collective`` (a function name in
raggedfsdp.fsdp.param_group, or in raggedfsdp.optim.owner_compute with ``--optimizer muon``).

    python -m tests.support.fault_worker --rank R --world W --port P --kill-rank K \
        --collective C --at N [--optimizer adamw|muon]
"""

from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from raggedfsdp.comm.launch import pin_gloo_to_loopback


def _die_at(module, name: str, at: int) -> None:
    original = getattr(module, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def save_checkpoint(model, opt, path: str) -> None:
    """Model and optimizer, written to a temporary name and renamed once complete, so a crash
    mid-save never leaves a directory that looks valid."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path + ".tmp")
    dist.barrier()
    if dist.get_rank() == 0:
        os.rename(path + ".tmp", path)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--rank", "--world", "--port", "--kill-rank", "--at"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--collective", required=True)
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--checkpoint", default="", help="save model + optimizer after step 1")
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pin_gloo_to_loopback()
    store = dist.TCPStore("127.0.0.1", args.port, args.world, args.rank == 0)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )
    import raggedfsdp.fsdp.param_group as param_group
    import raggedfsdp.optim.owner_compute as owner_compute
    from raggedfsdp import fully_shard
    from raggedfsdp.optim import Muon, split_muon_params
    from tests.support.tiny_models import batch, loss_fn, make_model

    if args.rank == args.kill_rank:
        module = owner_compute if args.optimizer == "muon" else param_group
        _die_at(module, args.collective, args.at)
    model = make_model()
    for layer in model.layers:
        fully_shard(layer)  # element units: Muon's matrices are cut, so pieces must travel
    fully_shard(model)
    if args.optimizer == "muon":
        opt = Muon(split_muon_params(model), lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        loss_fn(model, *batch(step, 2)).backward()
        opt.step()
        opt.zero_grad()
        if step == 0 and args.checkpoint:
            save_checkpoint(model, opt, args.checkpoint)
    print("finished without error", flush=True)


if __name__ == "__main__":
    main()
