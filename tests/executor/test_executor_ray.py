"""``--executor ray`` on a local two-worker Ray cluster (tox -e ray): ``verify``, ``compare``, ``eval``
and ``inspect --original`` write byte-identical JSON to the local run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
CKPTS = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _json(tmp_path, name, argv, progress_flag=True) -> bytes:
    from fp8ref.cli import main

    out = tmp_path / name
    assert main([*argv, "--json", str(out), *(["--no-progress"] if progress_flag else [])]) in (0, 1)
    return out.read_bytes()


def test_verify_ray_equals_local(tmp_path):
    argv = ["verify", str(CKPTS / "autoround_fp8_static_llmc"), "--original", str(CKPTS / "original_bf16")]
    local = _json(tmp_path, "local.json", argv)
    assert b'"recipe_source": "discovered"' in local  # the recipe search runs as tasks too
    assert _json(tmp_path, "ray.json", [*argv, "--executor", "ray"]) == local
    argv += ["--recipe", "compressed-tensors"]
    local = _json(tmp_path, "local.json", argv)
    assert b'"ok": false' in local  # mismatches (compressed-tensors' recipe on auto-round's bytes) travel too
    assert _json(tmp_path, "ray.json", [*argv, "--executor", "ray"]) == local


def test_compare_ray_equals_local(tmp_path):
    pytest.importorskip("transformers")
    argv = ["compare", str(CKPTS / "llmc_fp8"), "--original", str(CKPTS / "original_bf16"),
            "--modes", "reference,producer,original,backend:torch,reference:fp32", "--random", "2x8"]
    local = _json(tmp_path, "local.json", argv)
    assert _json(tmp_path, "ray.json", [*argv, "--executor", "ray"]) == local


def test_eval_ray_equals_local(tmp_path):
    """Each batch a task whose worker builds the model once: the perplexity's bytes as local."""
    pytest.importorskip("transformers")
    tokens = tmp_path / "ids.txt"
    tokens.write_text("\n".join(" ".join(str((7 * i + 3 * j) % 128) for j in range(10)) for i in range(5)) + "\n")
    argv = ["eval", str(CKPTS / "llmc_fp8"), "--tokens", str(tokens), "--batch", "2"]
    local = _json(tmp_path, "local.json", argv)
    assert b'"sequences": 5' in local
    assert _json(tmp_path, "ray.json", [*argv, "--executor", "ray"]) == local


def test_inspect_original_ray_equals_local(tmp_path):
    argv = ["inspect", str(CKPTS / "llmc_fp8"), "--original", str(CKPTS / "original_bf16")]
    local = _json(tmp_path, "local.json", argv, progress_flag=False)
    assert b'"snr_db"' in local
    assert _json(tmp_path, "ray.json", [*argv, "--executor", "ray"], progress_flag=False) == local


def test_compare_gptoss_ray_equals_local(tmp_path):
    """gpt-oss's per-expert rows (no checkpoint layer of their own) run here, the other rows on workers."""
    pytest.importorskip("transformers")
    gptoss = CKPTS.parent.parent / "gptoss"
    argv = ["compare", str(gptoss / "mxfp4"), "--original", str(gptoss / "original_bf16"),
            "--modes", "reference,reference:fp32,original", "--random", "2x8"]
    local = _json(tmp_path, "local.json", argv)
    assert b".mlp.experts.0.gate_up_proj" in local or b".mlp.experts.1.gate_up_proj" in local
    assert _json(tmp_path, "ray.json", [*argv, "--executor", "ray"]) == local
