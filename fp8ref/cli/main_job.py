"""The main job (``fp8ref`` with no arguments): generate and verify the default golden suites,
then run the conformance harness against torch, and print a readable summary.

Everything runs on built-in defaults: the shipped suites at level 1, torch's shipped
xfails file, NaN rule 'any'. Exit code 0 when the golden files verify and torch shows
nothing beyond its documented differences.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from ..conformance import BackendUnavailable, default_xfails, load_backend, run
from ..conformance.report import SUMMARY_COLUMNS, summarize, table
from ..errors import Fp8RefError
from ..golden import DEFAULT_SUITES, generate, load_suite, verify


def run_default(out=None) -> int:
    out = out or sys.stdout
    say = lambda text="": print(text, file=out)  # noqa: E731
    suites = [load_suite(name) for name in DEFAULT_SUITES]
    say("fp8ref: bit-exact FP8 reference. Main job: golden suites, then torch conformance (level 1).")
    ok = True
    with tempfile.TemporaryDirectory(prefix="fp8ref-golden-") as tmp:
        for suite in suites:
            folder = Path(tmp) / suite.name
            t0 = time.perf_counter()
            manifest = generate(suite, folder)
            t1 = time.perf_counter()
            try:
                problems, _ = verify(folder)
            except Fp8RefError as exc:
                problems = [str(exc)]
            t2 = time.perf_counter()
            size = sum((folder / n).stat().st_size for n in manifest["files"])
            say(f"golden  {suite.name:<16} {len(manifest['cases']):4d} cases  {size / 1e6:5.1f} MB  "
                f"generate {t1 - t0:4.1f} s  verify {t2 - t1:4.1f} s  "
                + ("OK (sha256 + re-derived)" if not problems else f"FAILED: {problems[0]}"))
            ok &= not problems
    say()
    try:
        backend = load_backend("torch")
    except BackendUnavailable as exc:
        say(f"conformance: skipped ({exc})")
        return 0 if ok else 1
    xfails = default_xfails("torch")
    for suite in suites:
        t0 = time.perf_counter()
        result = run(backend, suite, xfails=xfails)
        say(f"conformance  torch ({result.backend_version})  suite {suite.name} level {result.level}  "
            f"{time.perf_counter() - t0:.1f} s")
        say(table(summarize(result.results, result.xfailed), SUMMARY_COLUMNS))
        found = Counter()
        for r in result.results:
            for m in r.mismatches:
                for e in xfails.matching(m.case, m.tags) if xfails else ():
                    found[e.text] += 1
        if found:
            say("  documented differences found (xfails/torch.txt):")
            for text, n in sorted(found.items(), key=lambda kv: -kv[1]):
                say(f"    {n:6d}  {text}")
        if result.unexpected:
            say(f"  UNEXPECTED: {result.unexpected} mismatch(es)/error(s); details: "
                f"fp8ref conform --backend torch --suite {suite.name}")
            ok = False
        say()
    say("result: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1
