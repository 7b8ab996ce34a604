"""pytest plugin (entry point ``pytest11``: ``fp8ref``): ``pytest --fp8ref-backend=NAME`` runs
the conformance suites inside a backend project's own test run.

One test item per suite case (skipped with the reason when the backend does not implement
it, xfailed when all its differences are in the backend's xfails file), plus one
hypothesis test per encode format x mode x saturate the backend implements, on float32
values drawn by hypothesis: any float32, and sign x exponent (over the format's range and
past it) x significand (derandomized, so every run gives the same verdict).

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
                    help="suite file or shipped name (repeatable; default: formats, fp8-static-w8a8)")
    group.addoption("--fp8ref-level", type=int, default=None, help="suite level (1 quick, 2 thorough)")
    group.addoption("--fp8ref-xfails", default=None, help="xfails file (default: the backend's shipped one)")
    group.addoption("--fp8ref-nan-rule", default="any", choices=("any", "sign", "exact"))
    group.addoption("--fp8ref-max-examples", type=int, default=100, help="hypothesis examples per test")


def pytest_collection_modifyitems(session, config, items) -> None:
    name = config.getoption("fp8ref_backend")
    if not name:
        return
    from .backend import BackendUnavailable, load_backend

    collector = _Collector.from_parent(session, name="fp8ref-conformance")
    try:
        backend = load_backend(name)
    except BackendUnavailable as exc:
        items.append(_Skip.from_parent(collector, name=f"backend[{name}]", reason=str(exc)))
        return
    items.extend(_items(collector, backend, name, config))


class _Collector(pytest.Collector):
    def collect(self):  # items are created by pytest_collection_modifyitems
        return []


def _items(collector, backend, spec: str, config):
    from ..golden import DEFAULT_SUITES, load_suite
    from ..golden.ops import OPERATIONS
    from ..golden.suite import cases
    from .xfails import default_xfails, load_xfails

    path = config.getoption("fp8ref_xfails")
    xfails = load_xfails(path) if path else default_xfails(backend.name)
    level_opt = config.getoption("fp8ref_level")
    nan_rule = config.getoption("fp8ref_nan_rule")
    encode_params = []
    for suite in map(load_suite, config.getoption("fp8ref_suite") or DEFAULT_SUITES):
        level = level_opt or suite.level
        for op, entry, name, params in cases(suite, level):
            yield _CaseItem.from_parent(collector, name=f"{suite.name}::{name}", backend=backend, spec=spec,
                                        op=op, entry=entry, case=name, params=params, suite=suite, level=level,
                                        xfails=xfails, nan_rule=nan_rule)
            key = {k: params[k] for k in ("format", "rounding", "saturate")} if op.name == "encode" else None
            if key and key["rounding"] != "stochastic" and key not in encode_params \
                    and backend.implements("encode", {**params, "dtype": "float32"}) is None:
                encode_params.append(key)
    for key in encode_params:
        yield _HypothesisItem.from_parent(
            collector, name=f"hypothesis::{OPERATIONS['encode'].case_name({**key, 'dtype': 'float32'})}",
            backend=backend, params=key, xfails=xfails, nan_rule=nan_rule,
            max_examples=config.getoption("fp8ref_max_examples"))


class _Skip(pytest.Item):
    def __init__(self, *, reason: str, **kw):
        super().__init__(**kw)
        self.reason = reason

    def runtest(self):
        pytest.skip(self.reason)


class _CaseItem(pytest.Item):
    def __init__(self, *, backend, spec, op, entry, case, params, suite, level, xfails, nan_rule, **kw):
        super().__init__(**kw)
        self.backend, self.spec, self.op, self.entry, self.case = backend, spec, op, entry, case
        self.params, self.suite, self.level, self.xfails, self.nan_rule = params, suite, level, xfails, nan_rule

    def runtest(self):
        import numpy as np

        from .report import mismatch_line, repro_line
        from .runner import run_case

        reason = self.backend.implements(self.op.name, self.params)
        if reason:
            pytest.skip(f"not implemented: {reason}")
        with np.errstate(all="ignore"):
            r = run_case(self.backend, self.op, self.entry, self.case, self.params, self.suite, self.level,
                         self.nan_rule)
        if r.status == "not-implemented":  # e.g. a case the fp32-order bound does not cover
            pytest.skip(f"not implemented: {r.reason}")
        if getattr(r, "in_bound", 0):  # passing by the declared fp32-order bound, not bit for bit
            self.user_properties.append(("fp32_order_bound", f"{r.in_bound} of {r.elements} elements in bound, "
                                                             f"max {r.max_bound_used:.3g} of the bound used"))
        known = self.xfails.match if self.xfails else (lambda case, tags: False)
        if r.status == "error":
            if known(r.case, ("error",)):
                pytest.xfail(r.reason)
            raise AssertionError(r.reason)
        bad = [m for m in r.mismatches if not known(m.case, m.tags)]
        if bad:
            fmt = self.op.output_format(self.params, bad[0].output)
            lines = [mismatch_line(m, fmt) for m in bad[:10]]
            raise AssertionError(f"{len(bad)} of {r.elements} elements differ; simplest first:\n"
                                 + "\n".join(lines) + "\nrepro: " + repro_line(bad[0], self.spec, self.suite.name,
                                                                               self.level))
        if r.mismatches:
            pytest.xfail(f"{len(r.mismatches)} documented differences ({self.xfails.source})")

    def reportinfo(self):
        return self.suite.source, None, f"fp8ref {self.backend.name}: {self.case}"


class _HypothesisItem(pytest.Item):
    def __init__(self, *, backend, params, xfails, nan_rule, max_examples, **kw):
        super().__init__(**kw)
        self.backend, self.params, self.xfails = backend, params, xfails
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
                pytest.fail(mismatch_line(bad[0], f.name), pytrace=False)

        check()
