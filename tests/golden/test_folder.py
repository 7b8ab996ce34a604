"""Golden folders: byte-identical generation, tamper-evident verify, check of outputs files."""

import hashlib
import json
import re
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file

from fp8ref.errors import GoldenError
from fp8ref.golden import check, generate, load_suite, parse_suite, verify
from fp8ref.golden.folder import MANIFEST
from fp8ref.io import safetensors as st
from fp8ref.io.outputs import MARKER

SUITE = """\
suite: small
seed: 11
operations:
  - op: encode
    formats: [float8_e4m3fn, float8_e5m2, float4_e2m1fn]
    rounding: [rne, stochastic]
    saturate: [true, false]
    input_dtypes: [float32, bfloat16]
    random: {1: 64}
  - op: decode
    formats: [float8_e4m3fn]
  - op: quantize
    schemes: [FP8_STATIC]
    recipes: [compressed-tensors, fp8ref]
    roles: [weight, activation]
    dtypes: [bfloat16]
    shapes: {1: [[8, 48]]}
  - op: scaled_mm
    shapes: {1: [[4, 40, 6]]}
    out_dtypes: [bfloat16]
    accumulate: [exact]
    bias: [true]
"""


@pytest.fixture(scope="module")
def suite():
    return parse_suite(SUITE, source="small.yaml")


@pytest.fixture
def folder(tmp_path, suite):
    generate(suite, tmp_path / "g")
    return tmp_path / "g"


def _bytes(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_generation_is_byte_identical(tmp_path, suite):
    generate(suite, tmp_path / "a")
    generate(suite, tmp_path / "b")
    a, b = _bytes(tmp_path / "a"), _bytes(tmp_path / "b")
    assert a == b
    assert set(a) == {MARKER, MANIFEST, "suite.yaml", "encode.inputs.safetensors", "encode.expected.safetensors",
                      "decode.inputs.safetensors", "decode.expected.safetensors", "quantize.inputs.safetensors",
                      "quantize.expected.safetensors", "scaled_mm.inputs.safetensors",
                      "scaled_mm.expected.safetensors"}


def test_manifest_records_hashes_and_provenance(folder, suite):
    m = json.loads((folder / MANIFEST).read_bytes())
    assert (m["suite"], m["seed"], m["level"], m["suite_sha256"]) == ("small", 11, 1, suite.sha256)
    for name, digest in m["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
    assert (folder / MANIFEST).read_text() == json.dumps(m, sort_keys=True, indent=1, separators=(",", ": ")) + "\n"


def test_files_are_valid_safetensors_for_the_reference_reader(folder):
    ours = st.load(folder / "encode.inputs.safetensors")
    theirs = load_file(str(folder / "encode.expected.safetensors"))
    expected = st.load(folder / "encode.expected.safetensors")
    assert set(theirs) == set(expected) and all(np.array_equal(theirs[k], expected[k]) for k in theirs)
    assert any(v.dtype.name == "bfloat16" for v in ours.values())
    assert any(k.endswith("/random_bits") for k in ours)


def test_decode_expected_matches_ml_dtypes(folder):
    import ml_dtypes

    got = st.load(folder / "decode.expected.safetensors")["decode.float8_e4m3fn/values"]
    peer = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nan = np.isnan(peer)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), peer[~nan].view(np.uint32))  # -0.0 included


def test_verify_accepts_an_intact_folder(folder):
    assert verify(folder) == ([], [])


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "encode.expected.safetensors").unlink(), "missing file 'encode.expected.safetensors'"),
    (lambda d: (d / "notes.txt").write_text("hi"), "extra file 'notes.txt'"),
    (lambda d: _flip(d / "quantize.inputs.safetensors"), "modified file 'quantize.inputs.safetensors'"),
    (lambda d: (d / MANIFEST).unlink(), "MANIFEST.json: missing"),
])
def test_verify_names_the_damaged_file(folder, damage, message):
    damage(folder)
    with pytest.raises(GoldenError, match=message.replace("(", r"\(")):
        verify(folder)


def _flip(path, offset=-1):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_rederives_expected_outputs(folder):
    """A wrong expected output with a matching sha256 (a tampered manifest, or a different
    fp8ref) is caught by re-deriving it, and the case is named."""
    name = "encode.expected.safetensors"
    tensors = st.load(folder / name)
    key = "encode.float8_e4m3fn.rne.sat.float32/codes"
    tensors[key] = tensors[key].copy()
    tensors[key][0] ^= 1
    data = st.save(folder / name, tensors, {"producer": "fp8ref golden"})
    m = json.loads((folder / MANIFEST).read_bytes())
    m["files"][name] = hashlib.sha256(data).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(m))
    problems, _ = verify(folder)
    assert problems == ["case 'encode.float8_e4m3fn.rne.sat.float32' output 'codes': re-derived output differs "
                        "(1 bytes)"]


def _outputs(folder):
    out = {}
    for op in ("encode", "decode", "quantize", "scaled_mm"):
        out.update(st.load(folder / f"{op}.expected.safetensors"))
    return out


def test_check_passes_the_expected_outputs(folder, tmp_path):
    st.save(tmp_path / "out.safetensors", _outputs(folder))
    results, problems = check(folder, tmp_path / "out.safetensors")
    assert problems == [] and all(r.status == "compared" and not r.mismatches for r in results)
    assert sum(r.elements for r in results) > 1000


def test_check_finds_a_changed_code_and_names_it(folder, tmp_path):
    out = _outputs(folder)
    key = "encode.float8_e5m2.rne.nosat.float32/codes"
    out[key] = out[key].copy()
    i = int(np.flatnonzero(out[key] == 0x3C)[0])  # 1.0
    out[key][i] = 0x3D
    st.save(tmp_path / "out.safetensors", out)
    results, _ = check(folder, tmp_path / "out.safetensors")
    bad = [m for r in results for m in r.mismatches]
    assert len(bad) == 1 and bad[0].case == key.split("/")[0] and bad[0].index == (i,) and bad[0].ulp == 1


def test_check_reports_missing_unknown_and_misshapen_outputs(folder, tmp_path):
    out = _outputs(folder)
    del out["decode.float8_e4m3fn/values"]
    out["decode.float8_e4m3fx/values"] = np.zeros(3, np.float32)
    out["encode.float8_e4m3fn.rne.sat.float32/codes"] = np.zeros(2, np.uint8)
    st.save(tmp_path / "out.safetensors", out)
    results, problems = check(folder, tmp_path / "out.safetensors")
    status = {r.case: r.status for r in results}
    assert status["decode.float8_e4m3fn"] == "missing"
    assert status["encode.float8_e4m3fn.rne.sat.float32"] == "error"
    assert any("unknown tensor 'decode.float8_e4m3fx/values'" in p for p in problems)
    assert any("have no outputs" in p for p in problems)
    _, problems = check(folder, tmp_path / "out.safetensors", allow_missing=True)
    assert not any("have no outputs" in p for p in problems)


def test_generate_refuses_a_non_empty_folder(folder, suite):
    with pytest.raises(GoldenError, match="not empty"):
        generate(suite, folder)


def test_bad_outputs_file_is_a_clear_error(folder, tmp_path):
    (tmp_path / "out.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(GoldenError, match="header is not valid JSON"):
        check(folder, tmp_path / "out.safetensors")


def _crafted(header: dict | bytes, body: bytes) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


_U8 = {"dtype": "U8", "shape": [4]}


@pytest.mark.parametrize("raw, message", [
    # two entries with one name: json.loads would keep the last one silently
    (_crafted(b'{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, '
              b'"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}', bytes(4)), "duplicate key 'a'"),
    (_crafted({"a": {**_U8, "data_offsets": [0, 4]}, "b": {**_U8, "data_offsets": [2, 6]}}, bytes(6)),
     "overlaps the previous tensor"),
    (_crafted({"a": {**_U8, "data_offsets": [0, 4]}, "b": {**_U8, "data_offsets": [6, 10]}}, bytes(10)),
     "leaves a gap"),
    (_crafted({"a": {**_U8, "data_offsets": [0, 4]}}, bytes(7)), "3 unexpected bytes after the last tensor"),
    (_crafted({"a": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, bytes(4)),
     "dtype F8_E4M3 is not accepted here"),
])
def test_check_reads_outputs_strictly(folder, tmp_path, raw, message):
    # The outputs file comes from another language: golden check reads it with the checkpoint
    # reader's rules, and every violation is one GoldenError line that names the file.
    out = tmp_path / "out.safetensors"
    out.write_bytes(raw)
    with pytest.raises(GoldenError, match=re.escape(message)) as err:
        check(folder, out)
    assert str(err.value).startswith(f"{out}: ") and "\n" not in str(err.value)


def test_shipped_suites_generate_and_verify(tmp_path):
    for name in ("formats", "fp8-static-w8a8"):
        generate(load_suite(name), tmp_path / name)
        assert verify(tmp_path / name)[0] == []


# --- tamper evidence: the manifest is not hashed, so what it says must follow from the hashed suite
def _rewrite_manifest(folder, edit):
    m = json.loads((folder / MANIFEST).read_bytes())
    edit(m)
    (folder / MANIFEST).write_text(json.dumps(m))


def _rehash(folder, name, tensors):
    data = st.save(folder / name, tensors, {"producer": "fp8ref golden"})
    _rewrite_manifest(folder, lambda m: m["files"].__setitem__(name, hashlib.sha256(data).hexdigest()))


def _drop_scaled_mm(m, files_too=False):
    m["cases"] = [c for c in m["cases"] if c["op"] != "scaled_mm"]
    if files_too:
        for kind in ("inputs", "expected"):
            del m["files"][f"scaled_mm.{kind}.safetensors"]


@pytest.mark.parametrize("files_too", [False, True], ids=["cases", "cases-and-files"])
def test_a_manifest_that_drops_cases_fails_verify_and_check(folder, tmp_path, files_too, capsys):
    from tests.support.cli import run_cli

    st.save(tmp_path / "out.safetensors", _outputs(folder))
    _rewrite_manifest(folder, lambda m: _drop_scaled_mm(m, files_too))
    if files_too:
        for kind in ("inputs", "expected"):
            (folder / f"scaled_mm.{kind}.safetensors").unlink()
    message = r"cases do not match suite.yaml at level 1 \(\d+ listed, \d+ derived\): 2 case\(s\) of the suite missing"
    with pytest.raises(GoldenError, match=message):
        verify(folder)
    with pytest.raises(GoldenError, match=message):
        check(folder, tmp_path / "out.safetensors", allow_missing=True)
    assert run_cli("golden", "verify", folder, "--quiet") == 1
    assert run_cli("golden", "check", folder, "--outputs", tmp_path / "out.safetensors") == 1
    assert "cases do not match" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.__setitem__("level", 3), "level: expected one of [1, 2], got 3"),
    (lambda m: m["cases"][0]["params"].__setitem__("rounding", "rtz"), "with other operations or parameters"),
    (lambda m: m["cases"].append(m["cases"][0]), "in another order or more than once"),
    (lambda m: m["cases"][-1]["outputs"].clear(), "outputs must be"),
    (lambda m: m.__setitem__("suite", "other"), "suite, suite_sha256 or seed do not match"),
    (lambda m: m["files"].__setitem__("extra.safetensors", "0" * 64), "missing file 'extra.safetensors'"),
    (lambda m: m.__setitem__("suite_file", "../small.yaml"), "suite_file: expected the name of a file"),
    (lambda m: m.__setitem__("suite_file", "/etc/passwd"), "suite_file: expected the name of a file"),
])
def test_every_manifest_field_is_checked_against_the_hashed_files(folder, edit, message):
    _rewrite_manifest(folder, edit)
    with pytest.raises(GoldenError, match=re.escape(message) if "(" not in message else message):
        verify(folder)


def test_orphaned_tensors_are_reported(folder, tmp_path):
    name = "encode.expected.safetensors"
    tensors = st.load(folder / name)
    tensors["encode.hidden/codes"] = np.zeros(4, np.uint8)
    _rehash(folder, name, tensors)
    problems, _ = verify(folder)
    assert problems == [f"orphaned tensor 'encode.hidden/codes' in {name} (no case of MANIFEST.json uses it)"]
    st.save(tmp_path / "out.safetensors", _outputs(folder))
    _, problems = check(folder, tmp_path / "out.safetensors")
    assert problems[0].startswith("orphaned tensor 'encode.hidden/codes'")


def test_verify_regenerates_the_inputs(folder):
    """An input changed together with its expected output and both hashes is still caught: the
    suite, its seed and level determine every input."""
    from fp8ref.golden.ops import OPERATIONS

    m = json.loads((folder / MANIFEST).read_bytes())
    entry = next(c for c in m["cases"] if c["op"] == "encode")
    ins, exps = st.load(folder / "encode.inputs.safetensors"), st.load(folder / "encode.expected.safetensors")
    key = f"{entry['name']}/x"
    ins[key] = np.zeros_like(ins[key])
    case_inputs = {k: ins[f"{entry['name']}/{k}"] for k in entry["inputs"]}
    for k, v in OPERATIONS["encode"].reference(entry["params"], case_inputs).items():
        exps[f"{entry['name']}/{k}"] = v
    _rehash(folder, "encode.inputs.safetensors", ins)
    _rehash(folder, "encode.expected.safetensors", exps)
    problems, _ = verify(folder)
    assert problems == [f"case {entry['name']!r} input 'x': differs from the input the suite generates"]
