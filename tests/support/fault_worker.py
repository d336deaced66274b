"""One rank of a fault-injection run (tests/comm/test_faults.py): trains a tiny sharded model; on
``--kill-rank`` dies by SIGKILL at the ``--at``-th call of ``--collective`` (a function name in
raggedfsdp.fsdp.param_group, or in raggedfsdp.optim.owner_compute with ``--optimizer muon``).

    python -m tests.support.fault_worker --rank R --world W --port P --kill-rank K \
        --collective C --at N [--optimizer adamw|muon] [--checkpoint PATH]

The victim prints ``killed at <time>`` just before it dies and the others ``failed at <time>``
when their error reaches the top, so the test can tell a failure detected from the lost peer
from one that waited for the collective timeout. With ``--checkpoint`` the model and optimizer
are saved after step 1 (DCP, at ``PATH``) together with their full state (``PATH.full.pt``),
which the resumed values are compared with.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
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
            print(f"fault_worker: killed at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def save_checkpoint(model, opt, path: str) -> None:
    """Model and optimizer, written to a temporary name and renamed once complete, so a crash
    mid-save never leaves a directory that looks valid; beside it their full state, the values
    a resume must find."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path + ".tmp")
    full = full_state(model, opt)  # every rank takes part in the gathers; rank 0 keeps them
    if dist.get_rank() == 0:
        torch.save(full, path + ".full.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        os.rename(path + ".tmp", path)
    dist.barrier()


def full_state(model, opt) -> dict:
    """The model's and optimizer's state, every tensor gathered whole, on rank 0 (on the CPU)."""
    from raggedfsdp.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    return {"model": model_sd, "optim": optim_sd}


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--rank", "--world", "--port", "--kill-rank", "--at"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--collective", required=True)
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--checkpoint", default="", help="save model + optimizer after step 1")
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout (s)")
    args = parser.parse_args()
    try:
        _train(args)
    except Exception:
        print(f"fault_worker: failed at {time.time()}", flush=True)
        raise
    print("finished without error", flush=True)


def _train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    pin_gloo_to_loopback()
    # The store is the test's (serving_store): it outlives the rank the test kills.
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False)
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


if __name__ == "__main__":
    main()
