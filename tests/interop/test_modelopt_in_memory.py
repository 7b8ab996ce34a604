"""NVIDIA ModelOpt 0.47.0's in-memory FP8 fake quantization (recipe ``modelopt-fp8-in-memory``) and the
ModelOpt producer forward (``mode="producer"``: its in-memory QuantLinear holding the dequantized export).

Two kinds of evidence:
* the committed fixtures modelopt_fp8 / modelopt_fp8_pc_pt (tools/make_fp4_mx_fixtures.py): ModelOpt's own
  in-memory weight QDQ (``qdq_in_memory``), layer outputs (``y_in_memory``) and calibrated amax. Their
  probe inputs are not stored there; they are the llmc fixtures' ``<probe>.x`` (the same
  ``make_interop_fixtures.probe_inputs(PROBES)`` tensors, seed 99);
* ModelOpt itself on CPU (skipped without ``nvidia-modelopt``; ``tox -e modelopt``): ``mtq.quantize``
  with FP8_DEFAULT_CFG and FP8_PER_CHANNEL_PER_TOKEN_CFG on a tiny model built here, every fake-quantized
  weight and input and every layer output compared bit for bit, producer-mode layers and whole-model
  logits (with transformers, KV cache off) against ModelOpt holding the dequantized export, and its
  refusal of NVFP4 / MXFP8 on CPU.
"""

from __future__ import annotations

import copy
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fp8ref.checkpoint import load_checkpoint
from fp8ref.checkpoint.forward import producer_weight
from fp8ref.checkpoint.modelopt import _CPU_REFUSALS, static_input_amax
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import open_store, write_safetensors
from fp8ref.quant import QuantArgs, fake_quant, quantize

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
RECIPE = "modelopt-fp8-in-memory"
FIXTURES = {"modelopt_fp8": ("tensor", "modelopt-fp8"), "modelopt_fp8_pc_pt": ("channel", "modelopt-fp8-pc")}
F = torch.nn.functional
Q = "model.layers.0.self_attn.q_proj"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _refs(name: str) -> dict[str, torch.Tensor]:
    return load_file(ROOT / name / "reference_outputs.safetensors")


def _probe_x() -> dict[str, torch.Tensor]:
    return {k[: -len(".x")]: v for k, v in _refs("llmc_nvfp4").items() if k.endswith(".x")}


def _fq_input(x: torch.Tensor, gran: str, amax=None) -> torch.Tensor:
    if gran == "channel":  # FP8_PER_CHANNEL_PER_TOKEN: dynamic per-token inputs
        return fake_quant(x, QuantArgs(granularity="token"), recipe=RECIPE)
    return fake_quant(x, QuantArgs(granularity="tensor", dynamic=False), recipe=RECIPE, amax=amax)


# --- the committed fixtures: ModelOpt's in-memory model before export ------------------------

@pytest.mark.parametrize("name", FIXTURES)
def test_recipe_is_modelopts_in_memory_weight_qdq(name):
    gran, _ = FIXTURES[name]
    ref = _refs(name)
    keys = [k for k in ref if k.endswith(".qdq_in_memory")]
    assert len(keys) == 2
    for key in keys:
        w = ref["original." + key[: -len(".qdq_in_memory")]]
        assert torch.equal(_bits(fake_quant(w, QuantArgs(granularity=gran), recipe=RECIPE)), _bits(ref[key]))


@pytest.mark.parametrize("name", FIXTURES)
def test_recipe_gives_modelopts_in_memory_layer_outputs(name):
    """y_in_memory = linear(fq(x), fq(W)) in bf16: static inputs under ModelOpt's calibrated amax (FP8),
    per-token dynamic inputs (FP8_PER_CHANNEL_PER_TOKEN)."""
    gran, _ = FIXTURES[name]
    ref = _refs(name)
    xs = _probe_x()
    assert len(xs) == 3
    for layer, x in xs.items():
        w = fake_quant(ref["original." + layer], QuantArgs(granularity=gran), recipe=RECIPE)
        amax = ref.get(f"{layer}.in_memory_input_quantizer_amax")
        y = F.linear(_fq_input(x, gran, amax), w)
        assert torch.equal(_bits(y), _bits(ref[f"{layer}.y_in_memory"])), layer


# codes differing between the exporter's recipe and the in-memory one on the fixtures' original weights
CODE_MISMATCHES = {
    "modelopt_fp8": {"down_proj": 214, "gate_proj": 231, "up_proj": 239, "k_proj": 136, "o_proj": 230,
                     "q_proj": 110, "v_proj": 121},
    "modelopt_fp8_pc_pt": {"down_proj": 10, "gate_proj": 4, "up_proj": 1, "k_proj": 4, "o_proj": 2,
                           "q_proj": 10, "v_proj": 2},
}


@pytest.mark.parametrize("name", FIXTURES)
def test_what_modelopt_writes_is_not_what_it_runs(name):
    """The exporter divides (FP8: in D), the fake quant multiplies by fp32(fp32(1/amax)*448): the codes
    differ (FP8 2.61-6.64 % of each layer, per channel 0.01-0.24 %); the exporter's codes are the
    fixture's stored ones, the in-memory ones are not."""
    gran, export_recipe = FIXTURES[name]
    ref = _refs(name)
    ckpt = load_checkpoint(ROOT / name)
    counts = {}
    for layer_name, layer in ckpt.items():
        w = ref["original." + layer_name]
        written = quantize(w, QuantArgs(granularity=gran), recipe=export_recipe).codes.numpy()
        run = quantize(w, QuantArgs(granularity=gran), recipe=RECIPE).codes.numpy()
        assert np.array_equal(written, layer.weight_codes)
        counts[layer_name.rsplit(".", 1)[1]] = int((written != run).sum())
    assert counts == CODE_MISMATCHES[name]


# producer-mode outputs (exported codes) that differ from y_in_memory (the original weights' codes)
PRODUCER_VS_IN_MEMORY = {"modelopt_fp8": {"q_proj": 145, "k_proj": 97, "down_proj": 173},
                         "modelopt_fp8_pc_pt": {"q_proj": 9, "k_proj": 6, "down_proj": 5}}


@pytest.mark.parametrize("name", FIXTURES)
def test_producer_mode_runs_the_exported_codes(name):
    """Producer mode fake-quantizes the dequantized export W = bf16(fp32(q·s)) with amax = max|W|: that
    amax is ModelOpt's calibrated weight amax, and the codes come out as the exported ones (not the
    in-memory ones of the original weights); the static input amax recovered from input_scale is
    ModelOpt's calibrated one. So its outputs are not y_in_memory: that model ran other codes."""
    gran, _ = FIXTURES[name]
    ref = _refs(name)
    ckpt = load_checkpoint(ROOT / name)
    for layer_name, layer in ckpt.items():
        w = torch.from_numpy(producer_weight(layer, "bfloat16")).to(torch.bfloat16)
        q = quantize(w, QuantArgs(granularity=gran), recipe=RECIPE)
        assert np.array_equal(q.codes.numpy(), layer.weight_codes), layer_name
        amax = ref[f"{layer_name}.in_memory_weight_quantizer_amax"]
        mine = w.float().abs().amax() if gran == "tensor" else w.float().abs().amax(dim=1, keepdim=True)
        assert torch.equal(mine, amax), layer_name
        if gran == "tensor":
            a = static_input_amax(layer, "bfloat16")
            assert float(a) == ref[f"{layer_name}.in_memory_input_quantizer_amax"].item(), layer_name
    differ = {}
    for layer_name, x in _probe_x().items():
        y = ckpt[layer_name].forward(x, mode="producer")
        assert y.dtype == torch.bfloat16
        differ[layer_name.rsplit(".", 1)[1]] = int((_bits(y) != _bits(ref[f"{layer_name}.y_in_memory"])).sum())
    assert differ == PRODUCER_VS_IN_MEMORY[name]


@pytest.mark.parametrize("name", ["modelopt_mxfp8"])  # NVFP4: test_modelopt_nvfp4_producer.py
def test_no_producer_forward_where_modelopt_fake_quant_needs_cuda(name):
    ckpt = load_checkpoint(ROOT / name)
    algo = "NVFP4" if "nvfp4" in name else "MXFP8"
    with pytest.raises(CheckpointError, match=f"ModelOpt {algo}: its in-memory fake quantization runs on CUDA only"):
        ckpt[Q].forward(torch.zeros(1, 64, dtype=torch.bfloat16), mode="producer")


def test_producer_mode_refuses_a_float32_model_and_a_foreign_input_scale(tmp_path):
    layer = load_checkpoint(ROOT / "modelopt_fp8")[Q]
    with pytest.raises(CheckpointError, match=r"q_proj: mode='producer' for ModelOpt FP8 needs a bfloat16 or float16"):
        layer.forward(torch.zeros(1, 64), mode="producer")
    shutil.copytree(ROOT / "modelopt_fp8", tmp_path / "c")
    store = open_store(tmp_path / "c" / "model.safetensors")
    tensors = {n: (store.info(n).dtype, store.get(n)) for n in store}
    tensors[Q + ".input_scale"] = ("F32", np.array(0.1, np.float32))  # fp32(a/448) of no bf16 a
    write_safetensors(tmp_path / "c" / "model.safetensors", tensors, {"format": "pt"})
    bad = load_checkpoint(tmp_path / "c")[Q]
    with pytest.raises(CheckpointError, match=r"q_proj.input_scale: 0.1.* is fp32\(amax/448\) of no bfloat16 amax"):
        bad.forward(torch.zeros(1, 64, dtype=torch.bfloat16), mode="producer")


def test_modelopt_kv_scale_names_belong_to_the_attention_module():
    """``<attn>.k_proj.k_scale`` is the attention module's K scale (it was read as a K scale of
    ``<attn>.k_proj`` without a V scale)."""
    from fp8ref.nn.attention import kv_scales

    ckpt = load_checkpoint(ROOT / "modelopt_fp8")
    got = kv_scales(ckpt)
    assert list(got) == ["model.layers.0.self_attn"]
    ref = open_store(ROOT / "modelopt_fp8" / "model.safetensors")
    assert got["model.layers.0.self_attn"]["k"] == ref.get("model.layers.0.self_attn.k_proj.k_scale")
    assert got["model.layers.0.self_attn"]["v"] == ref.get("model.layers.0.self_attn.v_proj.v_scale")


def test_whole_model_with_modelopt_kv_cache():
    """Reference mode quantizes K and V with the stored scales; producer mode refuses the KV cache
    (ModelOpt's own KV fake quantization is not modelled) instead of applying compressed-tensors'."""
    pytest.importorskip("transformers")
    from fp8ref.errors import ModelError
    from fp8ref.nn import build_model, set_mode

    model = build_model(ROOT / "modelopt_fp8", mode="reference")
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
        set_mode(model, "producer")
        with pytest.raises(ModelError, match=r"this checkpoint's KV cache: ModelOpt's own KV-cache fake"):
            model(ids)


# --- ModelOpt itself, on CPU -----------------------------------------------------------------

@pytest.fixture(scope="module")
def mtq():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("modelopt.torch.quantization")


class Tiny(torch.nn.Module):
    """The fixtures' seven bf16 linears side by side, each fed its own input (no transformers needed)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.names = sorted(weights)
        self.layers = torch.nn.ModuleDict()
        for n in self.names:
            w = weights[n]
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            self.layers[n] = lin

    def forward(self, xs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: self.layers[n](xs[n]) for n in self.names}


def _original_weights() -> dict[str, torch.Tensor]:
    return {k[len("original."):].rsplit(".", 1)[1]: v for k, v in _refs("modelopt_fp8").items()
            if k.startswith("original.")}


def _inputs(model: Tiny, seed: int, scale: float = 1.0, hard: bool = False) -> dict[str, torch.Tensor]:
    """Heavy-tailed bf16 [2, 8, in] per layer; ``hard``: beyond the calibrated range (clamped by static
    quantizers), a zero token, a token <= 2^-24 (a zero amax to ModelOpt), one just above, -0."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in model.names:
        k = model.layers[n].in_features
        x = torch.randn(2, 8, k, generator=g) * scale * torch.exp(torch.randn(2, 8, k, generator=g))
        x = x.to(torch.bfloat16)
        if hard:
            x[0, 0] = 0.0
            x[0, 1] = 2.0 ** -24
            x[0, 2] = x[0, 2].sign() * 2.0 ** -24 * 1.0078125
            x[0, 3, :5] = -0.0
            x[1, 0, :2] = torch.tensor([512.0, -1024.0])  # above every calibrated amax here
        out[n] = x
    return out


def _quantized(mtq, cfg_name: str, weights: dict[str, torch.Tensor], calib=None) -> Tiny:
    model = Tiny(weights)
    batches = calib or [_inputs(model, 77 + i) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, copy.deepcopy(getattr(mtq, cfg_name)), forward_loop=lambda m: [m(b) for b in batches])
    return model


@pytest.mark.parametrize("cfg_name,gran", [("FP8_DEFAULT_CFG", "tensor"), ("FP8_PER_CHANNEL_PER_TOKEN_CFG", "channel")])
def test_recipe_equals_modelopt_fake_quant_on_cpu(mtq, cfg_name, gran):
    model = _quantized(mtq, cfg_name, _original_weights())
    probe = _inputs(model, 5, scale=1.5, hard=True)
    for n in model.names:
        mod, x = model.layers[n], probe[n]
        with torch.no_grad():
            w_mo, x_mo, y_mo = mod.weight_quantizer(mod.weight), mod.input_quantizer(x), mod(x)
        w = fake_quant(mod.weight.detach(), QuantArgs(granularity=gran), recipe=RECIPE)
        amax = None if gran == "channel" else mod.input_quantizer.amax
        xq = _fq_input(x, gran, amax)
        assert torch.equal(_bits(w), _bits(w_mo)), n
        assert torch.equal(_bits(xq), _bits(x_mo)), n
        assert torch.equal(_bits(F.linear(xq, w)), _bits(y_mo)), n
        if gran == "tensor":  # the hard tokens are clamped: the probe exceeds the calibrated amax
            assert float(x.float().abs().max()) > float(amax)


@pytest.mark.parametrize("name,cfg_name", [("modelopt_fp8", "FP8_DEFAULT_CFG"),
                                           ("modelopt_fp8_pc_pt", "FP8_PER_CHANNEL_PER_TOKEN_CFG")])
def test_producer_mode_equals_modelopt_holding_the_dequantized_export(mtq, name, cfg_name):
    """ModelOpt's in-memory model with every linear's weight set to the export dequantized (bf16(fp32(q·s)))
    and max-calibrated; FP8 inputs take the fixture's calibrated input amax (the export's calibration ran
    through the Llama model). Producer mode's output equals that model's for every layer."""
    ckpt = load_checkpoint(ROOT / name)
    ref = _refs(name)
    short = {n.rsplit(".", 1)[1]: n for n in ckpt}
    weights = {s: torch.from_numpy(producer_weight(ckpt[n], "bfloat16")).to(torch.bfloat16) for s, n in short.items()}
    model = _quantized(mtq, cfg_name, weights)
    if cfg_name == "FP8_DEFAULT_CFG":
        for s, n in short.items():
            model.layers[s].input_quantizer.amax = ref[f"{n}.in_memory_input_quantizer_amax"].to(torch.bfloat16)
    for seed, hard in ((11, False), (12, True)):
        xs = _inputs(model, seed, scale=1.5, hard=hard)
        for s, n in short.items():
            with torch.no_grad():
                y_mo = model.layers[s](xs[s])
            assert torch.equal(_bits(ckpt[n].forward(xs[s], mode="producer")), _bits(y_mo)), n


@pytest.mark.parametrize("algo,cfg_name", [("NVFP4", "NVFP4_DEFAULT_CFG"), ("MXFP8", "MXFP8_DEFAULT_CFG")])
def test_modelopt_block_fake_quant_refuses_cpu(mtq, algo, cfg_name):
    """Calibration runs on CPU; the quantized forward and the weight quantizer raise what
    fp8ref.checkpoint.modelopt records (so no in-memory reference, and no producer mode, for these)."""
    model = _quantized(mtq, cfg_name, _original_weights())
    mod = model.layers["q_proj"]
    kind, _, message = _CPU_REFUSALS[algo].partition(": ")
    for call in (lambda: mod(torch.zeros(1, 64, dtype=torch.bfloat16)), lambda: mod.weight_quantizer(mod.weight)):
        with pytest.raises({"AssertionError": AssertionError, "RuntimeError": RuntimeError}[kind],
                           match=message.replace(".", r"\.")):
            with torch.no_grad():
                call()


@pytest.mark.parametrize("name,cfg_name", [("modelopt_fp8", "FP8_DEFAULT_CFG"),
                                           ("modelopt_fp8_pc_pt", "FP8_PER_CHANNEL_PER_TOKEN_CFG")])
def test_whole_model_producer_logits_equal_modelopt(mtq, name, cfg_name):
    """The fixture's Llama built by fp8ref in producer mode (KV-cache quantization off: not modelled)
    against transformers' Llama holding the same tensors (quantized linears: the dequantized export),
    quantized in memory by ModelOpt without its KV config: logits bit for bit."""
    transformers = pytest.importorskip("transformers")
    from fp8ref._arrays import torch_of
    from fp8ref.nn import build_model

    ckpt = load_checkpoint(ROOT / name)
    ours = build_model(ckpt, mode="producer", kv_cache=False)
    cfg = dict(ckpt.config)
    cfg.pop("quantization_config")
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    state = model.state_dict()
    with torch.no_grad():
        for n in ckpt.unquantized:
            state[n].copy_(torch_of(ckpt.tensor(n)))
        for n, layer in ckpt.items():
            state[n + ".weight"].copy_(torch.from_numpy(producer_weight(layer, "bfloat16")).to(torch.bfloat16))
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, config.vocab_size, (1, 16), generator=g) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, copy.deepcopy(getattr(mtq, cfg_name)), forward_loop=lambda m: [m(c) for c in calib])
    if cfg_name == "FP8_DEFAULT_CFG":  # the export's calibrated input amax (calibration is not rerun here)
        ref = _refs(name)
        for n in ckpt:
            model.get_submodule(n).input_quantizer.amax = ref[f"{n}.in_memory_input_quantizer_amax"].to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        assert torch.equal(_bits(ours(ids).logits), _bits(model(ids).logits))
