"""The human-readable report of an :class:`~raggedfsdp.capacity.memory.Estimate`."""

from __future__ import annotations

from raggedfsdp.capacity.ep_plan import shard_ranks
from raggedfsdp.capacity.float8 import FORMATS
from raggedfsdp.capacity.memory import Estimate
from raggedfsdp.capacity.muon import MuonBalance
from raggedfsdp.capacity.settings import Mesh

__all__ = ["format_bytes", "render"]

GIB = 1024**3


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = [f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths)]
    return [
        "  " + "  ".join(f.format(c) for f, c in zip(fmt, row, strict=True))
        for row in [header, *rows]
    ]


def render(est: Estimate, gpu_memory_gib: float | None = None) -> str:
    """The report: settings, per-rank memory, padding, traffic, Muon balance, groups, notes."""
    lines = [*_settings(est), "", *_memory(est, gpu_memory_gib), "", *_padding(est)]
    lines += ["", *_traffic(est)]
    if est.float8 is not None:
        lines += ["", *_float8(est)]
    if est.muon is not None:
        lines += ["", _muon(est.muon)]
    lines += ["", *_groups(est)]
    if est.notes:
        lines += ["", "Notes", *(f"  - {note}" for note in est.notes)]
    lines.append(f"\nplanned in {est.elapsed_s:.2f} s")
    return "\n".join(lines)


def _settings(est: Estimate) -> list[str]:
    s, m = est.settings, est.model
    prec, mesh = s.precision, s.mesh
    zero = "ZeRO-3 (reshard after forward)" if s.reshard_after_forward else "no reshard after fwd"
    return [
        f"{m.name}: {_count(m.numel)} parameters in {m.num_fsdp_groups:,} FSDP groups "
        f"({len(est.plans)} distinct); {m.source}",
        f"mesh {_mesh(mesh)} = {mesh.world_size:,} ranks | "
        f"unit: {s.describe_units()} | {s.optimizer.describe()}",
        f"param {prec.param}, master {prec.master}, reduce {prec.reduce} | {zero} | "
        f"backend {s.backend}",
    ]


def _mesh(mesh: Mesh) -> str:
    """The mesh's sizes and dim names; the tp and ep dims only when there are some, so a mesh
    without them reads as it always has."""
    if mesh.tp == 1:
        text = f"{mesh.replicate} x {mesh.shard} (replicate x shard)"
    else:
        text = f"{mesh.replicate} x {mesh.shard} x {mesh.tp} (replicate x shard x tp)"
    if mesh.ep > 1:
        text += f", ep {mesh.ep} of the shard ranks (dp_shard_mod_ep {shard_ranks(mesh)})"
    return text


def _memory(est: Estimate, gpu_memory_gib: float | None) -> list[str]:
    mem, prec = est.memory, est.settings.precision
    rows = [
        [f"sharded parameters ({prec.master})", format_bytes(mem["params"])],
        [f"sharded gradients ({prec.master})", format_bytes(mem["grads"])],
        [
            f"optimizer state (max rank; mean {format_bytes(mem['optimizer_mean'])})",
            format_bytes(mem["optimizer"]),
        ],
        [
            "peak unsharded buffers (2 groups + gradient buffers)",
            format_bytes(mem["peak_unsharded"]),
        ],
        [f"total at peak ({est.peak_phase})", format_bytes(mem["total"])],
    ]
    lines = ["Per-rank memory", *_table(["", "bytes"], rows)[1:]]
    lines.append("  (activations and optimizer-step temporaries are not included)")
    if est.moe:
        lines += _experts(est)
    if gpu_memory_gib is not None:
        left = gpu_memory_gib * GIB - mem["total"]
        verdict = (
            f"yes, {format_bytes(left)} left"
            if left >= 0
            else f"NO, short by {format_bytes(-left)}"
        )
        lines.append(f"  fits in {gpu_memory_gib:g} GiB: {verdict}")
    return lines


def _experts(est: Estimate) -> list[str]:
    """The EP experts' share of the memory above: which experts a rank holds, over how many
    ranks they are sharded, and one experts group gathered."""
    mem, mesh = est.memory, est.settings.mesh
    held = ", ".join(f"{m.name}: {m.n_experts // mesh.ep} of {m.n_experts}" for m in est.moe)
    rows = [
        ["sharded parameters", format_bytes(mem["expert_params"])],
        ["sharded gradients", format_bytes(mem["expert_grads"])],
        ["optimizer state (max rank)", format_bytes(mem["expert_optimizer"])],
        ["one experts group gathered", format_bytes(mem["expert_gathered"])],
    ]
    return [
        f"  of which experts ({held} per EP rank, sharded over dp_shard_mod_ep = "
        f"{shard_ranks(mesh)} ranks)",
        *("  " + line for line in _table(["", "bytes"], rows)[1:]),
    ]


def _padding(est: Estimate) -> list[str]:
    p = est.padding
    rows = [
        ["padding %", f"{p['pct']:.3f}", f"{p['lower_bound_pct']:.3f}", f"{p['fsdp2_pct']:.3f}"],
        ["tensors with a cut unit", "0", "-", f"{p['fsdp2_cut_tensors']:,} of {p['tensors']:,}"],
    ]
    header = ["", "raggedfsdp", "lower bound", "FSDP2"]
    return ["Padding (% of parameters) and cut units", *_table(header, rows)]


def _traffic(est: Estimate) -> list[str]:
    t = est.traffic
    gathers = "forward + backward" if est.settings.reshard_after_forward else "forward"
    rows = [
        [f"all-gather ({gathers})", t["all_gather"], t["fsdp2_all_gather"]],
        ["reduce-scatter", t["reduce_scatter"], t["fsdp2_reduce_scatter"]],
        ["all-reduce (replicate dim)", t["all_reduce"], t["fsdp2_all_reduce"]],
    ]
    if est.moe:
        rows.append(["all-to-all (EP dispatch + combine)", t["all_to_all"], t["fsdp2_all_to_all"]])
    cells = [[label, format_bytes(ours), format_bytes(fsdp2)] for label, ours, fsdp2 in rows]
    peer = "FSDP2 x EP" if est.moe else "FSDP2"
    lines = [
        "Traffic per rank per step (bytes sent; as many received)",
        *_table(["", "raggedfsdp", peer], cells),
    ]
    if est.moe:
        s = est.settings
        lines.append(
            f"  (all-to-all: {s.tokens_per_rank:,} tokens per rank, top-{s.top_k}, uniform "
            f"routing ({s.mesh.ep - 1}/{s.mesh.ep} of the rows leave the rank), forward and "
            "backward, the count exchange included; activation checkpointing's recompute adds "
            "a forward's share)"
        )
    if est.settings.mesh.tp > 1:
        lines.append(
            "  (over the data-parallel dims, FSDP2 x TP alike; tensor-parallel activation "
            "collectives are not included)"
        )
    return lines


def _float8(est: Estimate) -> list[str]:
    """The FP8 gather's format, its bytes per step against FSDP2's param-dtype gather (what the
    wire carries, padding included), a better ``--all-gather`` kind if one moves fewer, then
    one gather of every group split into codes, scales, kept tensors and padding."""
    f, kind, param = est.float8, est.settings.all_gather, est.settings.precision.param
    fmt, t = FORMATS[kind], est.traffic
    rows = [
        ["FP8 codes", format_bytes(f["codes"])],
        [f"{fmt.scales} scales", format_bytes(f["scales"])],
        ["tensors kept in the param dtype", format_bytes(f["kept"])],
        ["padding (ranks' segments are equal)", format_bytes(f["padding"])],
        ["FP8 payload", format_bytes(f["payload"])],
        [f"{param} gather of the same layout", format_bytes(f["param_gather"])],
    ]
    return [
        f"FP8 all-gather: {kind} ({fmt.geometry}, {fmt.units})",
        f"  per step {f['fsdp2_ratio']:.2f}x the bytes of FSDP2's {param} all-gather "
        f"({format_bytes(t['all_gather'])} vs {format_bytes(t['fsdp2_all_gather'])} sent per "
        f"rank); padding is {f['payload_padding_pct']:.1f} % of the payload",
        f"  {_better_format(f, kind, param)}",
        f"  one gather of every group: the payload is {f['ratio']:.4f}x the {param} gather "
        "of the same layout",
        *_table(["", "bytes"], rows)[1:],
    ]


def _better_format(f: dict, kind: str, param: str) -> str:
    """The ``--all-gather`` kind that moves the fewest bytes here, or that ``kind`` does."""
    ratios, best = f["fsdp2_ratios"], f["suggested"]
    if best is None:
        others = ", ".join(f"{k} {r:.2f}x" for k, r in ratios.items() if k != kind)
        return f"{kind} moves the fewest bytes of the --all-gather kinds here ({others})"
    name = f"a {param} gather" if best == "param" else best
    return f"{name} would move {ratios[best]:.2f}x FSDP2's bytes here (--all-gather {best})"


def _muon(mu: MuonBalance) -> str:
    return (
        f"Muon owners: {mu.matrices:,} matrices; Newton–Schulz load max/mean "
        f"{mu.max_over_mean:.3f} (best possible {mu.bound_over_mean:.3f}); "
        f"{mu.local_matrices:,} computed where they lie, no communication; pieces sent to "
        f"owners and back per rank max {format_bytes(mu.moved_bytes_max)}, mean "
        f"{format_bytes(mu.moved_bytes_mean)} (bf16)"
    )


def _groups(est: Estimate) -> list[str]:
    header = [
        "group",
        "x",
        "tensors",
        "params",
        "S",
        "pad %",
        "bound %",
        "FSDP2 %",
        "FSDP2 cuts",
        "empty ranks",
        "plan ms",
    ]
    rows = []
    for g in est.plans:
        d = g.to_dict()
        rows.append(
            [
                g.group.name,
                str(g.instances),
                str(len(g.layout.tensors)),
                _count(g.layout.numel),
                _count(g.segment),
                f"{d['padding_pct']:.3f}",
                f"{d['lower_bound_pct']:.3f}",
                f"{d['fsdp2_padding_pct']:.3f}",
                str(g.fsdp2_cut),
                f"{g.empty_ranks:,}",
                f"{d['plan_ms']:.1f}",
            ]
        )
    what = "TP-local tensors, " if est.settings.mesh.tp > 1 else ""
    return [f"Groups ({what}S = elements per rank)", *_table(header, rows)]
