"""``fp8ref explain --target hopper|blackwell``: DeepGEMM's UE8M0 requantization (vLLM, SGLang) and the
NVFP4 MoE w13 global-scale policies, every number checked against an oracle written here without
fp8ref's codec or recipes: torch's own float32 arithmetic, log2 and e4m3 cast for the requantization (the
operations vLLM's and SGLang's code call), exact Fractions for the keep-the-codes power of two, and
ml_dtypes plus a hand E2M1 table for the NVFP4 experts read straight from the safetensors file."""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open

from fp8ref.checkpoint import load_checkpoint
from fp8ref.checkpoint.engine import explain
from fp8ref.io.safetensors import open_store, write_safetensors
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
FN = ml_dtypes.float8_e4m3fn
STEP = "deepgemm-ue8m0-requant"


def _pow2_ceil(s: float) -> float:
    """The smallest power of two >= s, exactly (DeepGEMM's ceil_to_ue8m0 for a normal float32)."""
    f, p = Fraction(float(s)), Fraction(1)
    while p < f:
        p *= 2
    while p / 2 >= f:
        p /= 2
    return float(p)


def _oracle(codes: np.ndarray, scale: np.ndarray, engine: str) -> dict:
    """The engine's requant in torch, as its source reads, and the stored values' costs in float64."""
    q = torch.from_numpy(codes.view(FN).astype(np.float32))
    s = torch.from_numpy(np.asarray(scale, np.float32))
    m, k = q.shape
    s_exp = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :k]
    w = q * s_exp  # fp32(q) * fp32(s)
    if engine == "sglang":
        w = w.to(torch.bfloat16).float()
    pad = torch.zeros(-(-m // 128) * 128, -(-k // 128) * 128)
    pad[:m, :k] = w
    view = pad.view(-1, 128, pad.shape[1] // 128, 128)
    amax = view.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    if engine == "vllm":
        sf = torch.pow(2.0, torch.ceil(torch.log2(sf)))
    else:
        sf = torch.tensor([_pow2_ceil(v) for v in sf.flatten().tolist()]).view_as(sf)
    new_q = (view * (1.0 / sf)).to(torch.float8_e4m3fn).view_as(pad)[:m, :k].view(torch.uint8).numpy()
    new_s = sf.view(view.shape[0], view.shape[2]).double().numpy()
    def full(sc):
        return np.repeat(np.repeat(sc, 128, 0), 128, 1)[:m, :k]

    old = codes.view(FN).astype(np.float64) * full(np.asarray(scale, np.float64))
    new = new_q.view(FN).astype(np.float64) * full(new_s)
    up = np.array([[_pow2_ceil(v) for v in row] for row in np.asarray(scale, np.float32)], np.float64)
    kept = codes.view(FN).astype(np.float64) * full(up)
    norm = np.sqrt(np.sum(old ** 2))
    return {"codes": int((new_q != codes).sum()), "values": int((new != old).sum()),
            "max": float(np.abs(new - old).max()), "requant_rel_rms": float(np.sqrt(np.sum((new - old) ** 2)) / norm),
            "kept_rel_rms": float(np.sqrt(np.sum((kept - old) ** 2)) / norm),
            "kept_max_factor": float((up / np.asarray(scale, np.float64)).max()),
            "scales_changed": int((new_s != np.asarray(scale, np.float64)).sum())}


def _rows(ckpt, engine, target="blackwell"):
    return {e.layer: e for e in explain(ckpt, engine, target=target)[2] if e.step == STEP}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("fixture", ["llmc_deepseek_v3_fp8_block", "llmc_qwen3_moe_fp8_block"])
def test_requant_counts_and_costs_match_the_torch_oracle(engine, fixture):
    ckpt = load_checkpoint(ROOT / fixture)
    rows = _rows(ckpt, engine)
    checked = 0
    for name, layer in ckpt.items():
        e = rows[name]
        if name.endswith("kv_a_proj_with_mqa"):  # 160 output rows: N % 64 != 0, DeepGEMM does not take it
            assert (e.codes_changed, e.values_changed) == (0, 0) and e.note.startswith("kept: GEMM 160x128")
            continue
        want = _oracle(layer.weight_codes, np.asarray(layer.weight_scale, np.float32), engine)
        assert (e.codes_changed, e.values_changed, e.max_abs_change) == (want["codes"], want["values"], want["max"])
        for key in ("requant_rel_rms", "kept_rel_rms", "kept_max_factor"):
            assert e.figures[key] == pytest.approx(want[key], rel=1e-12), (name, key)
        assert e.figures["scales_changed"] == want["scales_changed"]
        checked += 1
    assert checked == {"llmc_deepseek_v3_fp8_block": 26, "llmc_qwen3_moe_fp8_block": 32}[fixture]


def test_the_engines_differ_where_sglang_rounds_to_bfloat16():
    ckpt = load_checkpoint(ROOT / "llmc_deepseek_v3_fp8_block")
    v, s = _rows(ckpt, "vllm"), _rows(ckpt, "sglang")
    assert any(v[n].codes_changed != s[n].codes_changed for n in v)


def test_a_checkpoint_already_in_ue8m0_reports_no_change():
    """hf_fp8_ue8m0 (transformers' scale_fmt ue8m0): every scale a power of two, every block's max code
    above 224, so the requantization keeps every code and value; keeping the codes costs nothing. Its
    one all-zero block gets scale 2**-22 (1e-4/448 rounded up) for its zero codes: a scale, not a value."""
    rows = _rows(load_checkpoint(ROOT / "hf_fp8_ue8m0"), "vllm")
    assert sorted(rows) == ["model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj"]
    for e in rows.values():
        assert (e.codes_changed, e.values_changed, e.max_abs_change) == (0, 0, 0.0)
        assert (e.figures["kept_max_factor"], e.figures["kept_rel_rms"], e.figures["requant_rel_rms"]) == (1, 0, 0)


def test_targets_and_engines_decide_where_the_step_runs(tmp_path):
    ckpt = load_checkpoint(ROOT / "llmc_deepseek_v3_fp8_block")
    steps = {(eng, t): [s.name for s in explain(ckpt, eng, target=t)[1]]
             for eng in ("vllm", "sglang") for t in ("cuda", "hopper", "blackwell")}
    assert STEP in steps["vllm", "hopper"] and STEP in steps["vllm", "blackwell"]
    assert STEP not in steps["vllm", "cuda"] and STEP not in steps["sglang", "hopper"]
    assert STEP in steps["sglang", "blackwell"]
    assert "requantize-fused-shards-to-max-scale" in steps["sglang", "blackwell"]  # a cuda step runs there too
    folder = tmp_path / "qwen35"
    shutil.copytree(ROOT / "llmc_deepseek_v3_fp8_block", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5_text"}))
    rows = _rows(load_checkpoint(folder), "vllm")
    assert rows and all(e.codes_changed == 0 and "turns DeepGEMM off" in e.note for e in rows.values())
    assert any(e.codes_changed for e in _rows(load_checkpoint(folder), "vllm", target="hopper").values())


# --- NVFP4 MoE w13 --------------------------------------------------------------------------------
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
MOE = ROOT / "fp8ref_nvfp4_moe_unfused"


def _expert_values(f, prefix: str) -> tuple[np.ndarray, float]:
    packed = f.get_tensor(prefix + ".weight").numpy()
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)  # low nibble first
    sb = f.get_tensor(prefix + ".weight_scale").view(torch.uint8).numpy().view(FN).astype(np.float64)
    sb = np.repeat(sb, 16, axis=1)
    return E2M1[codes] * sb, float(f.get_tensor(prefix + ".weight_scale_2"))


def test_w13_policies_match_the_oracle():
    rows = {e.layer: e for e in explain(load_checkpoint(MOE), "vllm")[2] if e.step == "nvfp4-moe-w13-gate-global"}
    with safe_open(MOE / "model.safetensors", "pt") as f:
        for block in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
            halves = [(_expert_values(f, f"{block}.{i}.gate_proj"), _expert_values(f, f"{block}.{i}.up_proj"))
                      for i in range(4)]
            for policy, label in (("gate", f"{block} [gate, this engine]"), ("max", f"{block} [max]"),
                                  ("split", f"{block} [split]")):
                changed, err, ref, factors = 0, {"gate": 0.0, "up": 0.0}, {"gate": 0.0, "up": 0.0}, []
                for (vg, mg), (vu, mu) in halves:
                    use = {"gate": (mg, mg), "max": (max(mg, mu),) * 2, "split": (mg, mu)}[policy]
                    for half, v, m, u in (("gate", vg, mg, use[0]), ("up", vu, mu, use[1])):
                        d = v * u - v * m
                        changed += int(np.count_nonzero(d))
                        err[half] += float(np.sum(d * d))
                        ref[half] += float(np.sum((v * m) ** 2))
                        if u != m:
                            factors.append(u / m)
                e = rows[label]
                assert e.codes_changed == 0 and e.values_changed == changed, label
                assert e.figures["up_rel_rms"] == pytest.approx(np.sqrt(err["up"] / ref["up"]), rel=1e-12)
                assert e.figures["gate_rel_rms"] == pytest.approx(np.sqrt(err["gate"] / ref["gate"]), rel=1e-12)
                assert (e.figures["min_factor"], e.figures["max_factor"]) == \
                    (min(factors, default=1.0), max(factors, default=1.0))
    assert rows["model.layers.0.mlp.experts [split]"].values_changed == 0
    assert rows["model.layers.1.mlp.experts [gate, this engine]"].figures["experts_differ"] == 4


def test_w13_shared_globals_report_no_policy_rows(tmp_path):
    """fp8ref's own export shares one global over gate and up (as llm-compressor does): nothing to choose."""
    rows = [e for e in explain(load_checkpoint(MOE), "sglang")[2] if e.step == "nvfp4-moe-w13-gate-global"]
    assert len(rows) == 6
    folder = tmp_path / "shared"
    shutil.copytree(MOE, folder)
    store = open_store(folder / "model.safetensors")
    tensors = {n: (store.info(n).dtype, np.array(store.get(n))) for n in store}
    for n in list(tensors):
        if n.endswith("up_proj.weight_scale_2"):
            tensors[n] = tensors[n.replace("up_proj", "gate_proj")]
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    rows = [e for e in explain(load_checkpoint(folder), "vllm")[2] if e.step == "nvfp4-moe-w13-gate-global"]
    assert [e.note for e in rows] == ["4 experts: gate and up share one global"] * 2


def test_cli_blackwell_json_and_bad_input(capsys, tmp_path):
    assert run_cli("explain", ROOT / "hf_fp8_ue8m0", "--engine", "sglang", "--target", "blackwell",
                   "--json", "-") == 0
    out = json.loads(capsys.readouterr().out)
    rows = [e for e in out["effects"] if e["step"] == STEP]
    assert out["target"] == "blackwell" and len(rows) == 2 and rows[0]["figures"]["kept_max_factor"] == 1.0
    assert run_cli("explain", ROOT / "llmc_deepseek_v3_fp8_block", "--target", "blackwell") == 0
    text = capsys.readouterr().out
    assert "deepgemm-ue8m0-requant:" in text and "codes kept instead: values x up to" in text
    (tmp_path / "empty").mkdir()
    assert run_cli("explain", tmp_path / "empty", "--target", "blackwell") == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error:") and err.strip().count("\n") == 0
    with pytest.raises(SystemExit):
        run_cli("explain", ROOT / "hf_fp8_ue8m0", "--target", "b200")


def test_transformers_on_blackwell_declines_fp32_scales_and_states_the_5_12_cost(tmp_path):
    """transformers 5.17 on SM100: float32 block scales go to Triton unchanged; the figures are what
    5.12 computed (#47030: codes kept, scales rounded up), against the oracle's keep-the-codes cost."""
    hf = tmp_path / "hf"
    assert run_cli("convert", ROOT / "llmc_deepseek_v3_fp8_block", hf, "--format", "hf-fp8") == 0
    ckpt = load_checkpoint(hf)
    rows = {e.layer: e for e in explain(ckpt, "transformers", target="blackwell")[2]
            if e.step == "sm100-fp8-linear-scales"}
    assert len(rows) == 28
    for name, e in rows.items():
        layer = ckpt[name]
        want = _oracle(layer.weight_codes, np.asarray(layer.weight_scale, np.float32), "vllm")
        assert (e.codes_changed, e.values_changed) == (0, 0) and "DeepGEMM declined" in e.note
        assert e.figures["kept_max_factor"] == pytest.approx(want["kept_max_factor"], rel=1e-12)
        assert e.figures["kept_rel_rms"] == pytest.approx(want["kept_rel_rms"], rel=1e-12)
    assert max(e.figures["kept_max_factor"] for e in rows.values()) > 1.9
    ue8m0 = [e for e in explain(load_checkpoint(ROOT / "hf_fp8_ue8m0"), "transformers", target="blackwell")[2]
             if e.step == "sm100-fp8-linear-scales"]
    assert len(ue8m0) == 2 and all("exact" in e.note and not e.figures for e in ue8m0)
    assert not any(s.name == "sm100-fp8-linear-scales" for s in explain(ckpt, "transformers")[1])  # cpu
