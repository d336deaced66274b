"""Muon step: batched vs per-matrix Newton–Schulz on a MoE model; owner compute on ragged shards
vs FSDP2 + torch Muon vs gather-all.

**MoE, one process** (``--part moe``): a MoE-shaped model (per layer wq, wk, wv, wo of d×d, a
router of E×d and E stacked experts: w1, w3 of (E, h, d) and w2 of (E, d, h)); variants timed
alternately over the same gradients, medians of CPU time:

* ``batched``: ``raggedfsdp.optim.Muon`` (``batched_ns=True``, the default): one NS chain per
  shape (the experts of all layers, the attention projections of all layers);
* ``per-matrix``: the same with ``batched_ns=False``, one chain per matrix;
* ``torch``: ``torch.optim.Muon`` on the same matrices (each expert its own 2-D parameter, as
  torch's Muon takes 2-D only).

NS FLOPs per step (``ns_flops``) over the median step give each variant's GFLOP/s, beside the
bf16 matmul ceiling measured in the same run (the best of a square ``mm`` and a batched
``bmm`` of the experts' shape; the square grows from 256² to 2048² while one product takes
under 50 ms, so a CPU without native bf16, where 2048² takes a minute, stops early). The
per-matrix rate over that ceiling is the lowest batched / per-matrix ratio that removing every
per-call cost could reach (``limit_vs_per-matrix``).

**Distributed** (``--part worlds``):

Same gloo run (127.0.0.1), W=2 then W=4, a small transformer's hidden matrices (per layer wq, wk,
wv, wo of d×d and w1, w3 of 4d×d, w2 of d×4d), the same full gradients on every rank (so no
gradient reduction is timed: only the optimizer step). Variants, each timed between barriers,
the order rotating every round:

* ``ours``: ``raggedfsdp.optim.Muon`` over RaggedTensor parameters, one planned flat buffer per
  layer with ``Muon.shard_policy()`` ("auto": matrices whole within a 0.1 % padding budget);
* ``ours_split``: the same optimizer on FSDP2's layout (every matrix split row-wise over all
  ranks), so every matrix travels to its owner and back: the communication path;
* ``fsdp2``: (a) ``torch.distributed.fsdp.fully_shard`` + ``torch.optim.Muon`` on DTensors;
* ``gather``: (b) Moonlight style on FSDP2's layout: momentum on the shard, one all-gather of
  every bf16 NS input, every rank orthogonalises every matrix and applies its own piece.

Bytes are those this rank receives from other ranks per step: ours from ``last_step_stats``;
gather from the all-gather size; fsdp2 from the sizes of DTensor's functional collectives
(all-gather (W-1)·in, ring all-reduce 2(W-1)/W·in, reduce-scatter (W-1)/W·in).

    .venv/bin/python benchmarks/muon_step.py                 # both parts, tables + JSON lines
    .venv/bin/python benchmarks/muon_step.py --dim 128 --layers 2 --rounds 5 --worlds 2
    .venv/bin/python benchmarks/muon_step.py --part moe --experts 16 --expert-hidden 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from measure import init_gloo, rank_context, start_ranks
from torch.distributed.tensor.debug import CommDebugMode

from raggedfsdp.comm.launch import serving_store
from raggedfsdp.optim import Muon
from raggedfsdp.optim.muon import newton_schulz
from raggedfsdp.sharding import FlatBuffer, RaggedShard, RaggedTensor, TensorSpec, plan_layout
from raggedfsdp.sharding.owners import ns_flops

HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
COEFFS = (3.4445, -4.7750, 2.0315)


def layer_shapes(dim: int) -> dict[str, tuple[int, int]]:
    qkvo = {k: (dim, dim) for k in ("wq", "wk", "wv", "wo")}
    return qkvo | {"w1": (4 * dim, dim), "w3": (4 * dim, dim), "w2": (dim, 4 * dim)}


# ----------------------------------------------------------------------------- MoE, one process
def moe_shapes(layers: int, dim: int, experts: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The Muon matrices of a MoE model: attention projections, router, stacked experts."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        shapes |= {f"l{i}.{k}": (dim, dim) for k in ("wq", "wk", "wv", "wo")}
        shapes |= {f"l{i}.router": (experts, dim)}
        shapes |= {f"l{i}.{k}": (experts, hidden, dim) for k in ("w1", "w3")}
        shapes |= {f"l{i}.w2": (experts, dim, hidden)}
    return shapes


def matmul_ceiling(experts: int, hidden: int, dim: int, repeats: int = 5) -> float:
    """GFLOP/s of bf16 matmul here (CPU time, like the steps): the best of a square ``mm`` (up
    to 2048², :func:`_square_side`) and the batched products of an expert's NS iteration,
    (E, s, l) @ (E, l, s) and (E, s, s) @ (E, s, l), with s, l the smaller and larger of h
    and d."""
    s, big = min(hidden, dim), max(hidden, dim)
    n = _square_side()
    a = torch.randn(n, n).bfloat16()
    x = torch.randn(experts, s, big).bfloat16()
    g = torch.randn(experts, s, s).bfloat16()
    cases = [
        (lambda: a @ a, 2 * n**3),
        (lambda: x @ x.mT, 2 * experts * s * s * big),
        (lambda: g @ x, 2 * experts * s * s * big),
    ]
    best = 0.0
    for fn, flops in cases:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        best = max(best, flops / statistics.median(times) / 1e9)
    return best


def _square_side(start: int = 256, stop: int = 2048, budget_s: float = 0.05) -> int:
    """The largest side, doubling from ``start`` to ``stop``, whose bf16 square product takes
    under ``budget_s``: large enough to reach the ceiling where bf16 is native, small enough
    where it is emulated (2048² took 55 s on an AVX2-only EPYC)."""
    n = start
    while n < stop:
        a = torch.randn(2 * n, 2 * n).bfloat16()
        t0 = time.process_time()
        a @ a
        if time.process_time() - t0 > budget_s:
            break
        n *= 2
    return n


def moe_side_by_side(args: argparse.Namespace) -> dict:
    """Median step of batched / per-matrix / torch Muon on the MoE matrices, one process."""
    torch.set_num_threads(args.threads)
    shapes = moe_shapes(args.moe_layers, args.moe_dim, args.experts, args.expert_hidden)
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=gen) * 0.01 for n, s in shapes.items()} for _ in "ab"]
    ours = {b: {n: torch.nn.Parameter(t.clone()) for n, t in init.items()} for b in (True, False)}
    split = {  # torch's Muon: each expert its own 2-D parameter
        n: [torch.nn.Parameter(m.clone()) for m in (t if t.dim() == 3 else [t])]
        for n, t in init.items()
    }
    opts = {
        "batched": Muon(list(ours[True].items()), **HYPER, batched_ns=True),
        "per-matrix": Muon(list(ours[False].items()), **HYPER, batched_ns=False),
        "torch": torch.optim.Muon([q for qs in split.values() for q in qs], **HYPER),
    }

    def prepare(name: str, k: int) -> None:
        g = grads[k % 2]
        if name == "torch":
            for n, qs in split.items():
                for q, gq in zip(qs, g[n] if g[n].dim() == 3 else [g[n]], strict=True):
                    q.grad = gq.clone()
        else:
            for n, p in ours[name == "batched"].items():
                p.grad = g[n].clone()

    names = list(opts)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for k in range(args.rounds + 1):  # round 0 warms up
        for name in names[k % len(names) :] + names[: k % len(names)]:
            prepare(name, k)
            t0 = time.process_time()
            opts[name].step()
            if k:
                cpu[name].append(time.process_time() - t0)
    flops = sum(
        (s[0] if len(s) == 3 else 1) * ns_flops(*s[-2:], opts["batched"].defaults["ns_steps"])
        for s in shapes.values()
    )
    med = {n: statistics.median(t) for n, t in cpu.items()}
    ceiling = matmul_ceiling(args.experts, args.expert_hidden, args.moe_dim)
    return {
        "shapes": {"layers": args.moe_layers, "dim": args.moe_dim, "experts": args.experts},
        "expert_hidden": args.expert_hidden,
        "threads": args.threads,
        "matrices": sum(s[0] if len(s) == 3 else 1 for s in shapes.values()),
        "ns_calls": {n: o.last_step_stats["ns_calls"] for n, o in opts.items() if n != "torch"},
        "median_cpu_s": med,
        "ns_gflops": {n: flops / t / 1e9 for n, t in med.items()},
        "ceiling_gflops": ceiling,
        "ratios": {f"batched_vs_{n}": med["batched"] / med[n] for n in med if n != "batched"},
        # the lowest batched / per-matrix any batching could reach: the per-matrix step's NS
        # run at the matmul ceiling
        "limit_vs_per-matrix": flops / med["per-matrix"] / 1e9 / ceiling,
    }


def print_moe(r: dict) -> None:
    s = r["shapes"]
    print(
        f"MoE Muon step, one process, {r['threads']} thread(s): {s['layers']} layers, d={s['dim']},"
        f" E={s['experts']} experts of hidden {r['expert_hidden']}, {r['matrices']} matrices; "
        f"bf16 matmul ceiling {r['ceiling_gflops']:.0f} GFLOP/s; batched / per-matrix cannot go "
        f"below {r['limit_vs_per-matrix']:.2f} (per-matrix NS GFLOP/s / ceiling)"
    )
    print("| variant | median CPU ms | NS chains | NS GFLOP/s | % of ceiling | batched / variant |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, t in r["median_cpu_s"].items():
        ratio = r["ratios"].get(f"batched_vs_{n}")
        calls = r["ns_calls"].get(n, r["matrices"])
        gf = r["ns_gflops"][n]
        print(
            f"| {n} | {1e3 * t:.1f} | {calls} | {gf:.1f} | {100 * gf / r['ceiling_gflops']:.0f} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} |"
        )


# ----------------------------------------------------------------------------- distributed
def _ragged(layers, dim, policy, rank, world) -> dict[str, torch.nn.Parameter]:
    """RaggedTensor parameters. ``policy`` None: FSDP2's layout (each matrix split row-wise over
    all ranks, its own allocation); else one planned flat buffer per layer (as ``fully_shard``
    per block makes them) with that policy's units."""
    out = {}
    for i in range(layers):
        shapes = {f"l{i}.{n}": s for n, s in layer_shapes(dim).items()}
        gen = torch.Generator().manual_seed(i)
        full = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
        if policy is None:
            for n, t in full.items():
                spec = RaggedShard.row_wise(t.shape, world, name=n)
                start, stop = spec.local_range(rank)
                local = t.reshape(-1)[start:stop].clone()
                out[n] = torch.nn.Parameter(RaggedTensor(local, spec, rank))
            continue
        specs = [
            TensorSpec(n, s, "float32", policy(n, torch.empty(s, device="meta")))
            for n, s in shapes.items()
        ]
        layout = plan_layout(specs, world)
        buf = FlatBuffer(layout, rank, torch.float32)
        buf.load_full_tensors(full)
        for n in shapes:
            out[n] = torch.nn.Parameter(RaggedTensor(buf.shard_view(n), layout.shards[n], rank))
    return out


class _Block(torch.nn.Module):
    """A module FSDP2 can wrap: the layer's matrices, an identity forward."""

    def __init__(self, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.mats = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes.values()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Gather:
    """(b): all-gather every NS input (bf16), NS on all matrices on every rank."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.params = params
        self.bufs = {n: torch.zeros_like(p.local) for n, p in params.items()}
        self.bytes = 0

    def step(self) -> None:
        world = dist.get_world_size()
        local, pieces = [], []
        for n, p in self.params.items():
            g = p.grad.local
            self.bufs[n].lerp_(g, 1 - HYPER["momentum"])
            pieces.append(g.lerp(self.bufs[n], HYPER["momentum"]).bfloat16())
        # pad every rank's part to the longest (all_gather_into_tensor needs equal sizes)
        lengths = [[p.ragged_shard.length(r) for p in self.params.values()] for r in range(world)]
        seg = max(sum(x) for x in lengths)
        local = torch.zeros(seg, dtype=torch.bfloat16)
        torch.cat(pieces, out=local[: sum(x.numel() for x in pieces)])
        full = torch.empty(world * seg, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(full, local)
        self.bytes = (world - 1) * seg * 2
        rank = dist.get_rank()
        for i, p in enumerate(self.params.values()):
            whole = torch.cat(
                [full[r * seg + sum(lengths[r][:i]) :][: lengths[r][i]] for r in range(world)]
            )
            o = newton_schulz(whole.view(p.shape), COEFFS, 5, 1e-7).reshape(-1)
            start, stop = p.ragged_shard.local_range(rank)
            m, k = p.shape
            p.local.mul_(1 - HYPER["lr"] * HYPER["weight_decay"])
            p.local.add_(o[start:stop], alpha=-HYPER["lr"] * max(1, m / k) ** 0.5)


class _CommBytes(CommDebugMode):
    """Bytes this rank receives in DTensor's collectives (CommDebugMode sees them)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.bytes, self.calls = world, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "c10d" in name and "wait" not in name and args:
            t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            n, w = t.numel() * t.element_size(), self.world
            if "all_gather" in name:
                self.bytes += (w - 1) * n
            else:  # ring all-reduce receives 2 (W-1)/W, reduce-scatter (W-1)/W
                self.bytes += (2 if "all_reduce" in name else 1) * (w - 1) * n // w
            self.calls += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.distributed.tensor import DTensor

    init_gloo(rank, world, port)
    shapes = {f"l{i}.{n}": s for i in range(args.layers) for n, s in layer_shapes(args.dim).items()}
    grads = [
        {
            n: torch.randn(s, generator=torch.Generator().manual_seed(100 * k + j)) * 0.01
            for j, (n, s) in enumerate(shapes.items())
        }
        for k in range(2)
    ]
    variants, setters, bytes_of = {}, {}, {}

    for name, policy in (("ours", Muon.shard_policy()), ("ours_split", None)):
        params = _ragged(args.layers, args.dim, policy, rank, world)
        opt = Muon(list(params.items()), **HYPER)
        variants[name] = opt.step
        setters[name] = params
        bytes_of[name] = lambda o=opt: o.last_step_stats["bytes_received"]
    params = _ragged(args.layers, args.dim, None, rank, world)
    gather = _Gather(params)
    variants["gather"], setters["gather"], bytes_of["gather"] = (
        gather.step,
        params,
        lambda: gather.bytes,
    )

    def set_grads(params, full) -> None:
        for n, p in params.items():
            start, stop = p.ragged_shard.local_range(rank)
            p.grad = RaggedTensor(full[n].reshape(-1)[start:stop].clone(), p.ragged_shard, rank)

    fsdp2_error = None
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = torch.nn.Sequential()
        named = {}
        for i in range(args.layers):
            layer = {n: sh for n, sh in shapes.items() if n.startswith(f"l{i}.")}
            block = _Block(layer)
            model.append(block)
            fsdp2_fully_shard(block, mesh=mesh)
            named |= dict(zip(layer, block.mats, strict=True))
        fsdp2_fully_shard(model, mesh=mesh)
        torch_opt = torch.optim.Muon(list(named.values()), **HYPER)
        counter = _CommBytes(world)

        def fsdp2_step() -> None:
            counter.bytes = counter.calls = 0
            with counter:
                torch_opt.step()

        def fsdp2_grads(full) -> None:
            for n, p in named.items():
                local = torch.chunk(full[n], world)[rank].clone()
                p.grad = DTensor.from_local(
                    local, mesh, p.placements, shape=p.shape, stride=p.stride()
                )

        fsdp2_grads(grads[0])
        fsdp2_step()  # fails here if DTensor cannot run torch's Muon at this W
        variants["fsdp2"], bytes_of["fsdp2"] = fsdp2_step, lambda: counter.bytes
    except Exception as e:  # reported in the table, not hidden
        fsdp2_error = f"{type(e).__name__}: {str(e)[:200]}"

    def prepare(name: str, k: int) -> None:
        if name == "fsdp2":
            fsdp2_grads(grads[k % 2])
        else:
            set_grads(setters[name], grads[k % 2])

    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        prepare(name, 0)
        variants[name]()
    for k in range(args.rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            prepare(name, k)
            dist.barrier()
            t0 = time.perf_counter()
            variants[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        ours_stats = {}
        for n in ("ours", "ours_split"):
            s = variants[n].__self__.last_step_stats
            ours_stats[n] = {
                k: s[k] for k in ("matrices", "matrices_local", "ns_flops_max", "ns_flops_mean")
            }
        out.put(
            {
                "world": world,
                "median_s": {n: statistics.median(t) for n, t in times.items()},
                "bytes_received_rank0": {n: int(b()) for n, b in bytes_of.items()},
                "fsdp2_error": fsdp2_error,
                "fsdp2_collectives": counter.calls if "fsdp2" in variants else None,
                "stats": ours_stats,
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def run_worlds(args: argparse.Namespace) -> None:
    results = []
    for world in args.worlds:
        queue = rank_context().Queue()
        with serving_store() as port:
            start_ranks(_worker, (world, port, args, queue), world)
        results.append(queue.get())
    print(f"{'W':>2} {'variant':>10} {'median ms':>10} {'MB recv':>9} {'ratio ours/x':>13}")
    summary = {"dim": args.dim, "layers": args.layers, "rounds": args.rounds, "worlds": {}}
    for r in results:
        med, nbytes = r["median_s"], r["bytes_received_rank0"]
        ratios = {f"ours_vs_{n}": med["ours"] / med[n] for n in med if n != "ours"}
        for n in med:
            ratio = f"{med['ours'] / med[n]:.2f}" if n != "ours" else ""
            print(
                f"{r['world']:>2} {n:>10} {med[n] * 1e3:>10.1f} {nbytes[n] / 1e6:>9.2f} {ratio:>13}"
            )
        if r["fsdp2_error"]:
            print(f"{r['world']:>2}      fsdp2 failed: {r['fsdp2_error']}")
        summary["worlds"][r["world"]] = r | {"step_ratios": ratios}
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["moe", "worlds", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256, help="worlds: model width")
    parser.add_argument("--layers", type=int, default=2, help="worlds: layers")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--moe-dim", type=int, default=256)
    parser.add_argument("--moe-layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--expert-hidden", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="moe: intra-op threads")
    args = parser.parse_args()
    if args.part in ("moe", "all"):
        moe = moe_side_by_side(args)
        print_moe(moe)
        print(json.dumps({"moe": moe}))
    if args.part in ("worlds", "all"):
        run_worlds(args)


if __name__ == "__main__":
    main()
