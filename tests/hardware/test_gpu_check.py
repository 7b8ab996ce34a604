"""tools/gpu_check.py, the prepared H200 run (issue #27), kept from rotting: its dry run end to end on
CPU, and the layouts its raw ``wgmma`` kernel relies on (tools/gpu_wgmma.py), checked against their
definitions element by element."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wg = _load("gpu_wgmma")


def test_the_dry_run_writes_every_part_and_skips_what_needs_the_gpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = report["parts"]
    assert report["dry_run"] is True and list(parts) == ["scaled_mm", "wgmma", "casts", "ct_triton", "not_carried"]
    for name in ("scaled_mm", "wgmma", "casts", "ct_triton"):
        assert parts[name]["status"].startswith("skipped: no GPU"), parts[name]["status"]
    # the CPU stand-in went through the whole ranking: every GEMM case compared, fp32 ranked first
    torch_cpu = parts["scaled_mm"]["backends"]["torch"]
    assert torch_cpu["cases"]["compared"] > 0 and not torch_cpu["errors"]
    assert torch_cpu["ranking"]["best"] == "fp32", torch_cpu["ranking_text"]
    assert set(torch_cpu["k128"]) == {f"{f} {s} {o}" for f in ("float8_e4m3fn", "float8_e5m2")
                                      for s in ("tensor", "row") for o in ("float32", "bfloat16")}
    assert parts["wgmma"]["reference"] == {f"{a} x {b}": 2 for a in ("float8_e4m3fn", "float8_e5m2")
                                           for b in ("float8_e4m3fn", "float8_e5m2")}
    assert (tmp_path / "wgmma.ptx").read_text().count("wgmma.mma_async.sync.aligned.m64n256k32.f32.") == 4
    # torch's CPU casts: e5m2 and saturating e4m3 agree with fp8ref.encode on every boundary input;
    # non-saturating e4m3 saturates in torch >= 2.12 (fp8ref: NaN), the deviation the torch xfails name
    sets = parts["casts"]["sets"]
    assert len(sets) == 12
    for name, s in sets.items():
        nosat_e4m3 = name.startswith("float8_e4m3fn") and name.endswith("saturate=False")
        assert (s["differ"] > 0) == nosat_e4m3, (name, s["first"])
    assert all(s["first"][0]["got"] == "0x7e" for n, s in sets.items() if s["differ"])
    ct = parts["ct_triton"]["cases"]
    assert all(c["gpu_vs_cpu_recipe_differ"] > 0 for c in ct.values() if c["codes"] > 0)
    assert "| wgmma | skipped: no GPU" in (tmp_path / "gpu_check.md").read_text()


def test_a_spent_budget_still_writes_the_report(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--quick",
                           "--budget", "0", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert {p["status"] for p in parts.values()} == {"not reached: the budget was spent"}


def test_shared_memory_layout_puts_each_element_in_its_core_matrix():
    x = np.arange(64 * 32, dtype=np.int64).reshape(64, 32) % 251
    flat = wg.smem_layout(x.astype(np.uint8))
    for r in range(64):
        for k in range(32):
            assert flat[(r // 8) * 256 + (k // 16) * 128 + (r % 8) * 16 + k % 16] == x[r, k]


def test_fragment_order_covers_the_accumulator_once_and_round_trips():
    rows, cols = wg.fragment_index()
    assert sorted(zip(rows.ravel().tolist(), cols.ravel().tolist())) == [(r, c) for r in range(64) for c in range(256)]
    # PTX ISA's wgmma D fragment: thread 0 holds (0,0) (0,1) (8,0) (8,1) (0,8) ...; lane 5 of warp 1 starts at (17, 2)
    assert list(zip(rows[0, :5], cols[0, :5])) == [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8)]
    assert (rows[37, 0], cols[37, 0]) == (17, 2)
    c = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    assert np.array_equal(wg.from_fragments(wg.to_fragments(c)), c)


def test_descriptor_fields_sit_in_bits_16_and_32():
    assert wg.descriptor_fields(128, 256) == (8 << 16) | (16 << 32)
    assert {wg.DESCRIPTOR_VARIANTS[k] for k in wg.DESCRIPTOR_VARIANTS} == {(128, 256), (256, 128)}


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA) not on PATH")
def test_ptxas_accepts_the_kernel_for_sm_90a():
    pairs = [(a, b) for a in wg.TYPES for b in wg.TYPES]
    cubin, why = wg.ptxas_check(wg.ptx(pairs))
    assert cubin is not None, why
