"""fully_shard and the optimizers on model families other than the LLaMA recipe's, against one
process: a CNN (4-D conv weights, BatchNorm buffers in train and eval mode) under torch's
AdamW, AdamW8bit, Shampoo and SOAP (merged dims) and Muon (conv weights go to its AdamW
groups; a 4-D weight in a Muon group is refused); a transformer encoder layer (packed
attention projections, LayerNorm with bias, eval fast path), an Embedding with
``padding_idx`` and a GRU, also under activation checkpointing; compiled conv blocks; tied
input/output embeddings; blocks returning dicts, dataclasses, custom objects and closures
holding their tensors; a module that moves its weight onto storage of its own (as cuDNN's
``flatten_parameters`` does).

Every rank sees the whole batch, so BatchNorm's statistics are the single process's and the
averaged gradient is each rank's own (exactly at W=2)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from raggedfsdp import fully_shard
from raggedfsdp.optim import SOAP, AdamW8bit, Muon, Shampoo, split_muon_params


# ----------------------------------------------------------------------------- models
class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ConvBlock(3, 8), ConvBlock(8, 8)])
        self.proj = nn.Linear(8, 8)  # a Muon matrix
        self.classifier = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.classifier(torch.tanh(self.proj(x.mean((2, 3)))))


class Seq(nn.Module):
    """Embedding with a padding row, a transformer encoder layer, a GRU, a LayerNorm, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 16, padding_idx=0)
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens))
        return self.head(self.norm(self.rnn(h)[0]))


class Tied(nn.Module):
    """HF style: the head's weight is the embedding's Parameter object."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.lm_head = nn.Linear(16, 11, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.lm_head(h)


# ----------------------------------------------------------------------------- harness
def _batch(name: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    if name.startswith("cnn"):
        return torch.randn(4, 3, 5, 5, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 11, (3, 6), generator=gen)
    tokens[:, -1] = 0  # padding positions
    return tokens


def _build(name: str) -> tuple[nn.Module, list[nn.Module]]:
    """The model (float64) and the submodules wrapped before the root: ``cnn_compiled`` with
    compiled blocks, ``seq_checkpointed`` with its encoder layer and GRU under torchtitan's
    activation checkpointing (``checkpoint_wrapper``; in the reference too)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    if name.startswith("cnn"):
        model = SmallCNN().double()
        if name == "cnn_compiled":
            for block in model.blocks:
                block.compile(backend="aot_eager")
        return model, list(model.blocks)
    if name.startswith("seq"):
        model = Seq().double()
        if name == "seq_checkpointed":
            model.encoder = checkpoint_wrapper(model.encoder)
            model.rnn = checkpoint_wrapper(model.rnn)
        return model, [model.encoder, model.rnn]
    model = Tied().double()
    return model, list(model.layers)


def _optimizers(kind: str, model: nn.Module, sharded: bool) -> list[torch.optim.Optimizer]:
    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)]
    if kind == "adamw8bit":
        return [AdamW8bit(model.parameters(), lr=0.02, min_8bit_size=0)]
    if kind in ("shampoo", "soap"):
        opt = Shampoo if kind == "shampoo" else SOAP
        return [opt(model.parameters(), lr=0.02, merge_dims=True, precondition_frequency=1)]
    if sharded:  # Muon: the conv weights (4-D) go to its AdamW groups
        return [Muon(split_muon_params(model), lr=0.02)]
    muon, other = ([p for _, p in g["params"]] for g in split_muon_params(model))
    return [
        torch.optim.Muon(muon, lr=0.02),
        torch.optim.AdamW(other, lr=0.02, betas=(0.9, 0.95), weight_decay=0.1),
    ]


POLICIES = {
    "adamw8bit": AdamW8bit.shard_policy(min_8bit_size=0),
    "shampoo": Shampoo.shard_policy(merge_dims=True),
    "soap": SOAP.shard_policy(merge_dims=True),
    "muon": Muon.shard_policy(),
}


def _loss(name: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if name.startswith("cnn"):
        return out.square().mean()
    return nn.functional.cross_entropy(out.flatten(0, 1), x.roll(1, 1).flatten())


def _train(name: str, kind: str, steps: int = 3) -> dict:
    """Train the wrapped model and the plain one on the same batches; the largest differences
    of parameters, buffers and of an evaluation forward after training."""
    model, blocks = _build(name)
    reference = copy.deepcopy(model)
    for block in blocks:
        fully_shard(block, shard_policy=POLICIES.get(kind))
    fully_shard(model, shard_policy=POLICIES.get(kind))
    opts = {id(model): _optimizers(kind, model, True)}
    opts[id(reference)] = _optimizers(kind, reference, False)
    for step in range(steps):
        x = _batch(name, step)
        for m in (model, reference):
            _loss(name, m(x), x).backward()
            for opt in opts[id(m)]:
                opt.step()
                opt.zero_grad()
    outputs, fast = [], torch._transformer_encoder_layer_fwd
    fast_path_calls = []  # the encoder layer's fused evaluation kernel, on gathered weights
    torch._transformer_encoder_layer_fwd = lambda *a: fast_path_calls.append(1) or fast(*a)
    for m in (model, reference):
        m.eval()
        with torch.no_grad():
            outputs.append(m(_batch(name, steps)))
        m.train()
    torch._transformer_encoder_layer_fwd = fast
    ours = {n: p.full_tensor() for n, p in model.named_parameters()}
    theirs = dict(reference.named_parameters())
    return {
        "params": max((ours[n] - theirs[n]).abs().max().item() for n in theirs),
        "names": sorted(ours) == sorted(theirs),
        "buffers": max(
            [0.0]
            + [
                (a.double() - b.double()).abs().max().item()
                for a, b in zip(model.buffers(), reference.buffers(), strict=True)
            ]
        ),
        "eval": (outputs[0] - outputs[1]).abs().max().item(),
        "fast_path_calls": len(fast_path_calls),
    }


CASES = [
    ("cnn", "adamw"),
    ("cnn", "adamw8bit"),
    ("cnn", "shampoo"),
    ("cnn", "soap"),
    ("cnn", "muon"),
    ("seq", "adamw"),
    ("seq_checkpointed", "adamw"),
    ("tied", "adamw"),
]


#: Evaluation forwards taking the encoder layer's fused path: torch refuses it to a layer with
#: hooks (a wrapped one, here as under FSDP2), so only the reference's; under a wrapped
#: ``checkpoint_wrapper`` the layer has none and runs it on the gathered weights.
FAST_PATH_CALLS = {"seq": 1, "seq_checkpointed": 2}


def _check(pool, cases: list[tuple[str, str]]) -> None:
    for name, kind in cases:
        for res in pool.run(_train, name, kind):
            tol = 1e-6 if kind == "adamw8bit" else 1e-10
            assert res["names"], (name, kind)
            assert res["params"] < tol and res["buffers"] < tol, (name, kind, res)
            assert res["eval"] < tol, (name, kind, res)
            assert res["fast_path_calls"] == FAST_PATH_CALLS.get(name, 0), (name, res)


@pytest.mark.parametrize("world_size", [2, 3])
def test_other_model_families_train_as_one_process(pool, world_size):
    _check(pool, CASES)


@pytest.mark.parametrize("world_size", [2])
def test_compiled_conv_blocks_with_batchnorm_train_as_one_process(pool):
    """BatchNorm's running statistics are updated inside the compiled graph."""
    _check(pool, [("cnn_compiled", "adamw")])


def test_a_conv_weight_in_a_muon_group_is_refused_with_the_fix():
    """torch's Muon refuses non-2-D parameters; so does ours, naming the AdamW group as the
    fix (``split_muon_params`` puts conv weights there, as trained above)."""
    model = SmallCNN()
    with pytest.raises(ValueError, match=r"shape \(8, 3, 3, 3\).*use_muon=False group"):
        Muon(model.parameters())
    groups = split_muon_params(model)
    assert [n for n, _ in groups[0]["params"]] == ["proj.weight"]


# ----------------------------------------------------------------------------- outputs
@dataclass
class Pair:
    hidden: torch.Tensor
    aux: torch.Tensor


class Holder:
    """A custom object that is no pytree node."""

    def __init__(self, hidden: torch.Tensor, aux: torch.Tensor) -> None:
        self.hidden, self.aux = hidden, aux


class Block(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.lin, self.form = nn.Linear(8, 8), form

    def forward(self, x: torch.Tensor) -> object:
        hidden, aux = torch.tanh(self.lin(x)), self.lin.weight.square().sum()
        if self.form == "dict":
            return {"hidden": hidden, "aux": aux}
        if self.form == "list_in_dict":
            return {"out": [hidden, (aux,)]}
        if self.form == "closure":  # found by no search: the group stays gathered
            return lambda: Holder(hidden, aux)
        return (Pair if self.form == "dataclass" else Holder)(hidden, aux)


class Outputs(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.first, self.second = Block(form), Block(form)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = torch.zeros((), dtype=x.dtype)
        for block in (self.first, self.second):
            out = block(x)
            out = out() if callable(out) else out
            if isinstance(out, dict) and "out" in out:
                x, aux = out["out"][0], aux + out["out"][1][0]
            elif isinstance(out, dict):
                x, aux = out["hidden"], aux + out["aux"]
            else:
                x, aux = out.hidden, aux + out.aux
        return self.head(x).square().mean() + 0.01 * aux


def _outputs(form: str) -> float:
    torch.manual_seed(0)
    model = Outputs(form).double()
    reference = copy.deepcopy(model)
    fully_shard(model.first)
    fully_shard(model.second)
    fully_shard(model)
    return _train_beside(model, reference, steps=2, loss=lambda y: y)


@pytest.mark.parametrize("world_size", [2])
def test_blocks_returning_dicts_dataclasses_and_custom_objects_train_as_one_process(pool):
    for form in ("dict", "list_in_dict", "dataclass", "custom", "closure"):
        assert max(pool.run(_outputs, form)) < 1e-12, form


# ----------------------------------------------------------------------------- rebinding
class Rebinding(nn.Module):
    """Rebinds its weight's storage on the first forward that sees new weight objects, as
    cuDNN's ``flatten_parameters`` does for an RNN on CUDA (the RNN's forward calls it when
    its weights changed; it copies them into one buffer and ``set_``s each onto its slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self._seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if id(self.lin.weight) not in self._seen:
            self._seen.append(id(self.lin.weight))
            with torch.no_grad():
                self.lin.weight.set_(self.lin.weight.clone())
        return torch.tanh(self.lin(x))


def _rebinding() -> float:
    torch.manual_seed(0)
    model = nn.Sequential(Rebinding(), nn.Linear(8, 2)).double()
    reference = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    return _train_beside(model, reference, steps=3, loss=lambda y: y.square().mean())


def _train_beside(
    model: nn.Module, reference: nn.Module, steps: int, loss: Callable[[Any], torch.Tensor]
) -> float:
    """Train the sharded ``model`` and its unsharded ``reference`` with torch's AdamW on the
    same inputs; the largest parameter difference afterwards."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.02)
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).double()
        for m, o in ((model, opt), (reference, ref_opt)):
            loss(m(x)).backward()
            o.step()
            o.zero_grad()
    return max(
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )


@pytest.mark.parametrize("world_size", [2])
def test_a_module_that_rebinds_its_weights_storage_trains_as_one_process(pool):
    assert max(pool.run(_rebinding)) < 1e-12


def test_output_search_handles_slots_cycles_and_modules():
    from raggedfsdp.fsdp.outputs import output_tensors

    class Slotted:
        __slots__ = ("other", "value")

    leaf, frozen = torch.ones(2, requires_grad=True), torch.ones(2)
    obj = Slotted()
    obj.value, obj.other = [leaf, frozen], None
    holder = Holder(obj, leaf * 2)
    holder.self_ref = holder  # a cycle
    holder.module = nn.Linear(2, 2)  # its parameters are not outputs
    found = output_tensors({"a": holder, "b": (leaf,)})
    assert [id(t) for t in found] == [id(leaf), id(holder.aux)]


def test_batchnorm_under_bf16_compute_in_an_fp32_group_of_its_own():
    """torch's BatchNorm refuses bf16 weights beside its fp32 running statistics (on CPU, with
    or without FSDP); each norm wrapped first without ``param_dtype`` computes with fp32
    weights on the bf16 activations, and its statistics stay fp32."""
    from raggedfsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = SmallCNN()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block.norm)
        fully_shard(block, mp_policy=bf16)
    fully_shard(model, mp_policy=bf16)
    before = model.blocks[0].norm.running_mean.clone()
    out = model(torch.randn(4, 3, 5, 5))
    out.float().square().mean().backward()
    assert out.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    stats = model.blocks[0].norm.running_mean
    assert stats.dtype == torch.float32 and not torch.equal(stats, before)
