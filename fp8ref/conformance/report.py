"""Human and JSON reports of conformance runs and golden checks.

A mismatch line, TestFloat style::

    encode float8_e4m3fn rne nosat float32  x=f32:0x43e80001 (464.00003)
        expected 0x7f (+.1111.111 nan)  got 0x7e (+.1111.110 448)  ulp -  [overflow]

(one line), then a one-line Python repro.
      repro: python -c "..."
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable

import numpy as np

from ..codefields import fields_text
from ..formats import get_format
from ..golden.judge import Mismatch
from ..golden.ops import OPERATIONS

_HEX_WIDTH = {"float64": 16, "float32": 8, "float16": 4, "bfloat16": 4, "uint8": 2, "uint16": 4, "uint32": 8}
_DTYPE_TAG = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_UINT = {8: "uint64", 4: "uint32", 2: "uint16", 1: "uint8"}


def hex_bits(v) -> str:
    a = np.asarray(v)
    width = a.dtype.itemsize
    bits = int(a.view(_UINT[width]))
    return f"0x{bits:0{_HEX_WIDTH.get(a.dtype.name, 2 * width)}x}"


def value_text(v) -> str:
    """``f32:0x43e80000 (464.0)``: the dtype, the bit pattern and the decimal value."""
    a = np.asarray(v)
    if a.dtype.kind in "ui" or isinstance(v, int):
        return f"0x{int(a):x}" if a.dtype == np.uint8 else str(int(a))
    return f"{_DTYPE_TAG.get(a.dtype.name, a.dtype.name)}:{hex_bits(a)} ({_decimal(a)})"


def _decimal(a: np.ndarray) -> str:
    f = float(a)
    if math.isnan(f):
        with np.errstate(invalid="ignore"):  # a bfloat16 NaN widened
            return "nan" if not np.signbit(a.astype(np.float64)) else "-nan"
    return repr(a.item()) if a.dtype.name in ("float64", "float32", "float16") else repr(f)


def operand_text(v) -> str:
    """A repro operand: codes as hex, floats as dtype:bits (value), one or many."""
    a = np.asarray(v)
    if a.ndim == 0:
        return value_text(a) if a.dtype.kind not in "ui" else f"0x{int(a):02x}" if a.dtype == np.uint8 else str(int(a))
    if a.dtype == np.uint8:
        return f"uint8 codes [{' '.join(f'{int(c):02x}' for c in a)}]"
    return "[" + ", ".join(value_text(x) for x in a) + "]"


def code_text(code: int, fmt_name: str) -> str:
    """``0x7e (+.1111.110 448)``: the code, its sign/exponent/mantissa fields and its value."""
    fmt = get_format(fmt_name)
    code = int(code)
    fields = fields_text(code, fmt, sign="symbol")
    value = fmt.exact_value(code)
    if value is None:
        text = "nan" if code in fmt.nan_codes else ("-inf" if code & fmt.sign_mask else "inf")
    else:
        text = "-0" if value == 0 and code & fmt.sign_mask else f"{float(value):.10g}"
    return f"0x{code:0{max(2, (fmt.bits + 3) // 4)}x} ({fields} {text})"


def output_text(v, fmt_name: str | None) -> str:
    return code_text(int(v), fmt_name) if fmt_name else value_text(v)


def _param_text(op: str, params) -> str:
    """Parameters in the operation's declared order (live runs and manifests order their keys
    differently)."""
    order = OPERATIONS[op].params
    parts = []
    keys = [k for k in order if k in params] + sorted(set(params) - set(order))
    for k, v in ((k, params[k]) for k in keys):
        if k == "saturate":
            parts.append("sat" if v else "nosat")
        elif isinstance(v, bool):
            parts.extend([k] if v else [])
        elif isinstance(v, list):
            parts.append("x".join(map(str, v)))
        elif k != "random_bits":
            parts.append(str(v))
    return " ".join(parts)


def mismatch_line(m: Mismatch, fmt_name: str | None) -> str:
    inputs = "  ".join(f"{k}={value_text(v)}" for k, v in m.inputs.items())
    where = f"[{','.join(map(str, m.index))}] " if len(m.index) > 1 else ""
    ulp = "-" if m.ulp is None else str(m.ulp)
    tags = f"  [{' '.join(m.tags)}]" if m.tags else ""
    out = f"  {m.output}" if m.output not in ("codes", "values") else ""
    bound = ""
    if m.bound_used is not None:  # judged by the fp32-order bound against the exact result
        bound = (f"  {nan_result(m)}" if nan_result(m) else "  outside the fp32-order bound's domain"
                 if math.isnan(m.bound_used) else f"  fp32-order bound used {m.bound_used:.4g}x")
    return (f"{m.op} {_param_text(m.op, m.params)}{out}  {where}{inputs}  expected {output_text(m.expected, fmt_name)}"
            f"  got {output_text(m.got, fmt_name)}  ulp {ulp}{bound}{tags}")


def _is_nan(v) -> bool:
    a = np.asarray(v)
    with np.errstate(invalid="ignore"):  # a bfloat16 NaN widened
        return a.dtype.kind not in "uib" and bool(np.isnan(a.astype(np.float64)))


def nan_result(m: Mismatch) -> str:
    """'wrong NaN result' when the backend returned NaN for a number (or a number for NaN): the
    case is wrong, whatever the bound would allow; empty otherwise."""
    if _fmt_of(m) is not None:  # codes: a NaN code is judged by the NaN rule
        return ""
    got, exp = _is_nan(m.got), _is_nan(m.expected)
    if got and not exp:
        return "wrong NaN result (expected a number)"
    if exp and not got:
        return "wrong result: expected NaN"
    return ""


def _array_literal(v) -> str:
    a = np.asarray(v)
    if a.dtype.name == "bfloat16":
        return f"np.array([{hex_bits(a)}], np.uint16).view(ml_dtypes.bfloat16)"
    if a.dtype.kind == "f":
        return f"np.array([{hex_bits(a)}], np.{_UINT[a.dtype.itemsize]}).view(np.{a.dtype.name})"
    return f"np.array([{int(a)}], np.{a.dtype.name})"


def repro_line(m: Mismatch, backend: str, suite: str, level: int, accumulation: str | None = None,
               model: str | None = None) -> str:
    """A one-line Python command that prints the expected and the backend's result (``accumulation``,
    ``model``: a GEMM judged under ``--accumulation``, see runner.repro)."""
    p = m.params
    if m.op == "encode":
        rb = m.inputs.get("random_bits")
        kw = (f"rounding={p['rounding']!r}, saturate={p['saturate']}, "
              f"random_bits={_array_literal(rb) if rb is not None else None}")
        imports = "import numpy as np; " + ("import ml_dtypes; " if p["dtype"] == "bfloat16" else "")
        profile = p.get("profile", "fp8ref")  # conform --profile: the expected codes are fp8ref.profiles'
        ours, extra = ("fp8ref.encode", "") if profile == "fp8ref" else ("fp8ref.profiles.encode",
                                                                          f", profile={profile!r}")
        module = ours.rsplit(".", 1)[0]
        return (f'python -c "{imports}import {module}; from fp8ref.conformance import load_backend; '
                f"x = {_array_literal(m.inputs['x'])}; "
                f"print(hex({ours}(x, {p['format']!r}, {kw}{extra})[0]), "
                f"hex(load_backend({backend!r}).encode(x, {p['format']!r}, {kw})[0]))\"")
    if m.op == "decode":
        return (f'python -c "import numpy as np, fp8ref; from fp8ref.conformance import load_backend; '
                f"c = {_array_literal(m.inputs['codes'])}; "
                f"print(fp8ref.decode(c, {p['format']!r})[0], "
                f"load_backend({backend!r}).decode(c, {p['format']!r})[0])\"")
    acc = "" if accumulation is None or "accumulate" not in OPERATIONS[m.op].params else (
        f", accumulation={accumulation!r}" + (f", model={model!r}" if model and model != accumulation else ""))
    return (f'python -c "from fp8ref.conformance.runner import repro; '
            f'repro({backend!r}, {suite!r}, {m.case!r}, level={level}, index={tuple(m.index)!r}{acc})"')


def table(rows: dict[str, dict], columns: Iterable[tuple[str, str]]) -> str:
    """A plain-text table; ``columns`` are (key, header)."""
    columns = list(columns)
    body = [[op] + ["-" if r[k] is None else str(r[k]) for k, _ in columns] for op, r in rows.items()]
    head = ["operation"] + [h for _, h in columns]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]

    def line(cells):
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join(line(cells) for cells in [head, *body])


# "in bound": elements that differ from fp8ref's exact result but lie inside the declared
# fp32-order bound (backends whose fp32 summation order is unspecified); never counted as
# matches. "bound used": the largest fraction of that bound any element used.
SUMMARY_COLUMNS = (("cases", "cases"), ("not_implemented", "not impl."), ("errors", "errors"),
                   ("elements", "elements"), ("exact", "match"), ("in_bound", "in bound"),
                   ("mismatches", "mismatches"), ("xfailed", "xfailed"), ("max_ulp", "max ulp"),
                   ("bound_used", "bound used"))


def _fmt_of(m: Mismatch) -> str | None:
    return OPERATIONS[m.op].output_format(m.params, m.output)


def print_results(results, *, header: str, is_xfailed, repro=None, max_errors: int = 20, out=None) -> int:
    """Print mismatch lines (capped at ``max_errors`` per operation; 0 = all), ERROR and MISSING
    lines (capped at ``max_errors`` each: a wrong outputs file misses every case) and the
    per-operation table; returns the number of unexpected mismatches and errors."""
    out = out or sys.stdout
    print(header, file=out)
    unexpected = 0
    shown: dict[str, int] = {}  # per operation: a flood of encode lines must not hide the GEMMs
    failed: dict[str, int] = {}  # per status (error, missing)
    order = {op: i for i, op in enumerate(OPERATIONS)}
    # simplest failing cases first within each operation (the smallest GEMM shape first)
    for r in sorted(results, key=lambda r: (order.get(r.op, len(order)), int(np.prod(r.params.get("shape", [0]))))):
        if r.status in ("error", "missing") and not is_xfailed(r.case, ("error",)):
            unexpected += 1
            failed[r.status] = failed.get(r.status, 0) + 1
            if not max_errors or failed[r.status] <= max_errors:
                print(f"{r.status.upper()} {r.case}: {r.reason}", file=out)
        for m in r.mismatches:
            if is_xfailed(m.case, m.tags):
                continue
            unexpected += 1
            if max_errors and shown.get(r.op, 0) >= max_errors:
                continue
            shown[r.op] = shown.get(r.op, 0) + 1
            print(mismatch_line(m, _fmt_of(m)), file=out)
            if repro:
                print(f"  repro: {repro(m)}", file=out)
    for op in sorted({r.op for r in results}, key=lambda o: order.get(o, len(order))):
        mism = sum(1 for r in results if r.op == op for m in r.mismatches if not is_xfailed(m.case, m.tags))
        if mism > shown.get(op, 0):
            print(f"... {mism - shown.get(op, 0)} more unexpected {op} mismatches not shown (--max-errors, "
                  "per operation)", file=out)
    for status, n in failed.items():
        if max_errors and n > max_errors:
            print(f"... {n - max_errors} more {status.upper()} cases not shown (--max-errors)", file=out)
    return unexpected


def skipped_lines(results, *, limit: int = 6) -> list[str]:
    """Why cases were not run (``reason_lines``), under a count of them."""
    reasons: dict[str, int] = {}
    for r in results:
        if r.status == "not-implemented":
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
    if not reasons:
        return []
    return [f"not implemented, skipped: {sum(reasons.values())} case(s):", *reason_lines(reasons, limit=limit)]


# Backend.implements' words for what ``capabilities`` leaves out: "NAME does not implement OP" and
# "NAME OP does not implement KEY=VALUE"
_UNDECLARED = re.compile(r"(?P<what>\S+ (\w+ )?does not implement \w+)(=(?P<value>.+))?")


def reason_lines(reasons: dict[str, int], *, limit: int = 6) -> list[str]:
    """One line per reason, at most ``limit``: first the backend's own words (a peer's missing kernel,
    an operator's rounding modes), most cases first, then the values it does not declare, one line
    per parameter listing them (one value keeps its reason as it was written)."""
    stated: dict[str, int] = {}
    undeclared: dict[str, dict[str, int]] = {}
    for reason, n in reasons.items():
        m = _UNDECLARED.fullmatch(reason)
        if m is None:
            stated[reason] = n
        else:
            values = undeclared.setdefault(m["what"], {})
            values[m["value"]] = values.get(m["value"], 0) + n  # value None: the whole operation
    ranked = sorted(stated.items(), key=lambda kv: -kv[1])
    for what, values in sorted(undeclared.items(), key=lambda kv: -sum(kv[1].values())):
        names = [v for v, _ in sorted(values.items(), key=lambda kv: -kv[1]) if v is not None]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        listed = f"={', '.join(names[:3])}{more}" if names else ""
        ranked.append((what + listed, sum(values.values())))
    lines = [f"  {n:>5}  {reason}" for reason, n in ranked[:limit]]
    if len(ranked) > limit:
        lines.append(f"  ... {len(ranked) - limit} more reason(s) (--json has each case's)")
    return lines


def _max(a, b):
    return b if a is None else (a if b is None else max(a, b))


def summarize(results, is_xfailed) -> dict[str, dict]:
    """Per operation: cases, not implemented, errors, elements, exact matches, elements inside
    a declared fp32-order bound, mismatches, xfailed, max ULP (over every differing element
    with no NaN), and the largest fraction of the bound used ("-" where no bound applied)."""
    table: dict[str, dict] = {}
    for r in results:
        row = table.setdefault(r.op, {"cases": 0, "not_implemented": 0, "errors": 0, "elements": 0,
                                      "exact": 0, "in_bound": 0, "mismatches": 0, "xfailed": 0, "max_ulp": None,
                                      "bound_used": None})
        in_bound = getattr(r, "in_bound", 0)
        row["cases"] += 1
        row["not_implemented"] += r.status == "not-implemented"
        row["errors"] += r.status in ("error", "missing")
        row["elements"] += r.elements
        row["exact"] += r.elements - len(r.mismatches) - in_bound
        row["in_bound"] += in_bound
        row["max_ulp"] = _max(row["max_ulp"], getattr(r, "in_bound_max_ulp", None))
        used = getattr(r, "max_bound_used", None)
        if used is not None:
            row["bound_used"] = _max(row["bound_used"], float(f"{used:.4g}"))
        for m in r.mismatches:
            row["xfailed" if is_xfailed(m.case, m.tags) else "mismatches"] += 1
            if m.ulp is not None and (row["max_ulp"] is None or m.ulp > row["max_ulp"]):
                row["max_ulp"] = m.ulp
    return table


def mismatch_json(m: Mismatch, xfailed: bool) -> dict:
    fmt = _fmt_of(m)

    def enc(v):
        a = np.asarray(v)  # floats (bfloat16 included: numpy kind 'V') as their bit pattern
        return {"hex": hex(int(a)) if a.dtype.kind in "uib" else hex_bits(a),
                "text": output_text(v, fmt) if v is m.expected or v is m.got else value_text(v)}

    return {"output": m.output, "index": list(m.index), "inputs": {k: value_text(v) for k, v in m.inputs.items()},
            "expected": enc(m.expected), "got": enc(m.got), "ulp": m.ulp, "tags": list(m.tags), "xfail": xfailed,
            "bound_used": _json_float(m.bound_used), "nan_result": nan_result(m) or None}


def _json_float(v):
    """Floats for JSON: None for none/NaN (outside the bound's domain), "inf" for infinity."""
    if v is None or math.isnan(v):
        return None
    return v if math.isfinite(v) else ("inf" if v > 0 else "-inf")


def results_json(results, is_xfailed, *, examples: int = 20) -> list[dict]:
    out = []
    for r in results:
        n_x = sum(1 for m in r.mismatches if is_xfailed(m.case, m.tags))
        out.append({"case": r.case, "op": r.op, "params": r.params, "status": r.status, "reason": r.reason,
                    "elements": r.elements, "mismatches": len(r.mismatches) - n_x, "xfailed": n_x,
                    "rule": getattr(r, "rule", "bit-exact"), "in_bound": getattr(r, "in_bound", 0),
                    "in_bound_max_ulp": getattr(r, "in_bound_max_ulp", None),
                    "max_bound_used": _json_float(getattr(r, "max_bound_used", None)),
                    "examples": [mismatch_json(m, is_xfailed(m.case, m.tags)) for m in r.mismatches[:examples]]})
    return out


def first_examples(xfails, runs) -> dict[int, tuple]:
    """Per xfail entry (by line): the first mismatch it excused, simplest first within a case, with its run."""
    out: dict[int, tuple] = {}
    for r in runs:
        for c in r.results:
            for m in c.mismatches:
                for e in xfails.matching(m.case, m.tags)[:1]:
                    out.setdefault(e.line, (m, r))
    return out


def print_known(xfails, runs, repro, out=None) -> list[dict]:
    """The xfail entries that excused something, each by name: its line, count, reason (the comment above
    it), its simplest excused mismatch and that mismatch's one-line repro. Returns them for the JSON report."""
    out = out or sys.stdout
    examples = first_examples(xfails, runs)
    hit = [e for e in xfails.entries if e.hits]
    if hit:
        print(f"known differences (excused by {xfails.source}):", file=out)
    rows = []
    for e in hit:
        print(f"  line {e.line}: {e.text.split('#', 1)[0].strip()}  ({e.hits} element(s) or case(s))", file=out)
        if e.reason:
            print(f"    why: {e.reason}", file=out)
        if e.line in examples:
            m, r = examples[e.line]
            print(f"    e.g. {mismatch_line(m, _fmt_of(m))}", file=out)
            print(f"    repro: {repro(m, r)}", file=out)
        rows.append({"line": e.line, "entry": e.text, "hits": e.hits, "reason": e.reason})
    return rows
