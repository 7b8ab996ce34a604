"""NVFP4 / MX layers under ``reference:ACC`` and ``backend:NAME`` (``fp8ref.matmul.block_scaled``), on the
committed tool-made fixtures' layers.

- ``reference:fp32`` against a scalar float32 oracle written from the definition: per 16/32-element
  block a sequential fp32 sum of fp32 products, times fp32(sa * sb), added in fp32; then
  fp32(acc * alpha) + bias, rounded once to bf16 (alpha: vLLM's fold of the NVFP4 globals);
- ``reference:KERNEL`` against the tensor-core instruction (``fp8ref.hardware.mma``, checked against
  MMA-Sim in tests/hardware) issued step by step along K with C chained, then the same epilogue;
- every pair without a definition refused before any forward with one line naming the layer;
- ``backend:NAME``: a backend declaring ``scales: block16/block32`` that computes fp8ref's fp32
  model equals ``reference:fp32`` bit for bit, one reading the scales in the wrong layout does not.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import fp8ref
from fp8ref.conformance import Backend
from fp8ref.conformance.backend import load_backend
from fp8ref.errors import Fp8RefError
from fp8ref.formats import FORMATS
from fp8ref.nn import Fp8RefLinear
from tests.support.matmul_oracle import round_fraction

torch = pytest.importorskip("torch")

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
W4A4 = {"llmc_nvfp4": "blackwell-nvfp4", "modelopt_nvfp4": "blackwell-nvfp4", "llmc_mxfp4": "blackwell-mxfp4",
        "quark_mxfp4": "blackwell-mxfp4", "llmc_mxfp8": "blackwell-mxfp8", "modelopt_mxfp8": "blackwell-mxfp8"}
LAYERS = ["model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"]  # K = 64 and 128
F32 = np.float32


def _layer(name: str, layer_name: str):
    return fp8ref.load_checkpoint(CKPTS / name)[layer_name]


def _x(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, k, generator=g) * torch.exp(2 * torch.randn(1, 3, k, generator=g))
    x[0, 0, :32] = 0.0
    return x.to(torch.bfloat16)


def _operands(layer, x):
    """Input codes (M, K) and float32 block scales, weight codes (N, K) and float32 block scales (N, KB)."""
    from fp8ref.checkpoint.forward import quantize_block_input

    qx = quantize_block_input(layer, x)
    codes = np.asarray(qx.codes).reshape(-1, layer.shape[1])
    sx = np.asarray(qx.scale, F32).reshape(codes.shape[0], -1)
    return codes, sx, layer.weight_codes, np.asarray(layer.weight_scale, F32).reshape(layer.shape[0], -1)


def _alpha(layer) -> np.float32 | None:
    q = layer.quant
    if q.global_scale is None:
        return None
    g_w = F32(np.asarray(layer.weight_global, F32).reshape(-1)[0])
    g_x = None if q.input is None else F32(np.asarray(layer.input_scale, F32).reshape(-1)[0])
    if q.global_scale == "divisor":  # vLLM: each global inverted in fp32, then multiplied in fp32
        return F32(1) / g_w if g_x is None else F32((F32(1) / g_x) * (F32(1) / g_w))
    return g_w if g_x is None else F32(g_x * g_w)


def _epilogue(acc: float, alpha, bias) -> float:
    v = F32(acc)
    if alpha is not None:
        v = F32(v * alpha)
    if bias is not None:
        v = F32(v + F32(bias))
    return round_fraction(Fraction(float(v)), "bfloat16")


def _bits(t: torch.Tensor) -> list:
    return t.contiguous().view(torch.int16).reshape(-1).tolist()


@pytest.mark.parametrize("name", [*W4A4, "llmc_nvfp4a16"])
@pytest.mark.parametrize("layer_name", LAYERS)
def test_fp32_accumulation_equals_the_scalar_oracle(name, layer_name):
    layer = _layer(name, layer_name)
    x = _x(layer.shape[1], 5)
    q = layer.quant
    block = 16 if q.weight_strategy == "nvfp4" else 32
    wdec = fp8ref.decode(layer.weight_codes, q.weight_fmt)
    sw = np.asarray(layer.weight_scale, F32).reshape(layer.shape[0], -1)
    bias = None if layer.bias is None else np.asarray(layer.bias).astype(F32)
    alpha = _alpha(layer)
    want = []
    if q.input is None:  # weight-only: one sequential fp32 sum of fp32(x_k * fp32(w_k * s_b))
        xs = x.float().reshape(-1, layer.shape[1]).numpy()
        for row in xs:
            for n in range(layer.shape[0]):
                acc = F32(0)
                for k in range(layer.shape[1]):
                    acc = F32(acc + F32(row[k] * F32(wdec[n, k] * sw[n, k // block])))
                want.append(_epilogue(acc, alpha, None if bias is None else bias[n]))
    else:
        codes, sx, _, _ = _operands(layer, x)
        xdec = fp8ref.decode(codes, q.input_fmt)
        for m in range(codes.shape[0]):
            for n in range(layer.shape[0]):
                total = F32(0)
                for b in range(sx.shape[1]):
                    part = F32(0)
                    for k in range(b * block, min((b + 1) * block, layer.shape[1])):
                        part = F32(part + F32(xdec[m, k] * wdec[n, k]))
                    total = F32(total + F32(F32(sx[m, b] * sw[n, b]) * part))
                want.append(_epilogue(total, alpha, None if bias is None else bias[n]))
    got = Fp8RefLinear(layer, "reference:fp32")(x)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 3, layer.shape[0])
    assert _bits(got) == _bits(torch.tensor(want, dtype=torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("name", list(W4A4))
def test_kernel_accumulation_is_the_instruction_chained_along_k(name):
    from fp8ref.codec import encode
    from fp8ref.hardware import KERNELS, mma

    layer = _layer(name, LAYERS[1])
    x = _x(layer.shape[1], 6)
    kernel = W4A4[name]
    ins = KERNELS[kernel].ins
    codes, sx, w, sw = _operands(layer, x)
    sa, sb = encode(sx, ins.scale_fmt), encode(sw, ins.scale_fmt).T
    M, K, N = codes.shape[0], codes.shape[1], w.shape[0]
    a = np.zeros((ins.m, K), np.uint8)
    a[:M] = codes
    sa_full = np.full((ins.m, sa.shape[1]), sa[0, 0], np.uint8)
    sa_full[:M] = sa
    acc = np.zeros((ins.m, N), F32)
    shape = ins.shape_and_type.replace(f"n{ins.n}", f"n{N}", 1)
    nb = ins.k // ins.block
    for k0 in range(0, K, ins.k):
        b0 = k0 // ins.block
        acc = mma(ins.op, ins.arch, shape, a[:, k0:k0 + ins.k], np.ascontiguousarray(w.T[k0:k0 + ins.k]), acc,
                  scale_a=np.ascontiguousarray(sa_full[:, b0:b0 + nb]), scale_b=np.ascontiguousarray(sb[b0:b0 + nb]))
    bias = None if layer.bias is None else np.asarray(layer.bias).astype(F32)
    alpha = _alpha(layer)
    want = [_epilogue(acc[m, n], alpha, None if bias is None else bias[n]) for m in range(M) for n in range(N)]
    got = Fp8RefLinear(layer, f"reference:{kernel}")(x)
    assert _bits(got) == _bits(torch.tensor(want, dtype=torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("name,mode,why", [
    ("llmc_mxfp4", "reference:fp32-limited", r"fp32-limited models an accumulator promoted .* every 32 elements"),
    ("llmc_mxfp4", "reference:blackwell-nvfp4", r"takes float4_e2m1fn x float4_e2m1fn with float8_e4m3fn scales "
                                                r"per 16; this layer has .* float8_e8m0fnu scales per 32"),
    ("llmc_mxfp8", "reference:blackwell-mxfp4", r"takes float4_e2m1fn x float4_e2m1fn .* this layer has float8_e4m3fn"),
    ("llmc_nvfp4", "reference:hopper-promoted", r"applies float32 scales outside the instruction; NVFP4 block scales"),
    ("llmc_nvfp4a16", "reference:blackwell-nvfp4", r"weight-only layer \(16-bit activations\)"),
    ("llmc_nvfp4a16", "backend:blocks", r"backend 'blocks' cannot run this layer .*weight-only"),
    ("llmc_fp8", "reference:blackwell-mxfp8", r"applies ue8m0 block-scale codes .*this layer has float32 scales"),
    ("llmc_fp8_block", "reference:hopper-promoted",
     r"scales once in the epilogue; this layer.s scales change every 128"),
])
def test_pairs_without_a_definition_are_refused_naming_the_layer(name, mode, why):
    layer = _layer(name, LAYERS[0])
    lin = Fp8RefLinear(layer, "reference", backend=BlockScaled())
    with pytest.raises(Fp8RefError, match=f"^{layer.name}: .*{why}"):
        lin.mode = mode
    with pytest.raises(Fp8RefError, match=f"^{layer.name}: "):
        lin.run(_x(layer.shape[1], 0), mode)
    assert str(lin.mode) == "reference"  # unchanged


def test_fp8_layers_run_epilogue_and_promotion_kernels():
    from fp8ref import scaled_mm
    from fp8ref.checkpoint import base
    from fp8ref.matmul import quantize_input

    layer = _layer("llmc_fp8_dynamic", LAYERS[1])
    x = _x(layer.shape[1], 2)
    codes, s_x = quantize_input(x.float().reshape(-1, layer.shape[1]).numpy(), dynamic="token",
                                input_recipe=base.get(layer.producer).input_recipe(layer.entry))
    got = Fp8RefLinear(layer, "reference:hopper-promoted")(x)
    want = scaled_mm(codes, np.ascontiguousarray(layer.weight_codes.T), s_x,
                     np.asarray(layer.weight_scale, F32).reshape(1, -1), out_dtype="bfloat16",
                     accumulate="hopper-promoted")
    assert _bits(got) == _bits(torch.from_numpy(np.asarray(want, F32)).to(torch.bfloat16))


class BlockScaled(Backend):
    """Correct: fp8ref's fp32 model of a scaled_mm with one float32 scale per 1 x block of K on both sides."""

    name = "blocks"
    capabilities = {"scaled_mm": {"format": ("float4_e2m1fn", "float8_e4m3fn"), "scales": ("block16", "block32"),
                                  "out_dtype": ("float32",), "accumulate": ("fp32",), "scale_order": ("epilogue",),
                                  "bias": (False,)}}

    def scales(self, a, b):
        return a, b

    def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order):
        from fp8ref.matmul.fp32 import _fp32

        assert bias is None and out_dtype == "float32"
        sa, sb = self.scales(np.asarray(scale_a, F32), np.asarray(scale_b, F32))
        block = a.shape[1] // sa.shape[1]
        f = FORMATS[fmt]
        return _fp32(a, b, f, f, sa.astype(np.float64), sb.astype(np.float64), block, block, scale_order)


class ReadsScalesAsStored(BlockScaled):
    """Reads b's (KB, N) block scales as if laid out (N, KB), the checkpoint's weight_scale layout."""

    name = "blocks-as-stored"

    def scales(self, a, b):
        kb, n = b.shape
        return a, np.ascontiguousarray(b).reshape(n, kb).T


@pytest.mark.parametrize("name", list(W4A4))
def test_backend_block_case_equals_reference_fp32_and_a_wrong_layout_does_not(name):
    layer = _layer(name, LAYERS[1])
    x = _x(layer.shape[1], 3)
    lin = Fp8RefLinear(layer, "reference:fp32", backend={"blocks": BlockScaled(),
                                                                    "wrong": ReadsScalesAsStored()})
    ref = lin(x)
    got = lin.run(x, "backend:blocks")
    block = 16 if layer.quant.weight_strategy == "nvfp4" else 32
    assert lin.last_backend_params == {"format": layer.quant.weight_fmt, "scales": f"block{block}",
                                       "out_dtype": "float32", "bias": False, "accumulate": "fp32",
                                       "scale_order": "epilogue", "epilogue": "fp8ref"}
    assert got.dtype == torch.bfloat16 and _bits(got) == _bits(ref)
    assert _bits(lin.run(x, "backend:wrong")) != _bits(ref)


def test_a_backend_without_the_block_case_is_refused_with_its_reason():
    layer = _layer("llmc_mxfp8", LAYERS[0])
    lin = Fp8RefLinear(layer, backend=load_backend("torch"))
    with pytest.raises(Fp8RefError, match=f"^{layer.name}: backend 'torch' cannot run this layer "
                                          r"\(torch scaled_mm does not implement scales='block32'\)"):
        lin.run(_x(layer.shape[1], 0), "backend:torch")


@pytest.mark.parametrize("name", [*W4A4, "llmc_nvfp4a16"])
def test_compare_runs_every_mode_on_the_whole_model(name):
    pytest.importorskip("transformers")
    from fp8ref.nn import build_model
    from fp8ref.nn.compare import compare

    m = build_model(CKPTS / name, backend=BlockScaled())
    modes = ["reference", "reference:fp32"]
    if name in W4A4:
        modes += [f"reference:{W4A4[name]}", "backend:blocks"]
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    r = compare(m, ids, modes)
    assert r["modes"] == modes and len(r["layers"]) == 7
    for mode in modes[1:]:
        e2e = r["end_to_end"][mode]
        assert np.isfinite(e2e["max_abs_diff"]) and e2e["top1_agree"] > 0.5, (mode, e2e)
    if name in W4A4:  # the backend computes the fp32 model: every layer equal, teacher-forced
        assert all(layer["teacher_forced"]["backend:blocks"]["max_ulp"] == 0 for layer in r["layers"])
        assert all(layer["teacher_forced"]["backend:blocks"] == layer["teacher_forced"]["reference:fp32"]
                   | {"scaled_mm": layer["teacher_forced"]["backend:blocks"]["scaled_mm"]} for layer in r["layers"])


def test_cli_compare_with_block_accumulations(tmp_path):
    pytest.importorskip("transformers")
    import json

    from tests.support.cli import run_cli

    out = tmp_path / "r.json"
    modes = "reference,reference:fp32,reference:blackwell-mxfp4"
    assert run_cli("compare", CKPTS / "quark_mxfp4", "--modes", modes, "--json", out, "--no-progress") == 0
    assert json.loads(out.read_text())["modes"] == modes.split(",")
    assert run_cli("compare", CKPTS / "quark_mxfp4", "--modes", "reference,reference:fp32-limited",
                   "--no-progress") == 1
