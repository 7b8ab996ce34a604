"""NVFP4 / MX layers in whole-model runs: the run-time input quantization (``quantize_block_input``,
and ``nn.modes.quantize_input``, which compare's code counts use) and the W4A4 / W8A8 reference forward,
against an exact Fraction oracle written from compressed-tensors 0.19.0's and Quark 0.13's source
(FINDINGS-FP4-MX §1, §2, §4), on the committed tool-made fixtures' layers and stored scales.

compressed-tensors NVFP4 (``dynamic: local``, its CPU ``calculate_qparams`` + ``_quantize_dequantize``):
  s_b = e4m3(clamp(fp32(g * D(amax_b / 6)))), a stored 0 -> 0.125; q = e2m1(fp32(x / fp32(s_b / g)) + 0)
  (g: the stored input_global_scale, a divisor). MX (compressed-tensors): k = floor(log2 amax) +
  [significand >= 1.75] - emax_elem (round_to_power_2), zero block k = -127; q = enc(D(x / 2**k) + 0).
  Quark MXFP4: the same exponents, zero block k = -126, no -0 code. Both divide in the model dtype D
  (bf16 here: a quotient below bf16's smallest subnormal is 0, so a tiny negative gives +0).
Reference: sum of the exact products of the dequantized operands, / (g_w * g_x) for NVFP4, rounded once.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from fp8ref import load_checkpoint
from fp8ref.errors import Fp8RefError
from fp8ref.formats import FORMATS
from fp8ref.io.safetensors import open_store
from tests.support import oracle
from tests.support.matmul_oracle import round_fraction
from tests.support.quant_oracle import exact_code

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
E2M1, E4M3 = FORMATS["float4_e2m1fn"], FORMATS["float8_e4m3fn"]
EMAX = {"float4_e2m1fn": 2, "float8_e4m3fn": 8}  # floor(log2(max_elem)): 6 -> 2, 448 -> 8
# fixture -> (zero-block exponent, -0 code kept for negatives that round to zero)
MX_RULES = {"llmc_mxfp4": (-127, True), "llmc_mxfp8": (-127, True), "quark_mxfp4": (-126, False)}
FIXTURES = ["llmc_nvfp4", "llmc_nvfp4a16", *MX_RULES]
LAYERS = ["model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"]  # K = 64 and 128


def _x(k: int, seed: int) -> torch.Tensor:
    """bf16 [1, 3, k], heavy-tailed, with a zero block, +-0, the smallest subnormal, a huge value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, k, generator=g) * torch.exp(2 * torch.randn(1, 3, k, generator=g))
    x[0, 0, :32] = 0.0
    x[0, 1, 3] = -0.0
    x[0, 1, 40] = 2.0 ** -133
    x[0, 1, 41] = -(2.0 ** -133)
    x[0, 2, 5] = 3.0e4
    return x.to(torch.bfloat16)


def _fracs(x: torch.Tensor) -> list[list[Fraction]]:
    return [[Fraction(float(v)) for v in row] for row in x.reshape(-1, x.shape[-1]).float().tolist()]


def _value(code: int, fmt) -> Fraction:
    return oracle.decode(int(code), fmt)


def _code(r: Fraction, fmt, neg_zero: bool) -> int:
    return exact_code(r, fmt, negative_zero=neg_zero)


def _nvfp4_oracle(rows, g: Fraction):
    """(codes, block scales) of compressed-tensors' dynamic local NVFP4 input under divisor g."""
    codes, scales = [], []
    for row in rows:
        crow, srow = [], []
        for b in range(0, len(row), 16):
            block = row[b:b + 16]
            t = Fraction(round_fraction(max(abs(v) for v in block) / 6, "bfloat16"))
            p = min(Fraction(round_fraction(g * t, "float32")), Fraction(448))
            sb = _value(_code(p, E4M3, False), E4M3) or Fraction(1, 8)  # a stored 0 -> eps(e4m3) = 0.125
            eff = Fraction(round_fraction(sb / g, "float32"))
            for v in block:
                r = Fraction(round_fraction(v / eff, "float32"))
                crow.append(_code(r, E2M1, False) if r != 0 else 0)  # + 0: an exact 0 is +0
            srow.append(sb)
        codes.append(crow)
        scales.append(srow)
    return codes, scales


def _mx_oracle(rows, fmt, zero_k: int, keep_neg_zero: bool):
    """(codes, block scales 2**k) of an MX input: the ct round_to_power_2 / Quark even exponent."""
    codes, scales = [], []
    for row in rows:
        crow, srow = [], []
        for b in range(0, len(row), 32):
            block = row[b:b + 32]
            amax = max(abs(v) for v in block)
            if amax == 0:
                k = zero_k
            else:
                e = amax.numerator.bit_length() - amax.denominator.bit_length()
                e = e if Fraction(2) ** e <= amax else e - 1
                k = min(max(e + (amax / Fraction(2) ** e >= Fraction(7, 4)) - EMAX[fmt.name], -127), 127)
            for v in block:
                r = Fraction(round_fraction(v / Fraction(2) ** k, "bfloat16"))  # a D division: may underflow
                c = _code(r, fmt, False) if r != 0 else 0  # + 0 (Quark: no -0 code either)
                crow.append(c if keep_neg_zero or _value(c, fmt) != 0 else 0)
            srow.append(Fraction(2) ** k)
        codes.append(crow)
        scales.append(srow)
    return codes, scales


def _input_oracle(name: str, layer, x: torch.Tensor):
    rows = _fracs(x)
    if layer.quant.input == "nvfp4":
        g = Fraction(float(np.asarray(layer.input_scale, np.float32).reshape(-1)[0]))
        return _nvfp4_oracle(rows, g)
    return _mx_oracle(rows, FORMATS[layer.quant.input_fmt], *MX_RULES[name])


def _weight_values(name: str, layer) -> list[list[Fraction]]:
    """Element x block scale of the stored weight, unpacked from the file's bytes (low nibble first)."""
    store = open_store(ROOT / name / "model.safetensors")
    t, q = layer.tensors, layer.quant
    raw = store.get(t["weight"])
    codes = np.stack([raw & 15, raw >> 4], -1).reshape(raw.shape[0], -1) if q.packed else raw.view(np.uint8)
    s = store.get(t["weight_scale"]).view(np.uint8)
    block = 16 if q.weight_strategy == "nvfp4" else 32
    out = []
    for i, row in enumerate(codes):
        sc = [_value(c, E4M3) if q.weight_strategy == "nvfp4" else Fraction(2) ** (int(c) - 127) for c in s[i]]
        out.append([_value(c, FORMATS[q.weight_fmt]) * sc[j // block] for j, c in enumerate(row)])
    return out


def _layer(name: str, layer_name: str):
    return load_checkpoint(ROOT / name)[layer_name]


@pytest.mark.parametrize("name", [f for f in FIXTURES if f != "llmc_nvfp4a16"])
@pytest.mark.parametrize("layer_name", LAYERS)
@pytest.mark.parametrize("seed", [0, 1])
def test_input_codes_and_scales_equal_the_oracle(name, layer_name, seed):
    from fp8ref._arrays import numpy_of
    from fp8ref.checkpoint.forward import quantize_block_input
    from fp8ref.nn.modes import quantize_input

    layer = _layer(name, layer_name)
    x = _x(layer.shape[1], seed)
    codes, scales = _input_oracle(name, layer, x)
    qx = quantize_block_input(layer, x)
    assert qx.codes.reshape(3, -1).tolist() == codes
    assert [[Fraction(float(v)) for v in r] for r in np.asarray(qx.scale).reshape(3, -1).tolist()] == scales
    if layer.quant.input == "nvfp4":  # the stored global divisor, as given
        assert float(np.asarray(qx.global_scale).reshape(-1)[0]) == float(np.asarray(layer.input_scale).reshape(-1)[0])
    c2, s2 = quantize_input(layer, numpy_of(x.reshape(3, -1)))  # compare's code counts: the same codes
    assert c2.tolist() == codes and [[Fraction(float(v)) for v in r] for r in s2.tolist()] == scales


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("layer_name", LAYERS)
def test_reference_forward_is_the_exact_product_rounded_once(name, layer_name):
    from fp8ref.nn import Fp8RefLinear

    layer = _layer(name, layer_name)
    x = _x(layer.shape[1], 7)
    q = layer.quant
    if q.input is None:  # weight-only: x as it is
        xv = _fracs(x)
    else:
        codes, scales = _input_oracle(name, layer, x)
        blk = 16 if q.input == "nvfp4" else 32
        xv = [[_value(c, FORMATS[q.input_fmt]) * srow[j // blk] for j, c in enumerate(crow)]
              for crow, srow in zip(codes, scales, strict=True)]
    g = Fraction(1)
    if q.weight_strategy == "nvfp4":  # compressed-tensors' globals are divisors
        g = Fraction(float(np.asarray(layer.weight_global, np.float32).reshape(-1)[0]))
        if q.input == "nvfp4":
            g *= Fraction(float(np.asarray(layer.input_scale, np.float32).reshape(-1)[0]))
    wv = _weight_values(name, layer)
    want = [[round_fraction(sum(a * b for a, b in zip(xr, wr, strict=True)) / g, "bfloat16") for wr in wv] for xr in xv]
    y = Fp8RefLinear(layer, "reference")(x)
    assert y.dtype == torch.bfloat16 and y.shape == (1, 3, layer.shape[0])
    got = y.float().reshape(3, -1).tolist()
    assert [[math.copysign(1, v) if v == 0 else v for v in r] for r in got] == \
        [[math.copysign(1, v) if v == 0 else v for v in r] for r in want]  # an exact 0 sum rounds to +0


@pytest.mark.parametrize("name", ["modelopt_mxfp8"])  # NVFP4 runs: NVFP4QTensor's CPU arithmetic
def test_modelopt_block_producer_is_refused_before_any_forward(name):
    from fp8ref.nn import Fp8RefLinear

    layer = _layer(name, LAYERS[0])
    lin = Fp8RefLinear(layer, "reference")
    with pytest.raises(Fp8RefError, match=f"^{layer.name}: no producer emulation for ModelOpt .*CUDA only"):
        lin.mode = "producer"
    y = lin(_x(layer.shape[1], 0))  # reference runs
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())


def test_input_errors_name_the_layer():
    from fp8ref.checkpoint.forward import quantize_block_input

    layer = _layer("llmc_nvfp4", LAYERS[0])
    with pytest.raises(Fp8RefError, match=f"^{layer.name}: x has 48 features, the weight 64"):
        quantize_block_input(layer, torch.zeros(2, 48, dtype=torch.bfloat16))
