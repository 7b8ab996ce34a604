"""``fp8ref golden generate|verify|check|list``: golden folders from the shell."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from ..conformance.report import SUMMARY_COLUMNS, print_results, results_json, summarize, table
from ..conformance.xfails import load_xfails
from ..golden import check, generate, load_suite, verify
from ..golden.accumulation import ModelJudge
from ..golden.fields import LEVELS
from ..golden.judge import ACCUMULATION_ORDERS, NAN_RULES
from ..golden.suite import cases
from ..profiles import PROFILES
from ..registry import suite_names
from .argtypes import int_range
from .logprobs import add_golden_model_args, cmd_golden_logprobs
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
    golden = sub.add_parser("golden", help="generate, verify and check golden files (safetensors + MANIFEST.json)")
    gsub = golden.add_subparsers(dest="golden_command", metavar="ACTION", required=True)

    p = gsub.add_parser("generate", help="write a suite's inputs and expected outputs to a new folder, or (--model) "
                                         "a checkpoint's top-K logprobs to a file")
    p.add_argument("suite", nargs="?", help=f"suite YAML file, or the name of a shipped suite "
                                            f"({', '.join(suite_names())})")
    p.add_argument("-o", "--output", required=True, type=Path,
                   help="folder to create (must be new or empty, or --force); with --model: the JSON file")
    p.add_argument("--level", type=int, choices=LEVELS, help="1 quick, 2 thorough (default: the suite's level)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it is a golden folder fp8ref wrote "
                   "(and holds nothing else)")
    add_golden_model_args(p)
    add_progress_flags(p)
    declare_paths(p, inputs=("suite",), folders=("output",))  # --model switches these (logprobs.ModelOutput)
    p.set_defaults(handler=cmd_generate)

    p = gsub.add_parser("verify", help="check every sha256 and re-derive every expected output")
    p.add_argument("folder", type=Path)
    add_progress_flags(p)
    p.set_defaults(handler=cmd_verify)

    p = gsub.add_parser("check", help="compare a backend's outputs (a safetensors file, same tensor names)")
    p.add_argument("folder", type=Path)
    p.add_argument("--outputs", required=True, type=Path, help="safetensors file with tensors '<case>/<output>'")
    p.add_argument("--nan-rule", choices=NAN_RULES, default="any", help="NaN equivalence (default: any NaN "
                   "equals any NaN; 'sign': signs must agree; 'exact': codes must agree)")
    p.add_argument("--allow-missing", action="store_true", help="compare only the cases present in --outputs "
                   "(the report says how many went unchecked)")
    p.add_argument("--xfails", type=Path, help="known differences file (the format of fp8ref conform --xfails)")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--accumulation-order", choices=ACCUMULATION_ORDERS, default="declared",
                       help="'declared' (default): bit-exact; 'unspecified': your GEMM sums in fp32 in an order it "
                       "does not declare, so accumulate=fp32 scaled_mm cases are judged against the exact result by "
                       "the proven fp32-order bound (docs/conformance.md); all else stays bit-exact")
    add_accumulation(order)
    p.add_argument("--max-errors", type=int_range(0, 2**31 - 1), default=20,
                   help="mismatch lines to print per operation (0: all; default 20)")
    add_json(p, "the report (the text report then goes to stderr when OUT is '-')")
    declare_paths(p, inputs=("folder", "outputs", "xfails"), files=("json",))
    p.set_defaults(handler=cmd_check)

    p = gsub.add_parser("import", help="turn a peer's own test vectors into a golden folder (onnx-node)")
    p.add_argument("kind", choices=("onnx-node",), help="onnx-node: ONNX backend node tests (model.onnx + "
                   "test_data_set_*/{input,output}_*.pb) of Cast / CastLike to and from float8, E8M0, FP4")
    p.add_argument("source", type=Path, help="a node-test folder, or a folder of them")
    p.add_argument("-o", "--output", required=True, type=Path, help="golden folder to create (must be new or "
                   "empty, or --force); ONNX's own outputs go to OUTPUT.onnx.safetensors beside it")
    p.add_argument("--profile", choices=PROFILES, default="fp8ref", help="expected outputs by fp8ref's rule "
                   "(default) or by the ONNX profile (docs/codec.md); fp8ref's rule leaves out FP4 NaN inputs")
    p.add_argument("--name", default="onnx-node", help="the suite's name (default onnx-node)")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it is a golden folder fp8ref wrote")
    p.add_argument("--max-errors", type=int_range(0, 2**31 - 1), default=20,
                   help="mismatch lines to print per operation (0: all; default 20)")
    declare_paths(p, inputs=("source",), folders=("output",))
    p.set_defaults(handler=cmd_import)

    p = gsub.add_parser("list", help="list the cases of a suite (names, operation, parameters)")
    p.add_argument("suite")
    p.add_argument("--level", type=int, choices=LEVELS)
    p.set_defaults(handler=cmd_list)


def cmd_generate(args) -> int:
    if args.model is not None:
        return cmd_golden_logprobs(args)
    if args.suite is None or args.tokens or args.logits:
        from ..errors import GoldenError

        raise GoldenError("golden generate: give a SUITE (or --model CKPT --tokens FILE for a checkpoint's logprobs)")
    suite = load_suite(args.suite)
    start = time.perf_counter()
    manifest = generate(suite, args.output, level=args.level, progress=progress_bar(progress_enabled(args), "generate"),
                        force=args.force)
    size = sum((args.output / name).stat().st_size for name in manifest["files"])
    print(f"golden: suite {suite.name} level {manifest['level']} seed {suite.seed}: {len(manifest['cases'])} cases, "
          f"{len(manifest['files']) + 1} files, {size / 1e6:.1f} MB in {args.output} "
          f"({time.perf_counter() - start:.1f} s)")
    return 0


def cmd_verify(args) -> int:
    problems, notes = verify(args.folder, progress=progress_bar(progress_enabled(args), "verify"))
    for note in notes:
        print(f"note: {note}")
    for problem in problems:
        print(f"MISMATCH {problem}")
    print(f"golden verify {args.folder}: every file intact, every input regenerated and every expected output "
          "re-derived" if not problems else f"golden verify {args.folder}: {len(problems)} problem(s)")
    print("result: " + ("PASS" if not problems else f"FAIL ({len(problems)} problem(s))"))
    return 1 if problems else 0


def cmd_check(args) -> int:
    if bad_accumulation(args, "fp8ref golden check"):
        return 2

    judge = None if args.accumulation is None else ModelJudge(args.accumulation, args.nan_rule, cannot="error")
    # with --json -, stdout holds the JSON and nothing else
    with contextlib.redirect_stdout(sys.stderr) if json_on_stdout(args.json) else contextlib.nullcontext():
        code, report = _check(args, judge)
    emit_json(args.json, report, sort_keys=True, indent=1)
    return code


def _check(args, judge) -> tuple[int, dict]:
    results, problems = check(args.folder, args.outputs, nan_rule=args.nan_rule, allow_missing=args.allow_missing,
                              accumulation_order=args.accumulation_order, accumulation=judge)

    xfails = load_xfails(args.xfails) if args.xfails else None
    never = xfails.match if xfails else (lambda case, tags: False)  # without --xfails every difference counts
    unchecked = sum(r.status == "missing" for r in results)
    if args.allow_missing:
        results = [r for r in results if r.status != "missing"]
    how = judge.header() if judge is not None else f"accumulation order {args.accumulation_order!r}"
    header = f"golden check {args.folder} against {args.outputs} (NaN rule {args.nan_rule!r}, {how})"
    unexpected = print_results(results, header=header, is_xfailed=never, max_errors=args.max_errors)
    rows = summarize(results, never)
    print(table(rows, SUMMARY_COLUMNS))
    if judge is not None:
        print("\n".join(judge.report_lines()))
    if args.accumulation_order == "unspecified":
        bounded = sum(r.rule != "bit-exact" for r in results)
        print(f"note: {bounded} case(s) judged by the fp32-order bound against the exact result ('in bound' "
              "counts elements that differ from it inside the bound, never as matches); every other case bit-exact")
    for problem in problems:
        print(f"ERROR {problem}")
    if unchecked and unchecked == len(results) and not args.allow_missing:
        print(f"note: none of the {unchecked} case(s) has outputs in {args.outputs}; is it the outputs file for "
              f"{args.folder}? (tensors are named '<case>/<output>')")
    if args.allow_missing and unchecked:
        print(f"note: {unchecked} case(s) have no outputs in {args.outputs} and went unchecked (--allow-missing)")
    if xfails is not None:
        xfails.record(results)
        for e in xfails.stale():
            print(f"stale xfail (matched nothing): {xfails.source}:{e.line}: {e.text}")
    compared = sum(r.status == "compared" for r in results)
    report = {"folder": str(args.folder), "outputs": str(args.outputs), "nan_rule": args.nan_rule,
              "accumulation_order": args.accumulation_order, "summary": rows, "problems": problems,
              "unchecked": unchecked, "cases": results_json(results, never)}
    if judge is not None:
        report["accumulation"] = judge.to_json()
    ok = unexpected == 0 and not problems and compared > 0
    print("result: " + ("PASS" if ok else f"FAIL ({unexpected} unexpected, {len(problems)} problem(s), "
                                          f"{compared} case(s) compared)"))
    return (0 if ok else 1), report


def cmd_import(args) -> int:
    """Read every node test (nothing is written when one is refused), write the suite's golden folder and
    ONNX's outputs beside it, then print fp8ref's verdict on each vector (golden check of ONNX's outputs)."""
    from ..conformance.report import print_results
    from ..errors import GoldenError
    from ..golden import onnx_node, parse_suite
    from ..io import safetensors as st

    tests = onnx_node.find_tests(args.source)
    vectors = [v for t in tests for v in onnx_node.read_node_test(t, args.profile)]
    text = onnx_node.suite_text(args.name, vectors, args.profile, str(args.source))
    suite = parse_suite(text, source=f"{args.output}/suite.yaml")
    peer = Path(f"{args.output}.onnx.safetensors")
    if (peer.exists() or peer.is_symlink()) and not args.force:
        raise GoldenError(f"{peer}: exists; pass --force to replace it (and {args.output} if fp8ref wrote it)")
    manifest = generate(suite, args.output, force=args.force)
    st.save(peer, onnx_node.peer_outputs(vectors), {"producer": "fp8ref golden import onnx-node",
                                                    "source": str(args.source)})
    print(f"golden import: {len(tests)} node test(s), {len(manifest['cases'])} case(s) in {args.output} "
          f"(suite {suite.name}, {args.profile} rule); ONNX's outputs in {peer}")
    for v in vectors:
        for i, bits, why, agrees in v.dropped:
            verdict = "" if agrees is None else ": agrees" if agrees else ": DIFFERS"
            print(f"left out {onnx_node.case_name(v)} element {i} (input 0x{bits:x}): {why}{verdict}")
    results, problems = check(args.output, peer)
    by_case = {r.case: r for r in results}
    for v in vectors:
        r = by_case.get(onnx_node.case_name(v))
        if r is not None:
            verdict = "agrees" if not r.mismatches and r.status == "compared" else \
                f"differs on {len(r.mismatches)} of {r.elements} element(s)" if r.status == "compared" else r.status
            print(f"{v.test} {v.data_set}: fp8ref {verdict}")
    differ = print_results(results, header=f"golden check {args.output} against {peer}",
                           is_xfailed=lambda case, tags: False, max_errors=args.max_errors)
    for problem in problems:
        print(f"ERROR {problem}")
    agree = sum(1 for r in results if r.status == "compared" and not r.mismatches)
    differ += sum(1 for v in vectors for *_, ok in v.dropped if ok is False)
    print(f"result: fp8ref ({args.profile} rule) agrees with {agree} of {len(results)} vector(s)"
          + (f"; {differ} element(s) differ (listed above)" if differ else ""))
    return 1 if problems else 0


def cmd_list(args) -> int:
    suite = load_suite(args.suite)
    level = args.level or suite.level
    for _op, _, name, params in cases(suite, level):
        print(f"{name}  {json.dumps(params, sort_keys=True)}")
    return 0
