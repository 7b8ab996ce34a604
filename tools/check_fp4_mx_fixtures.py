"""Re-derive the bytes of the NVFP4, MX, ModelOpt and Quark fixtures from their original weights.

Not fp8ref code: a reading aid for tests/fixtures/interop/FINDINGS-FP4-MX.md. Each recipe below is the
arithmetic read from the tool's installed source (cited in FINDINGS-FP4-MX.md), written independently:
E4M3 rounding is ml_dtypes' cast from float32 after an explicit clamp, E2M1 is an explicit RNE grid,
E8M0 exponents come from math.frexp. It prints, per fixture and layer, how many stored scale bytes
and element codes the recipe misses (0 = reproduced), and the rates of the alternative recipes.

Usage: /work/main/.venv/bin/python tools/check_fp4_mx_fixtures.py [--dir tests/fixtures/interop/checkpoints]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
L = "model.layers.0."
LINEARS = [L + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
FUSED = {L + "self_attn.q_proj": 0, L + "self_attn.k_proj": 0, L + "self_attn.v_proj": 0,
         L + "mlp.gate_proj": 1, L + "mlp.up_proj": 1}
F32 = torch.float32
BF16 = torch.bfloat16


# ---------------------------------------------------------------------------------------------- element codecs


def e4m3_codes(x: torch.Tensor) -> torch.Tensor:
    """RNE float32 -> e4m3fn codes after a clamp to +-448 (ml_dtypes; never torch's cast)."""
    a = np.clip(x.to(F32).numpy(), -448.0, 448.0).astype(np.float32)
    return torch.from_numpy(a.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.int64))


def e4m3_value(x: torch.Tensor) -> torch.Tensor:
    a = np.clip(x.to(F32).numpy(), -448.0, 448.0).astype(np.float32)
    return torch.from_numpy(a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(codes.to(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32))


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """RNE onto the E2M1 grid, saturating at 6; sign nibble bit from x < 0 (so exact -0.0 -> +0)."""
    a = x.abs()
    idx = torch.zeros_like(a, dtype=torch.int64)
    for lo, hi, i, lo_in, hi_in in ((0.25, 0.75, 1, False, False), (0.75, 1.25, 2, True, True),
                                    (1.25, 1.75, 3, False, False), (1.75, 2.5, 4, True, True),
                                    (2.5, 3.5, 5, False, False), (3.5, 5.0, 6, True, True)):
        m = (a >= lo if lo_in else a > lo) & (a <= hi if hi_in else a < hi)
        idx[m] = i
    idx[a > 5.0] = 7
    return idx | ((x < 0).to(torch.int64) << 3)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Low nibble = even element (the order both CT and ModelOpt write; checked on bytes below)."""
    p = packed.to(torch.int64)
    return torch.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    v = E2M1[codes & 7]
    return torch.where(codes >= 8, -v, v)


def frexp_floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2 a) exactly (a > 0), and the significand in [1, 2)."""
    m, e = np.frexp(a.astype(np.float64))
    return e - 1, m * 2


# ---------------------------------------------------------------------------------------------- recipes


def blocks(w: torch.Tensor, k: int) -> torch.Tensor:
    return w.reshape(w.shape[0], w.shape[1] // k, k)


def ct_nvfp4(w: torch.Tensor, fused_amax: torch.Tensor, gs_dtype=BF16):
    """compressed-tensors 0.19.0 / llmcompressor 0.14.0.1 NVFP4 weight (see FINDINGS-FP4-MX section 1)."""
    amax = fused_amax.to(gs_dtype).clamp(min=torch.finfo(gs_dtype).tiny).reshape(1)
    gs = (2688.0 / amax).to(F32)  # python float / D tensor: a D division
    loc = blocks(w, 16).abs().amax(-1) / 6  # D op
    s = e4m3_value(gs * loc.to(F32))
    s[s == 0] = 0.125  # _get_dtype_eps(float8_e4m3fn)
    x = blocks(w, 16).to(F32) / (s / gs)[..., None]
    return gs, s, e2m1_codes(x.clamp(-6, 6)).reshape(w.shape)


def modelopt_nvfp4(w: torch.Tensor, fused_amax: torch.Tensor):
    """ModelOpt 0.47.0 NVFP4QTensor.get_weights_scaling_factor(_2) + quantize."""
    wsf2 = fused_amax.to(F32) / (6.0 * 448.0)
    s = blocks(w, 16).abs().amax(-1).to(F32) / (6.0 * wsf2)
    s[s == 0] = 1.0
    s = e4m3_value(s.clamp(min=2.0**-9, max=448.0))
    x = blocks(w, 16) / (s * wsf2)[..., None]  # bf16 / fp32 -> fp32
    return wsf2, s, e2m1_codes(x).reshape(w.shape)


def mx_exponent(amax: torch.Tensor, rule: str, emax: int, qmax: float) -> torch.Tensor:
    """Biased E8M0 scale code for a block amax under a named rule (exact, via frexp)."""
    a = amax.to(torch.float64).numpy()
    out = np.zeros(a.shape, dtype=np.int64)
    nz = a > 0
    fl, sig = frexp_floor_log2(a[nz])
    if rule == "ocp-floor":
        k = fl - emax
    elif rule in ("ct-round-to-power-2", "quark-even"):  # +0.25 ulp of the significand, then floor
        k = fl + (sig >= 1.75) - emax
    elif rule == "rceil":  # 2^ceil(log2(amax/qmax)), amax/qmax in float32 (ModelOpt MXFP8)
        d = (amax.to(F32)[torch.from_numpy(nz)] / qmax).to(torch.float64).numpy()
        fd, sd = frexp_floor_log2(d)
        k = fd + (sd > 1.0)
    else:
        raise ValueError(rule)
    out[nz] = np.clip(k, -127, 127) + 127
    out[~nz] = {"ocp-floor": 0, "ct-round-to-power-2": 0, "quark-even": 0, "rceil": 0}[rule]
    return torch.from_numpy(out)


def mx_codes(w: torch.Tensor, scale_codes: torch.Tensor, bits: int, add_zero_point: bool) -> torch.Tensor:
    s = torch.pow(2.0, (scale_codes - 127).to(torch.float64)).to(F32)
    x = blocks(w, 32).to(F32) / s[..., None]  # exact: a power of two
    if add_zero_point:  # CT adds its zero point (+0.0): exact -0.0 becomes +0.0
        x = x + 0.0
    if bits == 8:
        return e4m3_codes(x).reshape(w.shape)
    return e2m1_codes(x.clamp(-6, 6)).reshape(w.shape)


# ---------------------------------------------------------------------------------------------- checks


def rate(a: torch.Tensor, b: torch.Tensor) -> str:
    n = int((a != b).sum())
    return f"{n}/{a.numel()} ({100.0 * n / a.numel():.2f} %)"


def neg_zero_to_pos(codes: torch.Tensor, zero_code: int) -> torch.Tensor:
    return torch.where(codes == zero_code, torch.zeros_like(codes), codes)


def fused_amax(orig: dict, lin: str) -> torch.Tensor:
    grp = [n for n, g in FUSED.items() if lin in FUSED and g == FUSED[lin]] or [lin]
    return torch.stack([orig[n].abs().max() for n in grp]).max()


def check_nvfp4(name: str, sd: dict, refs: dict, orig: dict, tool: str) -> dict:
    res = {}
    for lin in LINEARS:
        w, fa = orig[lin], fused_amax(orig, lin)
        nib = unpack_nibbles(sd[lin + (".weight_packed" if tool == "ct" else ".weight")])
        s_st = sd[lin + ".weight_scale"].to(F32)
        if tool == "ct":
            gs, s, c = ct_nvfp4(w, fa)
            gs_ok = torch.equal(sd[lin + ".weight_global_scale"], gs)
            _, s32, c32 = ct_nvfp4(w, fa, gs_dtype=F32)
            alt = {"global scale divided in fp32 instead of bf16: scales": rate(s32, s_st), "codes": rate(c32, nib)}
            mo_gs, mo_s, mo_c = modelopt_nvfp4(w, fa)
            alt["ModelOpt recipe on the same weights: block scale bytes"] = rate(mo_s, s_st)
            alt["ModelOpt recipe: codes"] = rate(mo_c, nib)
        else:
            gs, s, c = modelopt_nvfp4(w, fa)
            gs_ok = torch.equal(sd[lin + ".weight_scale_2"].reshape(1), gs.reshape(1))
            cg, cs, cc = ct_nvfp4(w, fa)
            alt = {"CT recipe on the same weights: block scale bytes": rate(cs, s_st),
                   "CT recipe: codes": rate(cc, nib)}
        row = {"global_scale_equal": gs_ok, "block_scale_mismatch": rate(s, s_st), "code_mismatch": rate(c, nib),
               "zero_blocks_scale": sorted(set(s_st[blocks(w, 16).abs().amax(-1) == 0].tolist())),
               "neg_zero_nibbles": int((nib == 8).sum()), "alternatives": alt}
        qdq = refs.get(lin + ".qdq_in_memory")
        if qdq is not None:
            eff = (s_st / gs if tool == "ct" else s_st * gs).to(F32)
            deq = (blocks(e2m1_decode(nib), 16).to(F32) * eff[..., None]).reshape(w.shape).to(qdq.dtype)
            row["in_memory_qdq_vs_written_dequant"] = rate(qdq, deq)
        res[lin] = row
    return res


def check_mx(name: str, sd: dict, refs: dict, orig: dict, bits: int, rule: str, weight_key: str,
             add_zero_point: bool = False) -> dict:
    emax, qmax = (2, 6.0) if bits == 4 else (8, 448.0)
    res = {}
    for lin in LINEARS:
        w = orig[lin]
        st = sd[lin + ".weight_scale"].to(torch.int64)
        amax = blocks(w, 32).abs().amax(-1)
        e = mx_exponent(amax, rule, emax, qmax)
        stored = sd[lin + weight_key]
        codes = unpack_nibbles(stored) if bits == 4 else stored.view(torch.uint8).to(torch.int64)
        c = mx_codes(w, st, bits, add_zero_point)
        z = 8 if bits == 4 else 0x80
        row = {"scale_mismatch": rate(e, st), "code_mismatch_given_stored_scale": rate(c, codes),
               "code_mismatch_sign_of_zero_ignored": rate(neg_zero_to_pos(c, z), neg_zero_to_pos(codes, z)),
               "negative_zero_codes_stored": int((codes == z).sum()),
               "zero_block_scale_codes": sorted(set(st[amax == 0].tolist())),
               "other_rules_scale_mismatch": {r: rate(mx_exponent(amax, r, emax, qmax), st)
                                              for r in ("ocp-floor", "ct-round-to-power-2", "rceil") if r != rule}}
        qdq = refs.get(lin + ".qdq_in_memory")
        if qdq is not None:
            dec = e2m1_decode(codes) if bits == 4 else e4m3_decode(codes)
            s = torch.pow(2.0, (st - 127).to(torch.float64)).to(F32)
            row["in_memory_qdq_vs_written_dequant"] = rate(qdq, (blocks(dec, 32) * s[..., None]).reshape(w.shape)
                                                           .to(qdq.dtype))
        res[lin] = row
    return res


def check_fp8_tensor(name: str, sd: dict, refs: dict, orig: dict, tool: str) -> dict:
    res = {}
    for lin in LINEARS:
        w = orig[lin]
        codes = sd[lin + ".weight"].view(torch.uint8).to(torch.int64)
        s_st = sd[lin + ".weight_scale"]
        amax = w.abs().max().to(F32)
        s = (amax.to(torch.float64) / 448.0).to(F32)
        row = {"scale_equal_fp32(amax/448)": bool(torch.equal(s_st.reshape(()).to(F32), s)),
               "scale_equal_bf16(fp32(amax/448))": bool(torch.equal(s_st.reshape(()).to(F32), s.to(BF16).to(F32))),
               "scale_dtype_shape": [str(s_st.dtype), list(s_st.shape)]}
        s0 = s_st.reshape(()).to(F32)
        sd_ = s_st.reshape(())
        cand = {
            "e4m3(D(W / s_stored_D))": e4m3_codes((w / sd_.to(w.dtype)).to(F32)),
            "e4m3(bf16(W / s))": e4m3_codes((w / s0).to(F32)),  # 0-dim fp32 does not promote bf16
            "e4m3(fp32(W) / s)": e4m3_codes(w.to(F32) / s0),
            "e4m3(fp32(W) * fp32(1/s))": e4m3_codes(w.to(F32) * (1.0 / s0)),
            "e4m3(fp32(W) * fp32(448/amax))": e4m3_codes(w.to(F32) * (448.0 / amax)),
        }
        stored = neg_zero_to_pos(codes, 0x80)  # -0 policies differ; counted separately as codes_0x80
        row["code_mismatch"] = {k: rate(neg_zero_to_pos(v, 0x80), stored) for k, v in cand.items()}
        row["codes_0x80"] = int((codes == 0x80).sum())
        qdq = refs.get(lin + ".qdq_in_memory")
        if qdq is not None:
            row["in_memory_qdq_vs_written_dequant bf16(q*s)"] = rate(qdq, (e4m3_decode(codes) * s0).to(qdq.dtype))
        res[lin] = row
    return res


def check_fp8_channel(name: str, sd: dict, orig: dict) -> dict:
    res = {}
    for lin in LINEARS:
        w = orig[lin]
        codes = sd[lin + ".weight"].view(torch.uint8).to(torch.int64)
        s_st = sd[lin + ".weight_scale"].to(F32)
        amax = w.abs().amax(-1).to(F32)
        s = (amax.to(torch.float64) / 448.0).to(F32)
        s = torch.where(amax == 0, torch.ones_like(s), s)  # zero amax -> maxbound -> 448/448
        res[lin] = {"scale_mismatch": rate(s, s_st),
                    "code_mismatch e4m3(fp32(W)/s[:,None])": rate(e4m3_codes(w.to(F32) / s_st[:, None]), codes),
                    "zero_row_scales": s_st[amax == 0].tolist()}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=ROOT / "tests" / "fixtures" / "interop" / "checkpoints")
    a = p.parse_args()
    report = {}
    for d in sorted(a.dir.iterdir()):
        if not (d / "fixture.json").exists() or not d.name.startswith(("llmc_nvfp4", "llmc_mx", "modelopt", "quark")):
            continue
        sd = load_file(str(d / "model.safetensors"))
        refs = load_file(str(d / "reference_outputs.safetensors"))
        orig = {k.removeprefix("original."): v for k, v in refs.items() if k.startswith("original.")}
        n = d.name
        if n.startswith("llmc_nvfp4"):
            r = check_nvfp4(n, sd, refs, orig, "ct")
        elif n == "llmc_mxfp4":
            r = check_mx(n, sd, refs, orig, 4, "ct-round-to-power-2", ".weight_packed", add_zero_point=True)
        elif n == "llmc_mxfp8":
            r = check_mx(n, sd, refs, orig, 8, "ct-round-to-power-2", ".weight", add_zero_point=True)
        elif n == "modelopt_nvfp4":
            r = check_nvfp4(n, sd, refs, orig, "modelopt")
        elif n == "modelopt_mxfp8":
            r = check_mx(n, sd, refs, orig, 8, "rceil", ".weight")
        elif n in ("modelopt_fp8", "quark_fp8"):
            r = check_fp8_tensor(n, sd, refs, orig, n.split("_")[0])
        elif n == "modelopt_fp8_pc_pt":
            r = check_fp8_channel(n, sd, orig)
        elif n == "quark_mxfp4":
            r = check_mx(n, sd, refs, orig, 4, "quark-even", ".weight")
        else:
            continue
        report[n] = r
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
