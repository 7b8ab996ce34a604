"""``fp8ref conform --backend NAME``: run golden suites live against a backend."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

from ..conformance import default_xfails, known_backends, load_backend, load_xfails, run
from ..conformance.backend import suites_for
from ..conformance.report import (
    SUMMARY_COLUMNS,
    print_known,
    print_results,
    repro_line,
    results_json,
    skipped_lines,
    summarize,
    table,
)
from ..errors import BackendError
from ..golden import CAPABILITY_SUITES, DEFAULT_SUITES, load_suite
from ..golden.fields import LEVELS
from ..golden.judge import NAN_RULES
from ..io import safetensors as st
from ..profiles import PROFILES
from .argtypes import int_range
from .output import (
    add_accumulation,
    add_json,
    add_progress_flags,
    bad_accumulation,
    declare_paths,
    emit_json,
    json_on_stdout,
    progress_bar,
    progress_enabled,
)


def register(sub) -> None:
    p = sub.add_parser("conform", help="run golden suites against a backend (torch, ml_dtypes, gfloat, ...)")
    p.add_argument("--backend", help="built-in name, an 'fp8ref.backends' entry point, or module:object")
    p.add_argument("--suite", action="append", help="suite file or shipped name; repeatable (default: the "
                   f"backend's default_suites, else {', '.join(DEFAULT_SUITES)}; and {', '.join(CAPABILITY_SUITES)} "
                   "where the backend declares block-scaled scaled_mm)")
    p.add_argument("--level", type=int, choices=LEVELS, help="1 quick, 2 thorough (default: each suite's level)")
    p.add_argument("--xfails", type=Path, help="known differences file (default: the backend's shipped one)")
    p.add_argument("--no-xfails", action="store_true", help="report every difference as unexpected")
    p.add_argument("--nan-rule", choices=NAN_RULES, default="any", help="NaN equivalence (default: any)")
    p.add_argument("--case", help="only cases whose name matches this glob")
    p.add_argument("--profile", choices=PROFILES, default="fp8ref",
                   help="judge encode cases by fp8ref's rule (default) or by a specification's (onnx: ONNX Cast; "
                   "docs/conformance.md); the default xfails file becomes NAME.PROFILE.txt")
    add_accumulation(p)
    p.add_argument("--max-errors", type=int_range(0, 2**31 - 1), default=20,
                   help="mismatch lines to print per operation (0: all; default 20)")
    add_json(p, "the report (the text report then goes to stderr when OUT is '-')")
    p.add_argument("--dump-failing", type=Path, metavar="DIR", help="save each failing case as DIR/CASE.safetensors "
                   "(input/NAME, expected/NAME, got/NAME: for a kernel's own unit test)")
    p.add_argument("--list-backends", action="store_true", help="list the known backends and exit")
    add_progress_flags(p)
    declare_paths(p, inputs=("suite", "xfails"), files=("json",), into=("dump_failing",))
    p.set_defaults(handler=cmd_conform)


def cmd_conform(args) -> int:
    if args.list_backends:
        for name, target in sorted(known_backends().items()):
            print(f"{name}  {target}")
        return 0
    if not args.backend:
        print("fp8ref conform: --backend is required (known: " + ", ".join(sorted(known_backends())) + ")",
              file=sys.stderr)
        return 2
    if bad_accumulation(args, "fp8ref conform"):
        return 2
    backend = load_backend(args.backend)
    xfails = None if args.no_xfails else (load_xfails(args.xfails) if args.xfails
                                          else default_xfails(backend.name, args.profile))
    select = (lambda name: fnmatch.fnmatchcase(name, args.case)) if args.case else None
    if select is not None:
        select.glob = args.case  # named in the verdict when it selects nothing
    names, skipped = suites_for(backend, args.suite)
    out = sys.stderr if json_on_stdout(args.json) else sys.stdout
    for line in skipped:
        print(line, file=out)
    try:
        return conform(backend, args.backend, [load_suite(s) for s in names],
                       level=args.level, xfails=xfails, nan_rule=args.nan_rule, select=select,
                       max_errors=args.max_errors, json_out=args.json, progress=progress_enabled(args),
                       dump_failing=args.dump_failing, out=out,
                       accumulation=args.accumulation, profile=args.profile)
    except BackendError as exc:  # the backend names itself; say what was typed too (module:object)
        if args.backend in str(exc):
            raise
        raise BackendError(f"{exc} (--backend {args.backend})") from None


def conform(backend, backend_spec: str, suites, *, level=None, xfails=None, nan_rule="any", select=None,
            max_errors=20, json_out=None, progress=True, out=None, dump_failing=None, accumulation=None,
            profile="fp8ref") -> int:
    """Run every suite, print the report, return the exit code (0: nothing unexpected). A backend
    that raises SystemExit/KeyboardInterrupt itself fails that case and stops the run: the report
    of what ran is printed and the exit code is 1 (never the backend's)."""
    out = out or sys.stdout
    runs, unexpected, report = [], 0, []
    stopped = ""
    for i, suite in enumerate(suites):
        r = run(backend, suite, level=level, nan_rule=nan_rule, xfails=xfails, select=select,
                progress=progress_bar(progress, f"{backend.name} {suite.name}"), keep_failing=dump_failing is not None,
                accumulation=accumulation, profile=profile)
        runs.append(r)
        if dump_failing is not None:
            _dump(dump_failing, r, out)
        judge = r.accumulation
        header = (f"== fp8ref conform: backend {r.backend} ({r.backend_version or 'version unknown'}), suite "
                  f"{r.suite} level {r.level}, " + (f"profile {profile}, " if profile != "fp8ref" else "")
                  + f"NaN rule {nan_rule!r}, xfails "
                  f"{xfails.source if xfails else 'none'}" + (f", {judge.header()}" if judge is not None else ""))
        model = judge.judged_against if judge is not None else None

        def repro(m, s=suite.name, lv=r.level, model=model):
            return repro_line(m, backend_spec, s, lv, accumulation, model)

        unexpected += print_results(r.results, header=header, is_xfailed=r.xfailed, max_errors=max_errors,
                                    repro=repro, out=out)
        rows = summarize(r.results, r.xfailed)
        print(table(rows, SUMMARY_COLUMNS), file=out)
        for line in skipped_lines(r.results):
            print(line, file=out)
        if judge is not None:
            print("\n".join(judge.report_lines()), file=out)
        report.append({"suite": r.suite, "level": r.level, "summary": rows,
                       "cases": results_json(r.results, r.xfailed)})
        if judge is not None:
            report[-1]["accumulation"] = judge.to_json()
        if r.stopped:
            later = [s.name for s in suites[i + 1:]]
            stopped = (f"{r.stopped}: {r.not_run} case(s) of suite {r.suite} not run"
                       + (f", nor suite(s) {', '.join(later)}" if later else ""))
            report[-1].update(stopped=r.stopped, not_run=r.not_run)
            print(f"stopped: {stopped}", file=out)
            break
    stale = xfails.stale() if xfails and not stopped else []  # a stopped run cannot say what never matches
    for e in stale:
        print(f"stale xfail (matched nothing): {xfails.source}:{e.line}: {e.text}", file=out)
    known = []
    if xfails is not None:
        known = print_known(xfails, runs, lambda m, r: repro_line(m, backend_spec, r.suite, r.level, accumulation,
                                                                 r.accumulation.judged_against if r.accumulation
                                                                 else None), out=out)
    compared = sum(r.compared() for r in runs)
    total = sum(len(r.results) for r in runs)
    code = 0 if unexpected == 0 and compared > 0 and not stopped else 1
    if stopped:
        verdict = "FAIL: the backend stopped the run (the 'stopped:' line above)"
    elif code == 0:
        verdict = "PASS"
    elif total == 0:
        verdict = (f"FAIL: no case selected (--case {getattr(select, 'glob', '?')!r} matched no case name)" if select
                   else "FAIL: the suites have no cases")
    elif unexpected:
        verdict = f"FAIL: {unexpected} unexpected mismatch(es)/error(s)"
    elif any(c.status == "error" for r in runs for c in r.results):
        verdict = "FAIL: every case that ran raised an error (all of them xfailed); none was compared"
    else:
        verdict = "FAIL: nothing was compared (the backend implements none of these cases)"
    print(f"result: {verdict}; {compared} case(s) compared", file=out)
    emit_json(json_out, {
        "backend": backend.name, "version": runs[0].backend_version if runs else "", "nan_rule": nan_rule,
        "profile": profile,
        "xfails": xfails.source if xfails else None, "runs": report, "exit_code": code,
        "stale_xfails": [{"line": e.line, "entry": e.text} for e in stale], "known_differences": known},
        sort_keys=True, indent=1)
    return code


def _dump(folder: Path, r, out) -> None:
    """Each case with an unexpected mismatch as one safetensors file."""
    failing = [c for c in r.results if c.tensors and any(not r.xfailed(m.case, m.tags) for m in c.mismatches)]
    if not failing:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for c in failing:
        st.save(folder / f"{c.case}.safetensors", c.tensors, {"producer": "fp8ref conform --dump-failing",
                                                              "case": c.case, "suite": r.suite})
    print(f"note: {len(failing)} failing case(s) saved in {folder}", file=out)
