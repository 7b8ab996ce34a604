"""pytest plugin (entry point ``pytest11``: ``fp8ref``): ``pytest --fp8ref-backend=NAME`` runs
the conformance suites inside a backend project's own test run: the suites ``fp8ref conform``
runs (``suites_for``: the backend's ``default_suites``, and ``block-scaled`` where it declares
block16/block32 scaled_mm), or those ``--fp8ref-suite`` names.

One test item per suite case the backend implements (xfailed when all its differences are in
the backend's xfails file; the cases it does not implement are counted in the terminal
summary, one line per reason, with the xfails entries that matched nothing), plus one
hypothesis test per encode format x mode x saturate the backend implements, on float32
values drawn by hypothesis: any float32, and sign x exponent (over the format's range and
past it) x significand (derandomized, so every run gives the same verdict). A failure reports
only its mismatch lines and a repro; an unknown or broken backend is a usage error.
``--fp8ref-accumulation=MODEL`` judges the GEMM cases against a registered accumulation model
(fp8ref.golden.accumulation; a failure also names the model that explains that case best).

Without ``--fp8ref-backend`` the plugin does nothing; importing it costs the ``fp8ref``
package import (numpy and the codec) and nothing else: no peer library, no suite.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("fp8ref", "fp8ref conformance")
    group.addoption("--fp8ref-backend", default=None, help="run fp8ref's conformance suites against this backend "
                    "(built-in name, 'fp8ref.backends' entry point, or module:object)")
    group.addoption("--fp8ref-suite", action="append", default=None,
                    help="suite file or shipped name (repeatable; default: the backend's default_suites, else "
                    "formats, fp8-static-w8a8; and block-scaled where it declares block16/block32 scaled_mm: "
                    "the suites `fp8ref conform` runs)")
    group.addoption("--fp8ref-level", type=int, default=None, help="suite level (1 quick, 2 thorough)")
    group.addoption("--fp8ref-xfails", default=None, help="xfails file (default: the backend's shipped one)")
    group.addoption("--fp8ref-nan-rule", default="any", choices=("any", "sign", "exact"))
    group.addoption("--fp8ref-max-examples", type=int, default=100, help="hypothesis examples per test")
    group.addoption("--fp8ref-accumulation", default=None, metavar="MODEL",
                    help="judge scaled_mm/linear bit for bit against this registered accumulation model "
                    "(e.g. hopper-fast-accum; docs/accumulation.md), the backend asked for accumulate=MODEL")


class ConformanceFailure(AssertionError):
    """A case's verdict: its message (mismatch lines and a repro) is the whole failure report."""


def pytest_configure(config) -> None:
    """Load the backend once, before collection: an unknown or broken backend is a usage error
    (one line), not an INTERNALERROR."""
    name = config.getoption("fp8ref_backend", None)
    if not name:
        return
    from ..errors import Fp8RefError
    from .backend import BackendUnavailable, load_backend

    config._fp8ref = {"backend": None, "unavailable": None, "deselected": {}, "xfails": None, "skipped_suites": []}
    model = config.getoption("fp8ref_accumulation", None)
    if model is not None:
        from ..golden.accumulation import BEST, check_name

        try:
            check_name(model)
        except Fp8RefError as exc:
            raise pytest.UsageError(f"--fp8ref-accumulation={model}: {exc}") from None
        if model == BEST:
            raise pytest.UsageError("--fp8ref-accumulation=best ranks the models over a whole run, not per test: "
                                    "run `fp8ref conform --accumulation best`")
    try:
        config._fp8ref["backend"] = load_backend(name)
    except BackendUnavailable as exc:
        config._fp8ref["unavailable"] = str(exc)
    except Fp8RefError as exc:
        raise pytest.UsageError(f"--fp8ref-backend={name}: {exc}") from None


def pytest_collection_modifyitems(session, config, items) -> None:
    state = getattr(config, "_fp8ref", None)
    if state is None:
        return
    name = config.getoption("fp8ref_backend")
    collector = _Collector.from_parent(session, name="fp8ref-conformance")
    if state["unavailable"]:
        items.append(_Skip.from_parent(collector, name=f"backend[{name}]", reason=state["unavailable"]))
        return
    from ..errors import Fp8RefError

    try:
        items.extend(_items(collector, state["backend"], name, config))
    except Fp8RefError as exc:  # a bad suite or xfails file
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config):
    state = getattr(config, "_fp8ref", None)
    if state and state["backend"] is not None:
        return f"fp8ref: backend {state['backend'].name!r} ({config.getoption('fp8ref_backend')})"
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Capability suites the backend does not declare, cases it does not implement (deselected, one
    line per reason, not one skip each) and xfails entries that matched nothing this run (stale:
    delete them)."""
    state = getattr(config, "_fp8ref", None)
    if not state or state["backend"] is None:
        return
    write = terminalreporter.write_line
    for line in state["skipped_suites"]:
        write(f"fp8ref: {line}")
    deselected = state["deselected"]
    if deselected:
        write(f"fp8ref: {sum(deselected.values())} case(s) not implemented by {state['backend'].name}, "
              "not run:")
        from .report import reason_lines

        for line in reason_lines(deselected, limit=len(deselected)):  # as conform words them, every one
            write(line)
    xfails = state["xfails"]
    if xfails is not None:
        for entry in xfails.stale():  # an entry for cases this run did not include is not judged
            write(f"fp8ref: stale xfail {xfails.source}:{entry.line}: {entry.text!r} matched nothing in this run; "
                  "delete it")


class _Collector(pytest.Collector):
    def collect(self):  # items are created by pytest_collection_modifyitems
        return []


def _items(collector, backend, spec: str, config):
    from ..golden import load_suite
    from ..golden.accumulation import covers, under
    from ..golden.ops import OPERATIONS
    from ..golden.suite import cases
    from .backend import guarded, suites_for
    from .xfails import default_xfails, load_xfails

    path = config.getoption("fp8ref_xfails")
    xfails = load_xfails(path) if path else default_xfails(backend.name)
    config._fp8ref["xfails"] = xfails
    deselected = config._fp8ref["deselected"]
    level_opt = config.getoption("fp8ref_level")
    nan_rule = config.getoption("fp8ref_nan_rule")
    model = config.getoption("fp8ref_accumulation")
    encode_params = []
    names, config._fp8ref["skipped_suites"] = suites_for(backend, config.getoption("fp8ref_suite"))
    for suite in map(load_suite, names):
        level = level_opt or suite.level
        for op, entry, name, params in cases(suite, level):
            asked = under(params, model) if model and covers(op) else params  # what run_case asks for
            reason = guarded(backend.name, f"implements({op.name!r}, ...)", backend.implements, op.name, asked)
            if reason:
                deselected[reason] = deselected.get(reason, 0) + 1
                continue
            yield _CaseItem.from_parent(collector, name=f"{suite.name}::{name}", backend=backend, spec=spec,
                                        op=op, entry=entry, case=name, params=params, suite=suite, level=level,
                                        xfails=xfails, nan_rule=nan_rule, model=model if covers(op) else None)
            key = {k: params[k] for k in ("format", "rounding", "saturate")} if op.name == "encode" else None
            if key and key["rounding"] != "stochastic" and key not in encode_params \
                    and guarded(backend.name, "implements('encode', ...)", backend.implements, "encode",
                                {**params, "dtype": "float32"}) is None:
                encode_params.append(key)
    for key in encode_params:
        yield _HypothesisItem.from_parent(
            collector, name=f"hypothesis::{OPERATIONS['encode'].case_name({**key, 'dtype': 'float32'})}",
            backend=backend, spec=spec, params=key, xfails=xfails, nan_rule=nan_rule,
            max_examples=config.getoption("fp8ref_max_examples"))


class _Skip(pytest.Item):
    def __init__(self, *, reason: str, **kw):
        super().__init__(**kw)
        self.reason = reason

    def runtest(self):
        pytest.skip(self.reason)


class _CaseItem(pytest.Item):
    def __init__(self, *, backend, spec, op, entry, case, params, suite, level, xfails, nan_rule, model=None, **kw):
        super().__init__(**kw)
        self.backend, self.spec, self.op, self.entry, self.case = backend, spec, op, entry, case
        self.params, self.suite, self.level, self.xfails, self.nan_rule = params, suite, level, xfails, nan_rule
        self.model = model  # --fp8ref-accumulation, for a GEMM case

    def runtest(self):
        import numpy as np

        from ..golden.accumulation import ModelJudge
        from .backend import describe_failure
        from .report import mismatch_line, repro_line
        from .runner import CaseExit, run_case

        judge = ModelJudge(self.model, self.nan_rule) if self.model else None
        try:
            with np.errstate(all="ignore"):
                r = run_case(self.backend, self.op, self.entry, self.case, self.params, self.suite, self.level,
                             self.nan_rule, judge=judge)
        except CaseExit as exc:  # the backend's own sys.exit/KeyboardInterrupt: this case fails, pytest goes on
            raise ConformanceFailure(f"{self.case}: backend {describe_failure(exc.exc)}") from None
        if r.status == "not-implemented":  # e.g. a case the fp32-order bound does not cover
            pytest.skip(f"not implemented: {r.reason}")
        if getattr(r, "in_bound", 0):  # passing by the declared fp32-order bound, not bit for bit
            self.user_properties.append(("fp32_order_bound", f"{r.in_bound} of {r.elements} elements in bound, "
                                                             f"max {r.max_bound_used:.3g} of the bound used"))
        known = self.xfails.match if self.xfails else (lambda case, tags: False)
        if self.xfails is not None:
            self.xfails.record([r])
        if r.status == "error":
            if known(r.case, ("error",)):
                pytest.xfail(r.reason)
            raise ConformanceFailure(f"{self.case}: {r.reason}")
        bad = [m for m in r.mismatches if not known(m.case, m.tags)]
        if bad:
            fmt = self.op.output_format(self.params, bad[0].output)
            lines = [mismatch_line(m, fmt) for m in bad[:10]]
            more = f"\n... and {len(bad) - 10} more" if len(bad) > 10 else ""
            best = f"\n{judge.report_lines()[-1]} for this case" if judge is not None else ""
            raise ConformanceFailure(f"{self.case}: {len(bad)} of {r.elements} elements differ; simplest first:\n"
                                     + "\n".join(lines) + more + best + "\nrepro: "
                                     + repro_line(bad[0], self.spec, self.suite.name, self.level, self.model))
        if r.mismatches:
            pytest.xfail(f"{len(r.mismatches)} documented differences ({self.xfails.source})")

    def reportinfo(self):
        return self.suite.source, None, f"fp8ref {self.backend.name}: {self.case}"

    def repr_failure(self, excinfo, style=None):
        return _short_failure(excinfo) or super().repr_failure(excinfo, style=style)


def _short_failure(excinfo) -> str | None:
    """The verdict's own text, without pytest's and pluggy's frames."""
    if excinfo.errisinstance(ConformanceFailure):
        return str(excinfo.value)
    if excinfo.errisinstance(pytest.fail.Exception):
        return str(excinfo.value.msg if hasattr(excinfo.value, "msg") else excinfo.value)
    return None


class _HypothesisItem(pytest.Item):
    def __init__(self, *, backend, spec, params, xfails, nan_rule, max_examples, **kw):
        super().__init__(**kw)
        self.backend, self.spec, self.params, self.xfails = backend, spec, params, xfails
        self.nan_rule, self.max_examples = nan_rule, max_examples

    def runtest(self):
        import numpy as np
        from hypothesis import given, settings
        from hypothesis import strategies as st
        from hypothesis.extra.numpy import arrays

        from ..formats import get_format
        from ..golden.judge import check_output, mismatches
        from ..golden.ops import OPERATIONS
        from .report import mismatch_line

        op, p = OPERATIONS["encode"], {**self.params, "dtype": "float32"}
        f = get_format(p["format"])
        name = op.case_name(p)
        known = self.xfails.match if self.xfails else (lambda case, tags: False)
        # the contract rejects NaN (and unsaturated Inf) for formats without NaN (fp4/fp6)
        anything = st.floats(width=32, allow_nan=f.has_nan, allow_infinity=f.has_nan or p["saturate"])
        # TestFloat style: sign x exponent across the format's range (and past it) x significand,
        # so subnormals, the normal border and overflow are drawn as often as ordinary values
        scaled = st.builds(lambda s, e, m: np.float32(np.ldexp((-1.0) ** s * m, e)), st.integers(0, 1),
                           st.integers(f.emin - f.mantissa_bits - 2, f.emax + 2),
                           st.floats(1.0, 2.0, exclude_max=True, width=32))
        floats = st.one_of(anything, scaled)

        # derandomized: a conformance run must give the same verdict every time
        @settings(max_examples=self.max_examples, deadline=None, database=None, derandomize=True)
        @given(arrays(np.float32, st.integers(1, 64), elements=floats))
        def check(x):
            inputs = {"x": x}
            with np.errstate(all="ignore"):
                expected = op.reference(p, inputs)["codes"]
                got = check_output("codes", expected, op.call(self.backend, p, inputs)["codes"], f.name)
                bad = [m for m in mismatches(op, name, p, inputs, "codes", expected, got, self.nan_rule)
                       if not known(m.case, m.tags)]
            if bad:  # pytest.fail, not assert: the verdict must survive python -O
                x_hex = " ".join(f"0x{int(v):08x}" for v in np.asarray(x, np.float32).view(np.uint32))
                pytest.fail(f"{self.name}: {len(bad)} element(s) differ; first: {mismatch_line(bad[0], f.name)}\n"
                            f"hypothesis input (float32 bits, derandomized: the same on every run): {x_hex}\n"
                            f"repro: pytest --fp8ref-backend={self.spec} --fp8ref-max-examples={self.max_examples} "
                            f"-k '{self.name}'", pytrace=False)

        check()

    def repr_failure(self, excinfo, style=None):
        return _short_failure(excinfo) or super().repr_failure(excinfo, style=style)
