"""Golden folders: write them (generate), check their integrity and re-derive their expected
outputs (verify), and compare a backend's outputs file against them (check).

A folder holds, for each operation OP of the suite, ``OP.inputs.safetensors`` and
``OP.expected.safetensors`` (tensors named ``<case>/<input>`` and ``<case>/<output>``), the
suite as ``suite.yaml``, and ``MANIFEST.json`` (fp8ref version, suite hash, seed, level,
sha256 of every file, and every case's operation, parameters and tensor names).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import __version__
from ..errors import GoldenError
from ..io import safetensors as st
from ..io.atomic import atomic_folder, check_output_folder
from ..io.files import read_bytes, read_json, read_text, write_bytes
from ..io.outputs import MARKER
from .accumulation import ModelJudge, covers
from .case import Case
from .fields import LEVELS
from .judge import ACCUMULATION_ORDERS, CaseResult, OutputError, bound_reason, exact_params, judge_output
from .ops import OPERATIONS
from .suite import Suite, build, cases, count_cases, parse_suite

MANIFEST = "MANIFEST.json"
SUITE_FILE = "suite.yaml"
LAYOUT = "fp8ref-golden/1"
_META = {"producer": "fp8ref golden"}

Progress = Callable[[int, int, str], None]  # (done, total, case name)


def dump_json(obj) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, separators=(",", ": "), ensure_ascii=True) + "\n").encode()


def _spec(a: np.ndarray) -> dict:
    return {"dtype": st.dtype_name(a), "shape": list(a.shape)}


def _load(path: Path) -> dict[str, np.ndarray]:
    """A golden or outputs file, strictly read (another language may have written it)."""
    return st.load(path, error=GoldenError, dtypes=st.PLAIN_DTYPES)


def generate(suite: Suite, out_dir: str | Path, *, level: int | None = None,
             progress: Progress | None = None, force: bool = False) -> dict:
    """Write the golden folder of ``suite`` at ``level`` (default: the suite's); returns the manifest.
    The folder appears complete or not at all (a full disk or a kill leaves nothing); an existing
    one is replaced only when it is empty, or with ``force`` when fp8ref wrote it (``io.outputs``).
    The suite's file is never inside the output."""
    level = suite.level if level is None else level
    out = Path(out_dir)
    protect = [suite.source] if Path(suite.source).is_file() else []
    check_output_folder(out, force=force, protect=protect, error=GoldenError)
    total = count_cases(suite, level)
    per_op: dict[str, tuple[dict, dict]] = {}
    entries = []
    for done, case in enumerate(build(suite, level), 1):
        expected = OPERATIONS[case.op].reference(case.params, case.inputs)
        ins, exps = per_op.setdefault(case.op, ({}, {}))
        ins.update({f"{case.name}/{k}": v for k, v in case.inputs.items()})
        exps.update({f"{case.name}/{k}": v for k, v in expected.items()})
        entries.append({"name": case.name, "op": case.op, "params": dict(case.params),
                        "n_special": case.n_special,
                        "inputs": {k: _spec(v) for k, v in case.inputs.items()},
                        "outputs": {k: _spec(v) for k, v in expected.items()}})
        if progress:
            progress(done, total, case.name)
    files = {SUITE_FILE: suite.text.encode()}
    for op, (ins, exps) in sorted(per_op.items()):
        files[f"{op}.inputs.safetensors"] = st.dumps(ins, _META)
        files[f"{op}.expected.safetensors"] = st.dumps(exps, _META)
    manifest = {
        "layout": LAYOUT, "fp8ref_version": __version__, "suite": suite.name,
        "suite_file": SUITE_FILE, "suite_sha256": suite.sha256, "seed": suite.seed, "level": level,
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
        "cases": entries,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(out, force=force, protect=protect, error=GoldenError) as tmp:
        for name, data in files.items():
            write_bytes(tmp / name, data)
        write_bytes(tmp / MANIFEST, dump_json(manifest))
    return manifest


# --- reading a folder --------------------------------------------------------------------------
@dataclass
class Golden:
    """A golden folder whose files were all present, listed and unmodified."""

    path: Path
    manifest: dict
    suite: Suite
    _tensors: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    _used: set[tuple[str, str]] = field(default_factory=set)

    def tensors(self, op: str, kind: str) -> dict[str, np.ndarray]:
        name = f"{op}.{kind}.safetensors"
        if name not in self._tensors:
            self._tensors[name] = _load(self.path / name)
        return self._tensors[name]

    def iter_cases(self):
        """(Case, expected outputs) for every case of the manifest."""
        for entry in self.manifest["cases"]:
            ins = self.tensors(entry["op"], "inputs")
            exps = self.tensors(entry["op"], "expected")
            try:
                inputs = {k: ins[f"{entry['name']}/{k}"] for k in entry["inputs"]}
                expected = {k: exps[f"{entry['name']}/{k}"] for k in entry["outputs"]}
            except KeyError as exc:
                raise GoldenError(f"{self.path}: case {entry['name']!r}: tensor {exc.args[0]} is listed "
                                  "in MANIFEST.json but missing from the safetensors file") from None
            self._used.update((f"{entry['op']}.inputs.safetensors", f"{entry['name']}/{k}") for k in inputs)
            self._used.update((f"{entry['op']}.expected.safetensors", f"{entry['name']}/{k}") for k in expected)
            yield Case(entry["name"], entry["op"], entry["params"], inputs, entry["n_special"]), expected

    def orphans(self) -> list[str]:
        """After ``iter_cases``: one problem per tensor of the folder's files that no case uses."""
        return [f"orphaned tensor {key!r} in {fname} (no case of {MANIFEST} uses it)"
                for fname, tensors in sorted(self._tensors.items()) for key in sorted(tensors)
                if (fname, key) not in self._used]


def open_golden(path: str | Path) -> Golden:
    """Read the manifest and check the folder: no missing, extra or modified file."""
    path = Path(path)
    if not path.is_dir():
        raise GoldenError(f"{path}: not a folder (expected a golden folder written by 'fp8ref golden generate')")
    mpath = path / MANIFEST
    if not (mpath.exists() or mpath.is_symlink()):  # a FIFO or device: refused by read_json
        raise GoldenError(f"{mpath}: missing (every golden folder has a {MANIFEST})")
    manifest = read_json(mpath, MANIFEST, error=GoldenError)
    _check_manifest(mpath, manifest)
    listed = set(manifest["files"])
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST, MARKER}
    problems = [f"missing file {n!r}" for n in sorted(listed - present)]
    problems += [f"extra file {n!r} (not listed in {MANIFEST})" for n in sorted(present - listed)]
    for name in sorted(listed & present):
        if hashlib.sha256(read_bytes(path / name, error=GoldenError)).hexdigest() != manifest["files"][name]:
            problems.append(f"modified file {name!r} (sha256 differs from {MANIFEST})")
    if problems:
        raise GoldenError(f"{path}: " + "; ".join(problems))
    text = read_text(path / manifest["suite_file"], error=GoldenError)
    suite = parse_suite(text, source=str(path / manifest["suite_file"]))
    if suite.sha256 != manifest["suite_sha256"] or suite.seed != manifest["seed"] or suite.name != manifest["suite"]:
        raise GoldenError(f"{mpath}: suite, suite_sha256 or seed do not match {manifest['suite_file']}")
    _check_cases(mpath, manifest, suite)
    return Golden(path, manifest, suite)


def _jsonish(value):
    """Parameters as MANIFEST.json holds them (tuples are lists)."""
    return json.loads(json.dumps(value))


def _check_cases(where: Path, manifest: dict, suite: Suite) -> None:
    """The manifest is not hashed, so nothing it says is trusted that the hashed suite and level
    determine: its case list (names, operations, parameters, output names, in order) and its
    file list must be exactly what the suite expands to (a manifest that drops cases would
    otherwise verify OK and check PASS)."""
    level = manifest["level"]
    if level not in LEVELS:
        raise GoldenError(f"{where}: level: expected one of {list(LEVELS)}, got {level!r}")
    derived = [(name, op.name, _jsonish(params)) for op, _, name, params in cases(suite, level)]
    listed = [(e["name"], e["op"], e["params"]) for e in manifest["cases"]]
    if listed != derived:
        d_names, l_names = {d[0]: d for d in derived}, {x[0]: x for x in listed}
        dropped = [n for n in d_names if n not in l_names]
        added = [n for n in l_names if n not in d_names]
        changed = [n for n in l_names if n in d_names and l_names[n] != d_names[n]]
        parts = [f"{len(what)} {label}, e.g. {what[0]!r}" for what, label in
                 ((dropped, "case(s) of the suite missing"), (added, "case(s) not in the suite"),
                  (changed, "case(s) with other operations or parameters")) if what]
        raise GoldenError(f"{where}: cases do not match {manifest['suite_file']} at level {level} "
                          f"({len(listed)} listed, {len(derived)} derived): "
                          + ("; ".join(parts) or "listed in another order or more than once"))
    for entry in manifest["cases"]:
        outputs = OPERATIONS[entry["op"]].outputs
        got = entry["outputs"]
        if not isinstance(got, dict) or set(got) != set(outputs):
            raise GoldenError(f"{where}: case {entry['name']!r}: outputs must be {sorted(outputs)}, "
                              f"got {sorted(got) if isinstance(got, dict) else got!r:.80}")
        if not isinstance(entry["inputs"], dict):
            raise GoldenError(f"{where}: case {entry['name']!r}: inputs: expected an object")
    files = {manifest["suite_file"]} | {f"{op}.{kind}.safetensors" for _, op, _ in derived
                                        for kind in ("inputs", "expected")}
    if set(manifest["files"]) != files:
        raise GoldenError(f"{where}: files: expected {sorted(files)} for these cases, got {sorted(manifest['files'])}")


_MANIFEST_KEYS = {"layout": str, "fp8ref_version": str, "suite": str, "suite_file": str, "suite_sha256": str,
                  "seed": int, "level": int, "files": dict, "cases": list}


def _check_manifest(where: Path, manifest) -> None:
    if not isinstance(manifest, dict):
        raise GoldenError(f"{where}: expected a JSON object")
    for key, kind in _MANIFEST_KEYS.items():
        if not isinstance(manifest.get(key), kind):
            raise GoldenError(f"{where}: {key}: expected a {kind.__name__}, got {manifest.get(key)!r}")
    if manifest["layout"] != LAYOUT:
        raise GoldenError(f"{where}: layout: expected {LAYOUT!r}, got {manifest['layout']!r}")
    suite_file = manifest["suite_file"]
    if suite_file not in manifest["files"] or suite_file != Path(suite_file).name or suite_file in ("", ".", ".."):
        raise GoldenError(f"{where}: suite_file: expected the name of a file of the folder listed in files "
                          f"(normally {SUITE_FILE!r}), got {suite_file!r}")
    for i, entry in enumerate(manifest["cases"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("op"), str) or entry["op"] not in OPERATIONS or not {
                "name", "params", "inputs", "outputs", "n_special"} <= set(entry):
            raise GoldenError(f"{where}: cases[{i}]: expected name, op (one of {sorted(OPERATIONS)}), "
                              f"params, inputs, outputs, n_special; got {entry!r:.200}")


# --- verify and check -----------------------------------------------------------------------------
def verify(path: str | Path, *, progress: Progress | None = None) -> tuple[list[str], list[str]]:
    """Integrity check (GoldenError naming a missing, extra or modified file) plus
    re-derivation of every expected output. Returns (problems, notes): no problems means
    the folder is intact and this fp8ref derives the same bytes."""
    golden = open_golden(path)
    problems, notes = [], []
    if golden.manifest["fp8ref_version"] != __version__:
        notes.append(f"written by fp8ref {golden.manifest['fp8ref_version']}, verified with {__version__}")
    total = len(golden.manifest["cases"])
    regenerated = build(golden.suite, golden.manifest["level"])
    for done, (case, expected) in enumerate(golden.iter_cases(), 1):
        fresh = next(regenerated)  # the hashed suite determines the inputs too: nothing is taken on trust
        if set(fresh.inputs) != set(case.inputs) or fresh.n_special != case.n_special:
            problems.append(f"case {case.name!r}: inputs {sorted(case.inputs)} (n_special {case.n_special}) differ "
                            f"from the suite's {sorted(fresh.inputs)} (n_special {fresh.n_special})")
        for name in sorted(set(fresh.inputs) & set(case.inputs)):
            a, b = fresh.inputs[name], case.inputs[name]
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                problems.append(f"case {case.name!r} input {name!r}: differs from the input the suite generates")
        derived = OPERATIONS[case.op].reference(case.params, case.inputs)
        for name, exp in expected.items():
            got = derived[name]
            if got.dtype != exp.dtype or got.shape != exp.shape or got.tobytes() != exp.tobytes():
                n = int(np.count_nonzero(got.view(np.uint8) != exp.view(np.uint8))) if got.shape == exp.shape \
                    and got.dtype == exp.dtype else "all"
                problems.append(f"case {case.name!r} output {name!r}: re-derived output differs ({n} bytes)")
        if progress:
            progress(done, total, case.name)
    problems += golden.orphans()
    return problems, notes


def check(path: str | Path, outputs_file: str | Path, *, nan_rule: str = "any",
          allow_missing: bool = False, accumulation_order: str = "declared",
          accumulation: str | ModelJudge | None = None) -> tuple[list[CaseResult], list[str]]:
    """Compare a backend's outputs file (tensors named like the expected ones) with the golden
    folder. Returns per-case results and file-level problems (unknown tensor names).

    ``accumulation_order="unspecified"``: the backend sums in fp32 in an order it does not
    declare, so its ``accumulate: fp32`` scaled_mm cases (tensor, row, block16, block32 scales) are judged by the
    fp32-order bound (docs/conformance.md) exactly as the conformance harness judges such a
    backend; every other case stays bit-exact against the stored expected outputs.

    ``accumulation``: a registered accumulation model (or "best", or a ``ModelJudge`` to read the
    ranking from afterwards): every GEMM case (scaled_mm, linear) is judged bit for bit against
    that model's outputs re-derived from the stored inputs (fp8ref.golden.accumulation), the other
    cases against the stored expected outputs. Exclusive with ``accumulation_order="unspecified"``."""
    if accumulation_order not in ACCUMULATION_ORDERS:
        raise GoldenError(f"accumulation_order: expected one of {ACCUMULATION_ORDERS}, got {accumulation_order!r}")
    judge = ModelJudge(accumulation, nan_rule, cannot="error") if isinstance(accumulation, str) else accumulation
    if judge is not None and accumulation_order == "unspecified":
        raise GoldenError("accumulation: a named model and accumulation_order='unspecified' exclude each other "
                          "(a model is judged bit for bit; the fp32-order bound judges an undeclared order)")
    golden = open_golden(path)
    outputs = _load(outputs_file)
    known, results = set(), []
    for case, expected in golden.iter_cases():
        result = CaseResult(case.name, case.op, dict(case.params))
        op = OPERATIONS[case.op]
        if judge is not None and covers(op):
            keys = {name: f"{case.name}/{name}" for name in expected}
            known.update(keys.values())
            absent = [k for k in keys.values() if k not in outputs]
            if absent:
                result.status, result.reason = "missing", f"no tensor {absent[0]!r} in {outputs_file}"
            else:
                judge.judge(result, op, case.name, case.params, case.inputs,
                            {name: outputs[k] for name, k in keys.items()}, labels=keys)
            results.append(result)
            continue
        bounded = accumulation_order == "unspecified" and bound_reason(case.op, case.params) is None
        if bounded:
            result.rule = getattr(op, "tolerance_rule", "fp32-order bound")
        for name, exp in expected.items():
            key = f"{case.name}/{name}"
            known.add(key)
            if key not in outputs:
                result.status, result.reason = "missing", f"no tensor {key!r} in {outputs_file}"
                continue
            if bounded:  # judged against fp8ref's exact result, re-derived from the stored inputs
                exp = op.reference(exact_params(case.params), case.inputs)[name]
            try:
                judge_output(result, op, case.name, case.params, case.inputs, name, exp, outputs[key], nan_rule,
                             bounded=bounded, label=key)
            except OutputError as exc:
                result.status, result.reason = "error", str(exc)
        results.append(result)
    if judge is not None:
        judge.finish()
    problems = golden.orphans()
    problems += [f"unknown tensor {n!r} in {outputs_file} (no such case output)" for n in sorted(set(outputs) - known)]
    if not allow_missing:
        missing = [r.case for r in results if r.status == "missing"]
        if missing:
            problems.append(f"{len(missing)} case(s) have no outputs in {outputs_file}, e.g. {missing[0]!r} "
                            "(pass --allow-missing to compare only the cases present)")
    return results, problems
