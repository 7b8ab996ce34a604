"""The probe recovers the parameters of fp8ref's own kernel models, drawn at random, exactly;
and says what torch's CPU _scaled_mm is on this machine."""

from __future__ import annotations

import numpy as np
import pytest

from fp8ref.hardware import Kernel
from fp8ref.hardware.probe import matching_models, model_gemm, probe

# (instruction, F, elements per fused step) of the instruction families the probe's values fit
FAMILIES = [
    (("wgmma", "hopper", "m64n8k32.f32.e4m3.e4m3"), 13, 32),
    (("mma", "ada", "m16n8k32.f32.e4m3.e4m3.f32"), 13, 16),
    (("tcgen05.mma", "blackwell", "m64n8k32.kind::f8f6f4.f32.e4m3.e4m3"), 25, 32),
    (("mma", "rtx blackwell", "m16n8k32.f32.e5m2.e4m3.f32"), 25, 32),
    (("mfma", "cdna3", "f32_16x16x32_fp8_fp8"), 24, 16),
]


def _draw(seed: int):
    rng = np.random.default_rng(seed)
    ins, F, L = FAMILIES[seed % len(FAMILIES)]
    k = 32 if ins[0] != "mfma" else 32
    promote = None if rng.random() < 0.3 else int(rng.choice([k, 2 * k, 4 * k, 8 * k]))
    return Kernel(f"drawn-{seed}", ins, promote_every=promote, promote=str(rng.choice(["add", "fma"]))), F, L


@pytest.mark.parametrize("seed", range(5))
def test_probe_recovers_drawn_parameters(seed):
    kernel, F, L = _draw(seed)
    found = probe(model_gemm(kernel))
    assert found["fraction_bits"]["value"] == F
    assert found["rounding"]["value"] == "truncate"
    assert found["block"]["value"] == L
    if F < 22:
        assert found["promote_every"]["value"] == kernel.promote_every
    assert found["c_aligned"]["value"] is True
    if kernel.ins.datapath.family == "fused":
        assert found["order"]["value"] == f"fused blocks of {L}"


def test_probe_names_the_matching_preset():
    found = probe(model_gemm("hopper-promoted"))
    assert "hopper-promoted" in matching_models(found)
    assert "hopper-fast-accum" not in matching_models(found)


def test_torch_cpu_scaled_mm_is_an_fp32_gemm():
    """torch's CPU _scaled_mm decodes to fp32 and runs an fp32 GEMM: no tensor-core model matches.
    On the development machine (README) the probe read 23 fraction bits, nearest rounding, every
    addition normalised, sequential in k; the BLAS order is the machine's (REFERENCE.md E12), so
    only what any fp32 GEMM shows is asserted."""
    pytest.importorskip("torch")
    from fp8ref.cli.probe import backend_gemm
    from fp8ref.conformance import load_backend

    found = probe(backend_gemm(load_backend("torch")))
    assert found["fraction_bits"]["value"] in (23, None)  # None: an order that cancels +-B first
    if found["fraction_bits"]["value"] == 23:
        assert found["rounding"]["value"] == "nearest"
    assert matching_models(found) == []


def test_probe_cli_json_and_errors(capsys):
    import json

    from fp8ref.cli import main

    assert main(["probe", "--model", "hopper-fast-accum", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["subject"] == "model hopper-fast-accum"
    assert report["fraction_bits"]["value"] == 13 and report["promote_every"]["value"] is None
    assert "hopper-fast-accum" in report["matches"]
    assert main(["probe", "--backend", "no_such_backend"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error: unknown backend") and "Traceback" not in err
