"""GPU suite: check raggedfsdp's CUDA paths and measure its kernels against the card's ceilings.

One script, a few minutes on one H200 (budget: under 8). Checks (each passes or fails):

1. an NCCL process group at W=1, initialised without torchrun from a ``FileStore``;
2. ``raggedfsdp.comm``: every collective on CUDA tensors, and the stream protocol of
   ``CommHandle`` (a collective launched on a communication stream must wait for the compute
   stream's pending writes, and ``wait()`` must order the compute stream after it);
3. ``raggedfsdp.fully_shard`` training steps on CUDA (fp32, equal to an unwrapped copy of the
   model; bf16 mixed precision, finite and decreasing loss), and with FSDP2's run-time controls
   (prefetch lists, no backward gather for the embedding, kept parameters, compiled blocks).

Measurements, each against a ceiling measured in the same run:

* ceilings: bf16 matmul TFLOP/s (8192^3) and device-to-device copy GB/s (1 GiB, read + write);
* Newton–Schulz (Muon's orthogonalization, 5 iterations, coefficients (3.4445, -4.7750, 2.0315),
  torch.optim.Muon's op sequence) in bf16 on 4096x4096 and 8192x28672: TFLOP/s and % of the
  matmul ceiling;
* 8-bit block quantization and dequantization (``raggedfsdp.optim.quant``, 256-element blocks,
  dynamic map): GB/s of fp32 in + codes and absmax out, and % of the copy ceiling;
* AdamW on one flat fp32 buffer of 256M elements (torch's fused kernel, as
  ``raggedfsdp.optim.AdamW`` runs it over a rank's whole flat segment): GB/s counting 28 bytes
  per element (param, grad and both moments read; param and moments written), % of copy;
  ``raggedfsdp.optim.AdamW8bit``'s step on the same size, for reference.

Without a CUDA device it says so and exits 0 having measured nothing. ``--cpu-smoke`` runs every
step on the CPU with gloo and tiny sizes instead: a self-test of this script, not a benchmark.

    python benchmarks/gpu_suite.py [--json-out gpu_suite.json] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
GIB = 1024**3

#: Problem sizes on the GPU and in the CPU self-test.
SIZES = {
    "cuda": {
        "matmul": 8192,
        "copy_bytes": GIB,
        "ns": [(4096, 4096), (8192, 28672)],
        "quant": 256 * 2**20,
        "adamw": 256 * 2**20,
        "iters": 20,
    },
    "cpu": {
        "matmul": 512,
        "copy_bytes": 32 * 2**20,
        "ns": [(256, 256), (256, 896)],
        "quant": 2**20,
        "adamw": 2**20,
        "iters": 3,
    },
}


class Suite:
    """Runs checks and measurements on one device, collecting results and failures."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sizes = SIZES[device.type]
        self.results: dict[str, object] = {"device": _device_name(device)}
        self.failures: list[str] = []

    # ----------------------------------------------------------------------------- plumbing
    def check(self, name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        try:
            detail = fn()
        except Exception:
            self.failures.append(name)
            self.results[name] = {"ok": False, "error": traceback.format_exc(limit=4)}
            print(f"FAIL  {name}\n{traceback.format_exc(limit=4)}", flush=True)
            return
        self.results[name] = {"ok": True, "detail": detail}
        print(f"ok    {name} ({time.perf_counter() - t0:.1f} s) {detail or ''}", flush=True)

    def time(self, fn: Callable[[], object], warmup: int = 2) -> float:
        """Median seconds of ``fn`` (CUDA events on the GPU)."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(self.sizes["iters"]):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def measure(self, name: str, fn: Callable[[], dict[str, float]]) -> None:
        try:
            values = fn()
        except Exception:
            self.failures.append(name)
            self.results[name] = {"error": traceback.format_exc(limit=4)}
            print(f"FAIL  {name}\n{traceback.format_exc(limit=4)}", flush=True)
            return
        self.results[name] = values
        shown = ", ".join(f"{k} {v:.4g}" for k, v in values.items())
        print(f"      {name}: {shown}", flush=True)

    # ----------------------------------------------------------------------------- checks
    def process_group(self, store_dir: Path) -> str:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        store = dist.FileStore(str(store_dir / "store"), 1)
        kwargs = {"device_id": self.device} if self.device.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
        x = torch.arange(8.0, device=self.device)
        dist.all_reduce(x)  # a real backend collective, even at W=1
        torch.testing.assert_close(x, torch.arange(8.0, device=self.device))
        return f"backend {dist.get_backend()}"

    def collectives(self) -> str:
        from raggedfsdp.comm import (
            all_gather_flat,
            all_reduce_flat,
            all_to_all_uneven,
            reduce_scatter_flat,
        )

        d = self.device
        full = torch.zeros(64, device=d)
        shard = torch.arange(64.0, device=d)
        all_gather_flat(full, shard, async_op=True).wait()
        torch.testing.assert_close(full, shard)
        out = torch.empty(64, device=d)
        reduce_scatter_flat(out, full * 2, op="avg", async_op=True).wait()
        torch.testing.assert_close(out, shard * 2)
        all_reduce_flat(out, op="sum", async_op=True).wait()
        torch.testing.assert_close(out, shard * 2)
        moved = torch.empty(10, device=d)
        all_to_all_uneven(moved, shard[:10], [10], [10], async_op=True).wait()
        torch.testing.assert_close(moved, shard[:10])
        return "all_gather_flat, reduce_scatter_flat, all_reduce_flat, all_to_all_uneven"

    def streams(self) -> str:
        """``raggedfsdp.comm``'s launch protocol with a real NCCL all-gather on a comm stream:
        the gather must read a write still queued on the compute stream, and after ``wait()``
        the compute stream must read the gather's output, not the NaNs it held before. Each
        side is held back by a sleep kernel so that a missing dependency shows."""
        from raggedfsdp.comm.handle import launch

        if self.device.type != "cuda":
            return "skipped (streams exist on CUDA only)"
        n = 4096
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        expected = (a @ a).float().sum(dim=0)
        comm = torch.cuda.Stream(self.device)
        for _ in range(3):
            src = torch.full((n,), -1.0, device=self.device)
            out = torch.full((n,), float("nan"), device=self.device)
            torch.cuda._sleep(50_000_000)  # compute stream busy: the next write stays pending
            src.copy_((a @ a).float().sum(dim=0))
            with torch.cuda.stream(comm):
                torch.cuda._sleep(50_000_000)  # comm stream busy: the gather finishes late
            handle = launch(
                lambda async_op, o=out, i=src: dist.all_gather_single(o, i, async_op=async_op),
                (out, src),
                async_op=True,
                comm_stream=comm,
            )
            handle.wait()
            torch.testing.assert_close(out * 1, expected, rtol=1e-2, atol=1e-2)
        torch.cuda.synchronize()
        assert handle.is_completed(), "a waited and synchronized handle must report completion"
        return "comm stream waited for pending compute; compute waited for the collective"

    def _seeded_lm(self) -> nn.Module:
        """The same ``_TinyLM`` weights on every call, on this device."""
        torch.manual_seed(0)
        return _TinyLM().to(self.device)

    def fully_shard_steps(self) -> str:
        import raggedfsdp

        ref, ours = self._seeded_lm(), self._seeded_lm()
        for block in ours.blocks:
            raggedfsdp.fully_shard(block)
        raggedfsdp.fully_shard(ours)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, ours)]
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            tokens = torch.randint(0, _TinyLM.VOCAB, (4, 33), generator=gen).to(self.device)
            losses = []
            for model, opt in zip((ref, ours), opts, strict=True):
                loss = _lm_loss(model, tokens)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            assert abs(losses[0] - losses[1]) < 1e-4, f"fp32 losses differ: {losses}"
        diff = max(
            (p.full_tensor() - q).abs().max().item()
            for p, q in zip(ours.parameters(), ref.parameters(), strict=True)
        )
        assert diff < 1e-4, f"parameters differ from the unwrapped model by {diff}"
        bf16 = self._seeded_lm()
        policy = raggedfsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        for block in bf16.blocks:
            raggedfsdp.fully_shard(block, mp_policy=policy)
        raggedfsdp.fully_shard(bf16, mp_policy=policy)
        opt = torch.optim.AdamW(bf16.parameters(), lr=1e-2)
        tokens = torch.randint(0, _TinyLM.VOCAB, (4, 33), generator=gen).to(self.device)
        mp_losses = []
        for _ in range(5):
            loss = _lm_loss(bf16, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mp_losses.append(loss.item())
        assert all(map(torch.isfinite, torch.tensor(mp_losses))), mp_losses
        assert mp_losses[-1] < mp_losses[0], f"bf16 loss did not decrease: {mp_losses}"
        return (
            f"fp32 max |param diff| {diff:.1e}; bf16 loss {mp_losses[0]:.3f} -> {mp_losses[-1]:.3f}"
        )

    def fully_shard_controls(self) -> str:
        """FSDP2's run-time controls on this device: two all-gathers in flight (explicit
        prefetch lists), the embedding not gathered for backward, parameters kept across a
        no-sync micro-batch and gathered again after the optimizer step, blocks through
        ``torch.compile`` (aot_eager: graph capture without compiling kernels)."""
        import raggedfsdp

        ref, ours = self._seeded_lm(), self._seeded_lm()
        raggedfsdp.fully_shard(ours.embed).set_unshard_in_backward(False)
        for block in ours.blocks:
            block.compile(backend="aot_eager")
            raggedfsdp.fully_shard(block)
        raggedfsdp.fully_shard(ours)
        blocks = list(ours.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - 2) : i][::-1])
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, ours)]
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            tokens = torch.randint(0, _TinyLM.VOCAB, (4, 33), generator=gen).to(self.device)
            for model, opt in zip((ref, ours), opts, strict=True):
                for half, last in ((tokens[:2], False), (tokens[2:], True)):
                    if model is ours:
                        model.set_requires_gradient_sync(last)
                        model.set_reshard_after_backward(last)
                    (_lm_loss(model, half) / 2).backward()
                opt.step()
                opt.zero_grad()
        diff = max(
            (p.full_tensor() - q).abs().max().item()
            for p, q in zip(ours.parameters(), ref.parameters(), strict=True)
        )
        assert diff < 1e-4, f"parameters differ from the unwrapped model by {diff}"
        return f"max |param diff| {diff:.1e} after 3 accumulated steps"

    def float8_all_gather(self) -> str:
        """``Float8Blocks(128)``: the gathered bf16 weights equal one process's
        dequantize(quantize(master)) bitwise, on this device; with the codes kept,
        ``float8_block_linear`` runs ``scaled_mm`` (1x128 activations, 128x128 weights) on CUDA,
        close to the bf16 matmul of the dequantized operands, and its gradients reach the
        master; on the CPU it falls back to the bf16 matmul."""
        import warnings

        import raggedfsdp
        from raggedfsdp.fsdp import Float8BlockLinear, Float8Blocks, float8_block_linear
        from raggedfsdp.fsdp.float8 import dequantize_tiles, quantize_tiles

        torch.manual_seed(0)
        model = nn.Sequential(Float8BlockLinear(512, 256), nn.GELU(), Float8BlockLinear(256, 384))
        model.to(self.device)
        want = [quantize_tiles(m.weight.detach()[None], 128) for m in (model[0], model[2])]
        fp8 = Float8Blocks(128, keep_weights=True)
        policy = raggedfsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32, all_gather=fp8)
        raggedfsdp.fully_shard(model, mp_policy=policy)
        model.unshard()
        for linear, (codes, scales) in zip((model[0], model[2]), want, strict=True):
            expected = dequantize_tiles(codes, scales, 128, torch.bfloat16)[0]
            assert torch.equal(linear.weight, expected), "gathered weights differ"
            assert torch.equal(linear.weight.float8_blocks.scales, scales[0]), "scales differ"
        x = torch.randn(64, 512, device=self.device, dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = float8_block_linear(x, model[0].weight, model[0].bias)
        xc, xs = quantize_tiles(x[None].float(), (1, 128))
        x_deq = dequantize_tiles(xc, xs, (1, 128), torch.float32)[0]
        operands = x_deq if self.device.type == "cuda" else x.float()
        ref = operands @ model[0].weight.float().t() + model[0].bias.float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"FP8 linear off by {err:.3g} (relative)"
        model.reshard()
        loss = model(x).float().square().mean()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and g.local.isfinite().all() for g in grads), "bad gradients"
        path = "scaled_mm" if self.device.type == "cuda" else "bf16 fallback"
        return f"{path}, relative error {err:.2e}"

    def mxfp8_all_gather(self) -> str:
        """``MXFP8Blocks()``: the gathered bf16 weights on this device equal the CPU's
        dequantize(quantize(master)) bitwise (e8m0 exponents from ``frexp``, the e4m3 cast and
        the decode tables agree across devices), and gradients reach the master."""
        import raggedfsdp
        from raggedfsdp.fsdp import MXFP8Blocks
        from raggedfsdp.fsdp.mxfp8 import dequantize_mx, quantize_mx

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 384))
        with torch.no_grad():
            model[0].weight[:2] = 0  # zero blocks
            model[2].weight[0, :32] *= 2.0**-130  # blocks below e8m0's smallest scale
        want = [
            dequantize_mx(*quantize_mx(m.weight.detach()[None]), torch.bfloat16)[0]
            for m in (model[0], model[2])
        ]
        model.to(self.device)
        policy = raggedfsdp.MixedPrecisionPolicy(
            torch.bfloat16, torch.float32, all_gather=MXFP8Blocks()
        )
        raggedfsdp.fully_shard(model, mp_policy=policy)
        model.unshard()
        for linear, expected in zip((model[0], model[2]), want, strict=True):
            assert torch.equal(linear.weight.cpu(), expected), "gathered weights differ from CPU"
        model.reshard()
        x = torch.randn(64, 512, device=self.device, dtype=torch.bfloat16)
        model(x).float().square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and g.local.isfinite().all() for g in grads), "bad gradients"
        return "gathered weights bitwise the CPU's quantization"

    def fully_shard_meta_init(self) -> str:
        """FSDP2's meta-device flow on this device: wrap on meta, ``to_empty`` here, initialise
        in place (random fills draw on this device's generator, as one process would), train;
        and a model wrapped on the CPU moved here with ``to()``. Both must match the unwrapped
        model."""
        import raggedfsdp

        def init(model: nn.Module) -> nn.Module:
            torch.manual_seed(5)
            for name, param in model.named_parameters():
                if param.dim() > 1:
                    nn.init.trunc_normal_(param, std=0.02)
                else:
                    nn.init.normal_(param, 1.0 if "blocks" in name else 0.0, 0.01)
            return model

        def wrap(model: nn.Module) -> nn.Module:
            for block in model.blocks:
                raggedfsdp.fully_shard(block)
            return raggedfsdp.fully_shard(model)

        ref = init(_TinyLM().to(self.device))
        with torch.device("meta"):
            meta = wrap(_TinyLM())
        init(meta.to_empty(device=self.device))
        init_diff = max(
            (p.full_tensor() - q).abs().max().item()
            for p, q in zip(meta.parameters(), ref.parameters(), strict=True)
        )
        assert init_diff == 0.0, f"meta-device init differs from the unwrapped one: {init_diff}"
        on_cpu = _TinyLM()
        on_cpu.load_state_dict(ref.state_dict())
        moved = wrap(on_cpu).to(self.device)
        models = (ref, meta, moved)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            tokens = torch.randint(0, _TinyLM.VOCAB, (4, 33), generator=gen).to(self.device)
            for model, opt in zip(models, opts, strict=True):
                _lm_loss(model, tokens).backward()
                opt.step()
                opt.zero_grad()
        diffs = [
            max(
                (p.full_tensor() - q).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters(), strict=True)
            )
            for model in (meta, moved)
        ]
        assert max(diffs) < 1e-4, f"parameters differ from the unwrapped model by {diffs}"
        return f"init bitwise; after 3 steps max |diff| meta {diffs[0]:.1e}, moved {diffs[1]:.1e}"

    # ----------------------------------------------------------------------------- measurements
    def ceilings(self) -> dict[str, float]:
        n = self.sizes["matmul"]
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        out = torch.empty_like(a)
        seconds = self.time(lambda: torch.mm(a, b, out=out))
        src = torch.empty(self.sizes["copy_bytes"], dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        copy_s = self.time(lambda: dst.copy_(src))
        self.peak_tflops = 2 * n**3 / seconds / 1e12
        self.copy_gbs = 2 * src.numel() / copy_s / 1e9
        return {"bf16_matmul_tflops": self.peak_tflops, "d2d_copy_gbs": self.copy_gbs}

    def newton_schulz(self, rows: int, cols: int) -> dict[str, float]:
        g = torch.randn(rows, cols, device=self.device, dtype=torch.float32)
        seconds = self.time(lambda: _newton_schulz(g))
        m, n = min(rows, cols), max(rows, cols)
        flops = NS_STEPS * (4 * m * m * n + 2 * m**3)  # X X^T, A A, B X per iteration
        tflops = flops / seconds / 1e12
        return {
            "ms": 1e3 * seconds,
            "tflops": tflops,
            "pct_of_matmul": 100 * tflops / self.peak_tflops,
        }

    def quantization(self) -> dict[str, float]:
        from raggedfsdp.optim.quant import BlockGrid, QuantMap, dequantize_, quantize_

        n, block = self.sizes["quant"], 256
        x = torch.randn(n, device=self.device)
        grid = BlockGrid(1, n, 1, block)
        codes = torch.empty(n, dtype=torch.uint8, device=self.device)
        absmax = torch.empty(grid.num_blocks, device=self.device)
        out = torch.empty_like(x)
        qmap = QuantMap.get(True, self.device)
        q_s = self.time(lambda: quantize_(x, grid, codes, absmax, qmap))
        d_s = self.time(lambda: dequantize_(out, grid, codes, absmax, qmap))
        err = ((out - x).abs().amax() / x.abs().amax()).item()
        assert err < 0.05, f"dequantized values are off by {err:.3f} of the range"
        moved = n * (4 + 1 + 4 / block)
        return {
            "quantize_gbs": moved / q_s / 1e9,
            "dequantize_gbs": moved / d_s / 1e9,
            "quantize_pct_of_copy": 100 * moved / q_s / 1e9 / self.copy_gbs,
            "dequantize_pct_of_copy": 100 * moved / d_s / 1e9 / self.copy_gbs,
        }

    def adamw(self) -> dict[str, float]:
        from raggedfsdp.optim import AdamW8bit

        n = self.sizes["adamw"]
        flat = nn.Parameter(torch.randn(n, device=self.device))
        flat.grad = torch.randn_like(flat)
        fused = self.device.type == "cuda"
        opt = torch.optim.AdamW([flat], lr=1e-4, fused=fused, foreach=not fused)
        seconds = self.time(opt.step)
        del opt
        gbs = 28 * n / seconds / 1e9
        opt8 = AdamW8bit([flat], lr=1e-4)
        seconds8 = self.time(opt8.step)
        return {
            "fused_adamw_ms": 1e3 * seconds,
            "fused_adamw_gbs": gbs,
            "fused_adamw_pct_of_copy": 100 * gbs / self.copy_gbs,
            "adamw8bit_step_ms": 1e3 * seconds8,
        }


class _TinyLM(nn.Module):
    """Embedding, 3 residual MLP blocks, head: enough for three fully_shard groups."""

    VOCAB, DIM = 512, 256

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, self.DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.RMSNorm(self.DIM),
                nn.Linear(self.DIM, 4 * self.DIM),
                nn.SiLU(),
                nn.Linear(4 * self.DIM, self.DIM),
            )
            for _ in range(3)
        )
        self.head = nn.Linear(self.DIM, self.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _newton_schulz(g: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization: bf16, transposed to wide, 5 quintic iterations."""
    a, b, c = NS_COEFFS
    x = g.bfloat16()
    if g.size(0) > g.size(1):
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{name} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU self-test (torch {torch.__version__})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", type=Path, help="also write the results here")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run on the CPU with tiny sizes (tests this script only)",
    )
    args = parser.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "gpu_suite: no CUDA device is visible (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}); nothing was measured. "
            "Run it on a GPU machine with a CUDA build of torch, or use --cpu-smoke to "
            "self-test the script."
        )
        return 0
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    suite = Suite(device)
    t0 = time.perf_counter()
    print(f"gpu_suite on {suite.results['device']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        suite.check(
            "nccl_process_group_w1" if device.type == "cuda" else "gloo_process_group_w1",
            lambda: suite.process_group(Path(tmp)),
        )
        if dist.is_initialized():
            suite.check("comm_collectives", suite.collectives)
            suite.check("comm_streams_events", suite.streams)
            suite.check("fully_shard_training", suite.fully_shard_steps)
            suite.check("fully_shard_controls", suite.fully_shard_controls)
            suite.check("fully_shard_meta_init", suite.fully_shard_meta_init)
            suite.check("float8_all_gather", suite.float8_all_gather)
            suite.check("mxfp8_all_gather", suite.mxfp8_all_gather)
        suite.measure("ceilings", suite.ceilings)
        if hasattr(suite, "peak_tflops"):
            for rows, cols in suite.sizes["ns"]:
                suite.measure(
                    f"newton_schulz_{rows}x{cols}", lambda r=rows, c=cols: suite.newton_schulz(r, c)
                )
            suite.measure("quant8_blockwise", suite.quantization)
            suite.measure("flat_adamw", suite.adamw)
        if dist.is_initialized():
            dist.destroy_process_group()
    suite.results["wall_s"] = time.perf_counter() - t0
    suite.results["failures"] = suite.failures
    line = json.dumps({"benchmark": "gpu_suite", **suite.results})
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    print(
        f"{'PASS' if not suite.failures else 'FAILED: ' + ', '.join(suite.failures)} "
        f"in {suite.results['wall_s']:.0f} s"
    )
    return 1 if suite.failures else 0


if __name__ == "__main__":
    sys.exit(main())
