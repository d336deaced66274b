"""The optimizer step pre-hook that guards sharded parameters is installed by the first
``fully_shard``, not by importing raggedfsdp: torch runs global pre-hooks before every optimizer's
step in the process, so merely importing the package must leave torch's optimizers alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch.optim.optimizer import _global_optimizer_pre_hooks as hooks

    import raggedfsdp
    import raggedfsdp.checkpoint
    import raggedfsdp.fsdp
    import raggedfsdp.optim
    import raggedfsdp.state_dict

    assert len(hooks) == 0, f"import registered {len(hooks)} optimizer step pre-hook(s)"
    first = raggedfsdp.fsdp.fully_shard(torch.nn.Linear(4, 4))
    assert len(hooks) == 1, f"after the first fully_shard: {len(hooks)} hooks"
    second = raggedfsdp.fsdp.fully_shard(torch.nn.Linear(4, 4))
    assert len(hooks) == 1, f"after the second fully_shard: {len(hooks)} hooks"

    # the guard lets ordinary steps through, ours and plain torch's
    for model, opt in (
        (first, raggedfsdp.optim.AdamW(first.parameters())),
        (second, torch.optim.SGD(second.parameters(), lr=0.1)),
    ):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    print("ok")
    """
)


def test_fully_shard_installs_the_step_guard_once_and_import_does_not() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
