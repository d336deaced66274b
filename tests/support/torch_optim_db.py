"""Run torch's own optimizer conformance cases (``optim_db``) against our ``AdamW`` and ``Muon``.

``torch.testing._internal.common_optimizers`` holds, per optimizer, the inputs torch's
optimizer tests use: *error* cases (arguments the constructor or the first ``step()`` must refuse,
with the exception type and message torch's tests assert) and *behaviour* cases (the
hyper-parameter configurations every behaviour test runs). Importing it changes process-wide
state (it freezes ``torch.backends`` flags and patches TorchScript calls), so the test suite
runs this module in a subprocess: ``python -m tests.support.torch_optim_db OUT.json`` writes one
record per case and the tests read them.

An error case matches when ours passes the assertion torch's own ``test_errors`` makes of
torch's optimizer: the same exception (or warning) type, a message matching torch's pattern,
raised at the same point (construction or step); ``*_type_and_message`` records the type and
message alone, so a deliberate difference of timing can be told from a different error. A
behaviour case matches when, for every implementation (for-loop, foreach, fused for AdamW) and
dtype (fp32, fp64), three steps on the same parameters and gradients leave the parameters and
the state bitwise equal to torch's, or both optimizers refuse the configuration with the same
exception type and the same message (``refused``: torch refuses some configurations on CPU,
e.g. ``capturable=True``, so those runs compare refusals, not training).
"""

from __future__ import annotations

import copy
import json
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from raggedfsdp.optim import AdamW, Muon

OURS: dict[str, type[Optimizer]] = {"AdamW": AdamW, "Muon": Muon}
IMPLS: dict[str, list[dict[str, bool]]] = {
    "AdamW": [{"foreach": False}, {"foreach": True}, {"fused": True}],
    "Muon": [{}],
}
DTYPES = (torch.float32, torch.float64)
SHAPES = ((5, 3), (4, 6))  # one tall and one wide matrix: Muon transposes one of them
STEPS = 3


def _outcome(run: Callable[[], Any]) -> tuple[str, BaseException | Warning | None]:
    """What ``run`` did: raised, warned, or neither (first warning only)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run()
        except Exception as e:  # the case under test decides what is expected
            return f"{type(e).__name__}: {e}", e
    if caught:
        w = caught[0]
        return f"warning {w.category.__name__}: {w.message}", w.message
    return "no error", None


def _error_case(info: Any, case: Any) -> dict[str, Any]:
    from torch.testing._internal.common_optimizers import OptimizerErrorEnum

    inp = case.optimizer_error_input
    on_step = case.error_on == OptimizerErrorEnum.STEP_ERROR
    record: dict[str, Any] = {"desc": inp.desc, "expected": case.error_type.__name__}
    for side, cls in (("torch", info.optim_cls), ("ours", OURS[info.name])):

        def run(cls: type[Optimizer] = cls, side: str = side) -> None:
            params, kwargs = copy.deepcopy((inp.params, inp.kwargs))
            opt = cls(params, **kwargs)
            if on_step:
                record[f"{side}_built"] = True  # construction must succeed first
                opt.step()

        text, raised = _outcome(run)
        same = isinstance(raised, case.error_type) and re.search(case.error_regex, str(raised))
        record[side] = text
        record[f"{side}_type_and_message"] = bool(same)
        record[f"{side}_passes"] = bool(same) and (record.get(f"{side}_built") or not on_step)
    record["match"] = record["ours_passes"]
    return record


def _train(cls: type[Optimizer], kwargs: dict[str, Any], dtype: torch.dtype) -> Any:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in SHAPES]
    opt = cls(params, **copy.deepcopy(kwargs))
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
        opt.step()
    return params, opt.state_dict()["state"]


def _same(theirs: Any, ours: Any) -> bool:
    """Parameters and every state tensor torch keeps, bitwise (ours may keep more keys)."""
    (tp, ts), (op, os_) = theirs, ours
    if not all(torch.equal(a, b) for a, b in zip(tp, op, strict=True)):
        return False
    return all(
        torch.equal(torch.as_tensor(value), torch.as_tensor(os_[i][key]))
        for i, state in ts.items()
        for key, value in state.items()
    )


def _behaviour_case(info: Any, case: Any) -> dict[str, Any]:
    record: dict[str, Any] = {"desc": case.desc, "runs": []}
    for impl in IMPLS[info.name]:
        for dtype in DTYPES:
            kwargs = case.kwargs | impl
            results = []
            for cls in (info.optim_cls, OURS[info.name]):
                try:
                    results.append(_train(cls, kwargs, dtype))
                except Exception as e:  # torch refuses some configurations on CPU
                    results.append(e)
            theirs, ours = results
            refused = isinstance(theirs, Exception) or isinstance(ours, Exception)
            if refused:
                match = type(theirs) is type(ours) and str(theirs) == str(ours)
                what = f"torch: {theirs!r}; ours: {ours!r}"
            else:
                match = _same(theirs, ours)
                what = "bitwise" if match else "different results"
            run = {"config": f"{impl} {dtype}", "match": match, "refused": refused, "what": what}
            record["runs"].append(run)
    record["match"] = all(run["match"] for run in record["runs"])
    return record


def _behaviour_inputs(info: Any) -> list[Any]:
    """The CPU configurations plus those torch runs on CUDA only (capturable, tensor betas),
    run here on CPU: where torch refuses one on CPU, ours must refuse it too."""
    cases = info.optim_inputs_func(device="cpu")
    seen = {c.desc for c in cases}
    return cases + [c for c in info.optim_inputs_func(device="cuda") if c.desc not in seen]


def collect() -> list[dict[str, Any]]:
    """One record per case: optimizer, kind (``error`` / ``behaviour``), desc, match, details."""
    from torch.testing._internal.common_optimizers import optim_db

    records = []
    for info in optim_db:
        if info.name not in OURS:
            continue
        for case in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            records.append({"optimizer": info.name, "kind": "error"} | _error_case(info, case))
        for case in _behaviour_inputs(info):
            records.append(
                {"optimizer": info.name, "kind": "behaviour"} | _behaviour_case(info, case)
            )
    return records


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(collect(), f, indent=1)
