"""KV-cache scales in export_checkpoint / write_checkpoint / `fp8ref quantize`.

The expected scale is computed here independently: compressed-tensors' formula D(fp32(amax)/448)
(REFERENCE 4.1 step 2) with numpy's IEEE float32 division and ml_dtypes' round-to-nearest-even cast,
plus hand-picked hex values. The kv_cache_scheme literal is what compressed-tensors 0.19.0 wrote
for llm-compressor 0.14 oneshot with a static per-tensor FP8 kv_cache_scheme (measured).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8ref.checkpoint import export_checkpoint, load_checkpoint, write_calibration
from fp8ref.checkpoint.convert import write_checkpoint
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import SafetensorsFile, write_safetensors
from tests.support.checkpoint_builders import snapshot, write
from tests.support.cli import run_cli

BF16 = ml_dtypes.bfloat16
NP = {"bfloat16": BF16, "float16": np.float16, "float32": np.float32}
ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
ATTN = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
CT_019_KV_SCHEME = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                    "observer": None, "observer_kwargs": {}, "scale_dtype": None, "strategy": "tensor",
                    "symmetric": True, "type": "float", "zp_dtype": None}
SPEC = {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}
KV = {f"{ATTN[0]}.k_scale": 1.0, f"{ATTN[0]}.v_scale": 0.0, f"{ATTN[1]}.k_scale": 3.75, f"{ATTN[1]}.v_scale": 448.0}


def make_source(folder, dtype: str = "bfloat16", shards: int = 1):
    folder.mkdir()
    rng = np.random.default_rng(1)
    shapes = {}
    for a in ATTN:
        shapes.update({f"{a}.q_proj": (32, 32), f"{a}.k_proj": (16, 32), f"{a}.v_proj": (16, 32),
                       f"{a}.o_proj": (32, 32)})
    shapes["lm_head"] = (8, 32)
    tensors = {f"{n}.weight": (ST[dtype], rng.standard_normal(s).astype(NP[dtype])) for n, s in shapes.items()}
    tensors["model.norm.weight"] = (ST[dtype], np.ones(32, NP[dtype]))
    write(folder, tensors, {"model_type": "llama", "dtype": dtype}, shards=shards)
    return tensors


def ct_scale_bits(amax: float, dtype: str) -> bytes:
    """D(fp32(amax)/448), eps(D) for a zero result: numpy's IEEE fp32 division, ml_dtypes' RNE cast."""
    s = np.float32(amax) / np.float32(448.0)
    d = np.array([s], np.float32).astype(NP[dtype])
    if d[0] == 0:
        d = np.array([ml_dtypes.finfo(NP[dtype]).eps], NP[dtype])
    return d.tobytes()


def test_hand_picked_oracle_values():
    # 1/448 = 0x3B124925 in fp32 -> bf16 0x3B12 (low half < 0x8000); eps(bf16) = 2**-7 = 0x3C00
    assert ct_scale_bits(1.0, "bfloat16") == (0x3B12).to_bytes(2, "little")
    assert ct_scale_bits(0.0, "bfloat16") == (0x3C00).to_bytes(2, "little")
    assert ct_scale_bits(448.0, "float16") == (0x3C00).to_bytes(2, "little")  # 1.0
    assert ct_scale_bits(1.0, "float32") == (0x3B124925).to_bytes(4, "little")


# compressed-tensors 0.20.1's QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False,
# symmetric=True).model_dump(): the keys nobody set are left out (measured with the 0.20.1 wheel)
CT_020_KV_SCHEME = {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": "tensor", "symmetric": True,
                    "type": "float"}


def test_kv_cache_scheme_of_the_0_20_writer(tmp_path):
    make_source(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=KV)
    qc = load_checkpoint(tmp_path / "out").quantization_config
    assert qc["kv_cache_scheme"] == CT_020_KV_SCHEME and qc["moe_sparsity_config"] is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_compressed_tensors_export_writes_kv_scales(tmp_path, dtype):
    make_source(tmp_path / "src", dtype)
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=KV, config_version="0.19")
    ckpt = load_checkpoint(tmp_path / "out")
    assert ckpt.warnings == []
    assert ckpt.quantization_config["kv_cache_scheme"] == CT_019_KV_SCHEME
    assert sorted(ckpt.kv_scales) == sorted(KV)  # the compressed-tensors names, nothing else
    f = SafetensorsFile(tmp_path / "out" / "model.safetensors")
    for name, amax in KV.items():
        assert (f.tensors[name].dtype, f.tensors[name].shape) == (ST[dtype], (1,))
        assert f.read_bytes(name).tobytes() == ct_scale_bits(amax, dtype), name
    assert len(ckpt) == 8 and all(q.quant.input == "dynamic-token" for q in ckpt.values())


def test_no_kv_entries_keeps_kv_cache_scheme_null(tmp_path):
    make_source(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration={"unrelated.layer": 1.0})
    ckpt = load_checkpoint(tmp_path / "out")
    assert ckpt.quantization_config["kv_cache_scheme"] is None and ckpt.kv_scales == {}


def test_kv_scales_sit_in_the_projection_shard(tmp_path):
    make_source(tmp_path / "src", shards=3)
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=KV)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    src = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    for a in ATTN:
        assert index["weight_map"][f"{a}.k_scale"] == src[f"{a}.k_proj.weight"]
        assert index["weight_map"][f"{a}.v_scale"] == src[f"{a}.v_proj.weight"]
    files = {f: SafetensorsFile(tmp_path / "out" / f) for f in set(index["weight_map"].values())}
    assert index["metadata"]["total_size"] == sum(i.nbytes for f in files.values() for i in f.tensors.values())
    ckpt = load_checkpoint(tmp_path / "out")
    for name, amax in KV.items():
        assert ckpt.tensor(name).tobytes() == ct_scale_bits(amax, "bfloat16")


def test_calibration_file_forms_and_aliases(tmp_path):
    """JSON with "kv_amax" beside "input_amax" (compressed-tensors names, or the k/v_proj output-amax
    aliases), and safetensors: the same bytes as the compressed-tensors names given as a mapping."""
    make_source(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "ref", SPEC, calibration=KV)
    ref = SafetensorsFile(tmp_path / "ref" / "model.safetensors")
    alias = {k.replace(".k_scale", ".k_proj.output_amax").replace(".v_scale", ".v_proj.output_amax"): v
             for k, v in KV.items()}
    write_calibration(tmp_path / "a.json", {"x.y": 1.0}, kv_amax=KV)
    write_calibration(tmp_path / "b.json", {}, kv_amax=alias)
    write_safetensors(tmp_path / "c.safetensors", {k: ("F32", np.array([v], np.float32)) for k, v in alias.items()},
                      {"format": "fp8ref-calibration/1", "holds": "amax"})
    for cal in ("a.json", "b.json", "c.safetensors"):
        export_checkpoint(tmp_path / "src", tmp_path / f"out_{cal}", SPEC, calibration=tmp_path / cal)
        out = SafetensorsFile(tmp_path / f"out_{cal}" / "model.safetensors")
        for name in KV:
            assert out.read_bytes(name).tobytes() == ref.read_bytes(name).tobytes(), (cal, name)


@pytest.mark.parametrize("fmt,spec", [("auto-round", {"scheme": "FP8_STATIC", "ignore": ["lm_head"]}),
                                      ("hf-fp8", {"scheme": "FP8_BLOCK", "ignore": ["lm_head"]})])
def test_formats_without_kv_scales_refuse_before_writing(tmp_path, fmt, spec):
    make_source(tmp_path / "src")
    before = snapshot(tmp_path / "src")
    with pytest.raises(CheckpointError, match=f"the {fmt} format cannot express KV-cache scales"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", spec, format=fmt, calibration=KV)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "src"]
    assert snapshot(tmp_path / "src") == before


@pytest.mark.parametrize("cal,match", [
    ({**KV, f"{ATTN[1]}.v_scale": None}, "expected a number"),
    ({**KV, f"{ATTN[1]}.v_scale": -1.0}, "finite number >= 0"),
    ({**KV, f"{ATTN[1]}.v_scale": float("nan")}, "finite number >= 0"),
    ({**KV, f"{ATTN[1]}.v_scale": True}, "expected a number"),
    ({**KV, f"{ATTN[1]}.v_scale": "1.0"}, "expected a number"),
    ({k: v for k, v in KV.items() if k != f"{ATTN[1]}.v_scale"}, "has a k amax but no v amax"),
    ({k: v for k, v in KV.items() if not k.startswith(ATTN[1])}, r"2 attention modules; none for \['model.layers.1"),
    ({**KV, "model.layers.7.self_attn.k_scale": 1.0}, "'model.layers.7.self_attn' is not an attention module"),
    ({**KV, f"{ATTN[0]}.k_proj.output_amax": 2.0}, "two values"),
    ({**KV, f"{ATTN[0]}.k_scale": 1e38}, "a KV-cache scale must be finite"),  # float16(1e38/448) = inf
])
def test_bad_kv_calibration_is_an_error_before_writing(tmp_path, cal, match):
    make_source(tmp_path / "src", "float16")
    with pytest.raises(CheckpointError, match=match):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=cal)
    assert not (tmp_path / "out").exists()


def test_same_amax_under_both_names_is_accepted(tmp_path):
    make_source(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC,
                      calibration={**KV, f"{ATTN[0]}.k_proj.output_amax": KV[f"{ATTN[0]}.k_scale"]})
    assert len(load_checkpoint(tmp_path / "out").kv_scales) == 4


def test_source_with_kv_scale_tensor_is_refused(tmp_path):
    tensors = make_source(tmp_path / "src")
    tensors[f"{ATTN[0]}.k_scale"] = ("BF16", np.ones(1, BF16))
    write_safetensors(tmp_path / "src" / "model.safetensors", tensors, {"format": "pt"})
    with pytest.raises(CheckpointError, match="already has the KV-cache scale"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", SPEC, calibration=KV)


def test_write_checkpoint_keeps_kv_scales(tmp_path):
    make_source(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "a", SPEC, calibration=KV, config_version="0.19")
    write_checkpoint(load_checkpoint(tmp_path / "a"), tmp_path / "b")  # keeps the 0.19 writer
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()
    b = load_checkpoint(tmp_path / "b")
    assert b.quantization_config["kv_cache_scheme"] == CT_019_KV_SCHEME and b.warnings == []
    with pytest.raises(CheckpointError, match="the hf-fp8 format cannot express it"):
        write_checkpoint(load_checkpoint(tmp_path / "a"), tmp_path / "c", format="hf-fp8")
    assert not (tmp_path / "c").exists()


def test_write_checkpoint_renames_old_output_scale_names(tmp_path):
    """Old compressed-tensors files name the KV scales k_proj.output_scale (0-dim here); the rewrite
    uses the current names and [1], bytes unchanged."""
    make_source(tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "a", SPEC, calibration=KV)
    f = SafetensorsFile(tmp_path / "a" / "model.safetensors")
    old = {}
    for n, info in f.tensors.items():
        target = n.replace(".k_scale", ".k_proj.output_scale").replace(".v_scale", ".v_proj.output_scale")
        data = f.read_bytes(n)
        arr = data.view(np.uint8) if info.dtype.startswith("F8") else data.view(NP["bfloat16"]).reshape(info.shape)
        old[target] = (info.dtype, arr.reshape(()) if target != n else arr.reshape(info.shape))
    (tmp_path / "old").mkdir()
    write_safetensors(tmp_path / "old" / "model.safetensors", old, {"format": "pt"})
    (tmp_path / "old" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    write_checkpoint(load_checkpoint(tmp_path / "old"), tmp_path / "b")
    out = SafetensorsFile(tmp_path / "b" / "model.safetensors")
    for name, amax in KV.items():
        assert (out.tensors[name].dtype, out.tensors[name].shape) == ("BF16", (1,))
        assert out.read_bytes(name).tobytes() == ct_scale_bits(amax, "bfloat16")
    assert not any(n.endswith("output_scale") for n in out.tensors)


def test_cli_quantize_writes_kv_scales(tmp_path, capsys):
    make_source(tmp_path / "src")
    (tmp_path / "spec.yaml").write_text("scheme: FP8_DYNAMIC\nignore: [lm_head]\n")
    write_calibration(tmp_path / "cal.json", {}, kv_amax=KV)
    assert run_cli("quantize", tmp_path / "src", tmp_path / "out", "--spec", tmp_path / "spec.yaml",
                   "--calibration", tmp_path / "cal.json", "--json", "-") == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []
    ckpt = load_checkpoint(tmp_path / "out")
    assert ckpt.tensor(f"{ATTN[1]}.v_scale").tobytes() == ct_scale_bits(448.0, "bfloat16")
    assert run_cli("quantize", tmp_path / "src", tmp_path / "o2", "--spec", tmp_path / "spec.yaml",
                   "--format", "auto-round", "--calibration", tmp_path / "cal.json") == 1
    assert "auto-round format cannot express KV-cache" in capsys.readouterr().err


_AMAX = st.one_of(st.sampled_from([0.0, 1e-45, 2.0 ** -149, 2.0 ** -126, 1.0, 448.0, 3.0e4, 65504.0 * 448]),
                  st.floats(0, 1e6, allow_nan=False, allow_infinity=False, width=32))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(amax=st.lists(_AMAX, min_size=4, max_size=4), dtype=st.sampled_from(["bfloat16", "float16", "float32"]))
def test_export_load_round_trips_kv_scales(tmp_path_factory, amax, dtype):
    tmp = tmp_path_factory.mktemp("kv")
    make_source(tmp / "src", dtype)
    cal = dict(zip(KV, amax, strict=True))
    if np.isinf(np.array([np.float32(max(amax)) / np.float32(448)]).astype(NP[dtype])).any():
        with pytest.raises(CheckpointError, match="must be finite"):
            export_checkpoint(tmp / "src", tmp / "out", SPEC, calibration=cal)
        return
    export_checkpoint(tmp / "src", tmp / "out", SPEC, calibration=cal)
    ckpt = load_checkpoint(tmp / "out")
    for name, a in cal.items():
        assert ckpt.tensor(name).tobytes() == ct_scale_bits(a, dtype), (name, a)
