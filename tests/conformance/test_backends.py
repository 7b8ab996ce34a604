"""Finding backends, and the built-in adapters against the real peers installed here."""

import importlib.util
from importlib import metadata

import pytest

from fp8ref.conformance import BackendUnavailable, default_xfails, known_backends, load_backend, run
from fp8ref.errors import BackendError
from fp8ref.golden import load_suite
from tests.support.cli import run_cli


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(BackendError, match=r"unknown backend 'torhc'; did you mean 'torch'\?.*known: .*ml_dtypes"):
        load_backend("torhc")


def test_module_object_and_dashed_names():
    assert load_backend("tests.support.broken_backends:instance").name == "round-half-up"
    assert load_backend("tests.support.broken_backends:FlushSubnormals").name == "flush-subnormals"
    assert load_backend("ml-dtypes").name == "ml_dtypes"
    with pytest.raises(BackendError, match="has no attribute 'Nope'"):
        load_backend("tests.support.broken_backends:Nope")
    with pytest.raises(BackendError, match="cannot import module 'no_such_mod'"):
        load_backend("no_such_mod:x")


def test_entry_point_group_registers_third_party_backends(monkeypatch):
    ep = metadata.EntryPoint("broken", "tests.support.broken_backends:OffByOneExponent", "fp8ref.backends")
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points",
                        lambda **kw: [ep] if kw.get("group") == "fp8ref.backends" else real(**kw))
    assert known_backends()["broken"] == "tests.support.broken_backends:OffByOneExponent"
    assert load_backend("broken").name == "off-by-one-exponent"


@pytest.mark.parametrize("name, module", [("compressed_tensors", "compressed_tensors"), ("auto_round", "auto_round")])
def test_missing_peers_are_unavailable_with_a_reason(name, module):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here (tests/conformance/test_producers.py runs it)")
    with pytest.raises(BackendUnavailable, match=f"{name.replace('_', '-')} is not installed"):
        load_backend(name)


def test_cli_unknown_backend_and_missing_peer_exit_nonzero(capsys):
    assert run_cli("conform", "--backend", "nope") == 1
    known = "auto_round, compressed_tensors, gfloat, gguf, ml_dtypes, naive_block, onnx_reference, onnxruntime, "
    known += "openvino, openvino_fakeconvert, torch"
    assert f"known: {known}" in capsys.readouterr().err
    assert run_cli("conform", "--list-backends") == 0


@pytest.mark.parametrize("name", ["torch", "ml_dtypes", "gfloat"])
def test_peer_differs_only_where_documented(name):
    """The shipped suites at level 1 against the real peer: every difference is in its xfails
    file, and every xfails entry still matches something (none is stale)."""
    pytest.importorskip(name)  # the peers extra installs ml_dtypes' and gfloat's latest checked versions
    backend = load_backend(name)
    xfails = default_xfails(name)
    results = [run(backend, load_suite(s), xfails=xfails) for s in ("formats", "fp8-static-w8a8", "fp8-attention")]
    assert all(r.unexpected == 0 for r in results), [
        (x.case, x.reason or x.mismatches[0]) for r in results for x in r.results
        if (x.status == "error" and not r.xfailed(x.case, ("error",))) or
        any(not r.xfailed(m.case, m.tags) for m in x.mismatches)][:5]
    assert sum(r.compared() for r in results) > 20
    assert [e.text for e in xfails.stale()] == []


def test_torch_findings_are_real_and_minimal():
    """What the README reports: torch saturates e4m3fn where OCP non-saturating gives NaN."""
    result = run("torch", load_suite("formats"), select=lambda n: n == "encode.float8_e4m3fn.rne.nosat.float32")
    (r,) = result.results
    tags = {m.tags for m in r.mismatches}
    assert ("inf-input",) in tags and ("overflow",) in tags
    assert all(int(m.expected) in (0x7F, 0xFF) and int(m.got) in (0x7E, 0xFE) for m in r.mismatches)


def test_cli_conform_prints_lines_table_and_json(tmp_path, capsys):
    code = run_cli("conform", "--backend", "torch", "--suite", "formats", "--no-xfails", "--case",
               "encode.float8_e4m3fn.rne.nosat.float32", "--json", tmp_path / "r.json", "--max-errors", "2")
    text = capsys.readouterr().out
    assert code == 1
    assert "expected 0x7f (+.1111.111 nan)  got 0x7e (+.1111.110 448)" in text
    assert "repro: python -c" in text and "more unexpected encode mismatches not shown" in text
    assert "operation  cases  not impl." in text
    assert '"exit_code": 1' in (tmp_path / "r.json").read_text()
    assert run_cli("conform", "--backend", "torch", "--suite", "formats", "--case",
               "encode.float8_e4m3fn.rne.nosat.float32") == 0


@pytest.mark.parametrize("caps, message", [
    ({"encdoe": {}}, r"capabilities\['encdoe'\]: unknown operation; expected one of \['attention', 'decode', "
                     r"'dequantize', 'encode'"),
    ({"encode": {"fomat": ("float8_e4m3fn",)}},
     r"capabilities\['encode'\]: unknown parameter 'fomat'; encode cases have \['format', 'rounding'"),
    ({"decode": {"format": ("float8_e4m3fn",)}}, r"capabilities\['decode'\]: declared but the backend has no "
                                                  r"method decode\(codes, fmt\)"),
])
def test_capabilities_are_checked_against_the_operations_table(caps, message):
    from fp8ref.conformance import Backend

    class Typo(Backend):
        name = "typo"
        capabilities = caps

        def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
            raise AssertionError("never called")

    with pytest.raises(BackendError, match=message):
        run(Typo(), load_suite("formats"))


def test_every_builtin_adapter_declares_only_what_the_table_has():
    from fp8ref.conformance.backend import BUILTIN, check_capabilities
    from fp8ref.conformance.backend import _instantiate as instantiate

    for name, target in BUILTIN.items():
        check_capabilities(instantiate(target, name))  # no peer needed: capabilities are class data


@pytest.mark.parametrize("target, message", [
    ("RaisesAtConstruction", r"constructing .*RaisesAtConstruction failed: RuntimeError: no device found"),
    ("ExitsAtConstruction", r"constructing .*ExitsAtConstruction failed: called sys.exit\(3\)"),
    ("exits_factory", r"exits_factory failed: called sys.exit\('bye'\)"),
])
def test_a_backend_failing_while_loaded_is_one_backend_error(target, message):
    with pytest.raises(BackendError, match=message):
        load_backend(f"tests.support.broken_backends:{target}")


def test_a_backend_module_failing_at_import_is_one_backend_error(tmp_path, monkeypatch):
    (tmp_path / "explodes_at_import.py").write_text("raise RuntimeError('CUDA not found')\n")
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(7)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BackendError, match=r"importing module 'explodes_at_import' failed: RuntimeError: CUDA"):
        load_backend("explodes_at_import:B")
    with pytest.raises(BackendError, match=r"importing module 'exits_at_import' failed: called sys.exit\(7\)"):
        load_backend("exits_at_import:B")


def test_a_backend_raising_in_implements_is_one_backend_error(capsys):
    with pytest.raises(BackendError, match=r"'raises-in-implements'.*implements\('encode', \.\.\.\) failed: KeyError"):
        run("tests.support.broken_backends:RaisesInImplements", "formats")
    assert run_cli("conform", "--backend", "tests.support.broken_backends:ExitsAtConstruction") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fp8ref: error: backend ") and "sys.exit(3)" in err


def test_the_contract_is_checked_when_a_backend_is_loaded():
    from fp8ref.conformance import Backend
    from fp8ref.conformance.backend import check_capabilities

    class NoKeywords(Backend):
        name = "no-keywords"
        capabilities = {"encode": {"format": ["float8_e4m3fn"]}}

        def encode(self, x, fmt):
            return x

    with pytest.raises(BackendError, match=r"method encode\(x, fmt\) cannot take the contract's call "
                                           r"encode\(x, fmt, \*, rounding, saturate, random_bits=None\)"):
        check_capabilities(NoKeywords())

    class StringCaps(Backend):
        name = "string-caps"
        capabilities = {"encode": {"rounding": "rne"}}  # 'r' in "rne" would be True

        def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
            return x

    with pytest.raises(BackendError, match=r"capabilities\['encode'\]\['rounding'\]: expected a list"):
        check_capabilities(StringCaps())


def test_an_output_that_cannot_be_converted_says_so():
    from fp8ref.conformance import Backend
    from fp8ref.golden import parse_suite

    class Unconvertible(Backend):
        name = "unconvertible"
        capabilities = {"decode": {"format": ["float8_e4m3fn"]}}

        def decode(self, codes, fmt):
            class Weird:
                def __array__(self, *a, **k):
                    raise TypeError("Got unsupported ScalarType BFloat16")
            return Weird()

    suite = parse_suite("suite: d\nseed: 1\noperations:\n  - op: decode\n    formats: [float8_e4m3fn]\n", source="d")
    r = run(Unconvertible(), suite).results[0]
    assert r.status == "error" and "cannot convert the backend's output (Weird) to a numpy array" in r.reason


def test_suites_for_a_backend_are_its_own_defaults_and_the_capability_suites_it_declares():
    """One choice for `fp8ref conform` and the pytest plugin (fp8ref.conformance.backend.suites_for)."""
    from fp8ref.conformance.adapters.naive_block_backend import NaiveBlockBackend
    from fp8ref.conformance.adapters.torch_backend import TorchBackend
    from fp8ref.conformance.backend import suites_for

    torch_skip = "suite block-scaled skipped: backend 'torch' declares no scaled_mm with scales block16 or block32"
    assert suites_for(TorchBackend()) == (["formats", "fp8-static-w8a8"], [torch_skip])
    assert suites_for(TorchBackend(), ["onnx"]) == (["onnx"], [])  # what was asked, as given
    assert suites_for(NaiveBlockBackend()) == (["formats", "fp8-static-w8a8", "block-scaled"], [])

    class OwnDefaults(NaiveBlockBackend):
        default_suites = ("block-scaled", "degenerate")

    assert suites_for(OwnDefaults()) == (["block-scaled", "degenerate"], [])  # each suite once

    class NotAList(NaiveBlockBackend):
        default_suites = "degenerate"

    with pytest.raises(BackendError, match=r"'naive_block': default_suites: expected a list of suite names, "
                                           r"got 'degenerate'"):
        suites_for(NotAList())

    class Raises(NaiveBlockBackend):
        @property
        def default_suites(self):
            raise RuntimeError("no config")

    with pytest.raises(BackendError, match=r"reading default_suites failed: RuntimeError: no config"):
        suites_for(Raises())
