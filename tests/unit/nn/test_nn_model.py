"""fp8ref.nn in the default suite (torch, no transformers): Fp8RefLinear, swap_linears, modes,
load_unquantized, on the committed tiny Llamas written by llm-compressor and auto-round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fp8ref
from fp8ref._arrays import torch_of
from fp8ref.errors import ModelError
from fp8ref.nn import Fp8RefLinear, fp8ref_layers, load_unquantized, parse_mode, parse_modes, set_mode, swap_linears
from tests.support.tiny_llama import LAYERS, LINEARS, HandLinear, TinyLlama

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def _swap_hand(model, ckpt):
    for name in ckpt:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, HandLinear(ckpt[name]))


@pytest.mark.parametrize("fixture", ["llmc_fp8", "llmc_fp8_dynamic", "autoround_fp8_static"])
def test_reference_fp32_equals_hand_written_fp32_model(fixture):
    """Evidence (issue 11): every quantized linear of a real tool's checkpoint run by fp8ref with
    accumulate="fp32" inside a float32 model gives logits bit-identical to the same model whose
    linears are written by hand from docs/matmul.md with torch's float8 cast."""
    ckpt = fp8ref.load_checkpoint(CKPTS / fixture)
    ours, hand = TinyLlama(), TinyLlama()
    report = swap_linears(ours, ckpt, mode="reference:fp32")
    assert report.unplaced == [] and len(report.swapped) == LAYERS * len(LINEARS) == len(ckpt)
    load_unquantized(ours, ckpt)
    _swap_hand(hand, ckpt)
    load_unquantized(hand, ckpt)
    with torch.no_grad():
        a, b = ours(IDS), hand(IDS)
    assert a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    set_mode(ours, "reference")  # exact accumulation: a different rounding somewhere in 2 x 9 x 128 logits
    with torch.no_grad():
        c = ours(IDS)
    assert not torch.equal(c, a) and (c - a).abs().max() < 1e-2


def test_swap_reports_what_it_cannot_place():
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")
    m = TinyLlama()
    m.model.layers[0].mlp.up_proj = torch.nn.Identity()
    m.model.layers[1].self_attn.k_proj = torch.nn.Linear(64, 48, bias=False)
    del m.model.layers[1].mlp.gate_proj
    report = swap_linears(m, ckpt)
    assert dict(report.unplaced) == {
        "model.layers.0.mlp.up_proj": "is a Identity, not an nn.Linear",
        "model.layers.1.self_attn.k_proj": "nn.Linear is [48, 64], the checkpoint's weight [32, 64]",
        "model.layers.1.mlp.gate_proj": "no module of that name"}
    assert len(report.swapped) == 11 and len(fp8ref_layers(m)) == 11
    with pytest.raises(ModelError, match=r"^x: 3 quantized layers could not be placed in the model: "):
        report.raise_unplaced("x")


def test_load_unquantized_leftover_and_missing_keys_are_errors():
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")
    m = TinyLlama()
    swap_linears(m, ckpt)
    m.extra = torch.nn.Linear(2, 2)
    with pytest.raises(ModelError, match=r"2 model tensors missing from the checkpoint, e.g. \['extra.bias'"):
        load_unquantized(m, ckpt)
    m = TinyLlama()  # nothing swapped: the quantized layers' weights are missing
    with pytest.raises(ModelError, match=r"14 model tensors missing"):
        load_unquantized(m, ckpt)
    m = TinyLlama()
    swap_linears(m, ckpt)
    del m.model.norm
    with pytest.raises(ModelError, match=r"1 tensors the model has no place for, e.g. \['model.norm.weight'\]"):
        load_unquantized(m, ckpt)


def test_modes_parse_and_need_what_they_use():
    assert [str(m) for m in parse_modes("reference, producer,reference:fp32,original,backend:torch")] == [
        "reference", "producer", "reference:fp32", "original", "backend:torch"]
    assert parse_mode("reference", accumulate="fp32-limited").arg == "fp32-limited"
    for bad, msg in (("refrence", "expected one of original"), ("reference:fp16", "accumulation 'fp16'"),
                     ("backend", "name the backend"), ("producer:x", "takes no ':' argument")):
        with pytest.raises(ModelError, match=msg):
            parse_mode(bad)
    with pytest.raises(ModelError, match="reference given twice"):
        parse_modes("reference,reference:exact")
    layer = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")["model.layers.0.self_attn.k_proj"]
    with pytest.raises(ModelError, match=r"k_proj: mode 'original' needs the original weights"):
        Fp8RefLinear(layer, "original")
    with pytest.raises(ModelError, match=r"mode backend:torch needs its backend object"):
        Fp8RefLinear(layer, "backend:torch")


def test_layer_modes_against_the_tools_reloaded_outputs():
    """producer mode reproduces the tool's own reloaded Linear output (reference_outputs.safetensors,
    written by transformers + compressed-tensors / auto-round) bit for bit; reference differs."""
    for fixture in ("llmc_fp8", "llmc_fp8_dynamic", "autoround_fp8_static"):
        ckpt = fp8ref.load_checkpoint(CKPTS / fixture)
        outs = fp8ref.load_checkpoint(CKPTS / fixture / "reference_outputs.safetensors")
        for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
            x, y = torch_of(outs.tensor(f"{name}.x")), torch_of(outs.tensor(f"{name}.y"))
            lin = Fp8RefLinear(ckpt[name], "producer")
            assert torch.equal(lin(x).view(torch.int16), y.view(torch.int16)), (fixture, name)
            assert lin.run(x, "reference").dtype == torch.bfloat16


def test_original_mode_is_the_unquantized_linear():
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")
    orig = fp8ref.load_checkpoint(CKPTS / "original_bf16")
    m = TinyLlama(torch.bfloat16)
    swap_linears(m, ckpt, mode="original", original=orig)
    load_unquantized(m, ckpt)
    plain = TinyLlama(torch.bfloat16)
    load_unquantized(plain, orig)  # every tensor of the original is unquantized
    with torch.no_grad():
        assert torch.equal(m(IDS), plain(IDS))


def test_backend_mode_runs_torch_scaled_mm():
    from fp8ref.conformance.backend import load_backend

    torch_backend = load_backend("torch")
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8_dynamic")
    m = TinyLlama(torch.bfloat16)
    swap_linears(m, ckpt, mode="backend:torch", backend=torch_backend)
    load_unquantized(m, ckpt)
    with torch.no_grad():
        got = m(IDS)
        set_mode(m, "reference:fp32")
        ref = m(IDS)
    lin = fp8ref_layers(m)["model.layers.0.mlp.up_proj"]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = lin.run(x, "backend:torch")
    assert lin.last_backend_params == {"format": "float8_e4m3fn", "scales": "row", "out_dtype": "bfloat16",
                                       "bias": False, "accumulate": "fp32", "scale_order": "operands"}
    # torch's BLAS order is unspecified: close to the declared fp32 order, not bit-exact by contract
    assert torch.isfinite(got).all() and (got.float() - ref.float()).abs().max() < 0.1
    assert (y.float() - lin.run(x, "reference:fp32").float()).abs().max() < 0.05


def test_build_model_without_transformers_says_what_to_install(monkeypatch):
    from fp8ref.nn import build_model

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelError, match=r"build_model needs transformers, which is not installed: "
                                         r"pip install 'fp8ref\[hf\]'"):
        build_model(CKPTS / "llmc_fp8")


def _float64_arrays(obj, seen=None) -> list:
    """Every float64 numpy array or torch tensor reachable from ``obj``'s attributes (dicts, lists,
    tuples and objects with a __dict__ followed; modules through their own attributes)."""
    import numpy as np

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return [obj] if obj.dtype == np.float64 else []
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.dtype == torch.float64 else []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return []
    return [a for x in items for a in _float64_arrays(x, seen)]


def test_meta_build_gives_the_logits_of_a_model_built_with_its_weights():
    """Parameters made on the meta device (never initialised) and given the checkpoint's tensors by
    load_unquantized: the same logits, bit for bit, as a model whose parameters were allocated,
    initialised and then overwritten (the previous build); nothing is left on the meta device."""
    from fp8ref.nn.model import parameters_on_meta

    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8_dynamic")
    with parameters_on_meta():
        lazy = TinyLlama(torch.bfloat16)
    assert all(p.device.type == "meta" for p in lazy.parameters())
    built = TinyLlama(torch.bfloat16)
    for m in (lazy, built):
        swap_linears(m, ckpt)
        load_unquantized(m, ckpt)
    assert not [n for n, p in lazy.named_parameters() if p.device.type == "meta"]
    with torch.no_grad():
        a, b = lazy(IDS), built(IDS)
    assert a.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_no_float64_weight_is_kept_by_default_and_keeping_one_changes_no_byte():
    """After exact forwards (a decode step of one token, and 18 tokens) no layer holds a float64
    array; keep_decoded=True gives the same bytes (and holds its weight's float64 form)."""
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8_dynamic")
    outs = {}
    for keep in (False, True):
        m = TinyLlama(torch.bfloat16)
        swap_linears(m, ckpt, keep_decoded=keep)
        load_unquantized(m, ckpt)
        with torch.no_grad():
            outs[keep] = [m(IDS[:1, :1]), m(IDS)]
        held = [a for lin in fp8ref_layers(m).values() for a in _float64_arrays(lin)]
        if keep:
            assert len(held) >= len(ckpt)
        else:
            assert held == []
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_original_weights_from_a_checkpoint_are_read_when_used_not_held():
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")
    orig = fp8ref.load_checkpoint(CKPTS / "original_bf16")
    m = TinyLlama(torch.bfloat16)
    swap_linears(m, ckpt, mode="original", original=orig)
    lin = fp8ref_layers(m)["model.layers.1.mlp.down_proj"]
    assert lin.original_weight is None and lin.original_bias is None
    before = orig.store.bytes_read
    w, b = lin.original_tensors()
    assert b is None and orig.store.bytes_read - before == w.numel() * 2
    stored = torch_of(orig.tensor("model.layers.1.mlp.down_proj.weight"))
    assert torch.equal(w.view(torch.int16), stored.view(torch.int16))
    with pytest.raises(ModelError, match=r"^original: no tensor model\.layers\.\d\.\S+\.weight for the quantized"):
        swap_linears(TinyLlama(), ckpt, original={})


def test_meta_build_ties_what_the_model_ties_from_the_one_name_the_checkpoint_has(tmp_path):
    import numpy as np

    from fp8ref.io.safetensors import save
    from fp8ref.nn.model import parameters_on_meta

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("table", torch.arange(3.0), persistent=False)

    w = np.arange(15, dtype=np.float32).reshape(5, 3)
    save(tmp_path / "model.safetensors", {"embed.weight": w})
    ckpt = fp8ref.load_checkpoint(tmp_path)
    with parameters_on_meta():
        m = Tied()
    assert m.table.device.type == "cpu" and m.embed.weight.device.type == "meta"  # buffers are made for real
    load_unquantized(m, ckpt)
    assert m.head.weight is m.embed.weight and torch.equal(m.head.weight, torch.from_numpy(w))
