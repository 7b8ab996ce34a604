"""Run a golden suite live against a backend, TestFloat style.

Each case of the suite is generated in memory, its expected outputs derived with fp8ref's
core, and the backend called on the same inputs. A case the backend does not declare is
"not implemented" (never run, never a pass); a backend that raises fails that case and the
run goes on. Mismatches are then matched against the backend's xfails file.

A backend that declares ``accumulation_order = {"scaled_mm": "unspecified"}`` (its fp32
sum follows an order it does not specify, as BLAS does) has its fp32 scaled_mm cases judged
by the fp32-order bound instead (``fp8ref.golden.judge``): expected is fp8ref's exact result, elements
equal to it match, elements inside the proven bound are counted as "in bound" (never as
matches), and only elements outside it are mismatches.

A backend whose own code raises ``SystemExit`` (``sys.exit``) or ``KeyboardInterrupt`` fails
that case and stops the run: ``RunResult.stopped`` says where, the cases before it are reported.
The user's Ctrl-C (or a kill whose signal has a Python handler) is told apart by the signal that
reached the process (``backend.signals_seen``) and still ends the run with KeyboardInterrupt.

``run(..., accumulation=MODEL)`` judges the GEMM cases against a named accumulation model instead
(the backend asked for ``accumulate=MODEL``; ``fp8ref.golden.accumulation``), whatever order the
backend declares, and ranks every registered model by the elements it explains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import BackendError
from ..golden.accumulation import BEST, ModelJudge, covers, under
from ..golden.judge import (
    ACCUMULATION_ORDERS,
    NAN_RULES,
    CaseResult,
    OutputError,
    bound_interval,
    bound_reason,
    exact_params,
    judge_output,
)
from ..golden.suite import Suite, cases, load_suite
from ..profiles import PROFILES
from .backend import BackendExit, call_backend, check_capabilities, describe_failure, guarded, load_backend
from .report import operand_text
from .xfails import Xfails


def accumulation_order(backend, op: str) -> str:
    """'declared' (bit-exact against fp8ref's model of the case) or 'unspecified'."""
    order = dict(getattr(backend, "accumulation_order", None) or {}).get(op, "declared")
    if order not in ACCUMULATION_ORDERS:
        raise BackendError(f"backend {backend.name!r}: accumulation_order[{op!r}]: expected one of "
                           f"{ACCUMULATION_ORDERS}, got {order!r}")
    return order


@dataclass
class RunResult:
    backend: str
    backend_version: str
    suite: str
    level: int
    nan_rule: str
    results: list[CaseResult] = field(default_factory=list)
    xfails: Xfails | None = None
    accumulation: ModelJudge | None = None  # with run(accumulation=...): the ranking of the models
    profile: str = "fp8ref"
    stopped: str = ""  # why the run ended early: the backend raised SystemExit/KeyboardInterrupt in a case
    not_run: int = 0  # the cases after that one

    def xfailed(self, case: str, tags) -> bool:
        return self.xfails is not None and self.xfails.match(case, tags)

    @property
    def unexpected(self) -> int:
        """Mismatches and errors not covered by an xfail entry."""
        n = 0
        for r in self.results:
            n += r.status == "error" and not self.xfailed(r.case, ("error",))
            n += sum(1 for m in r.mismatches if not self.xfailed(m.case, m.tags))
        return n

    def compared(self) -> int:
        return sum(1 for r in self.results if r.status == "compared")

    @property
    def exit_code(self) -> int:
        """0 only when the run ended, something was compared and nothing unexpected differed."""
        return 0 if self.unexpected == 0 and self.compared() > 0 and not self.stopped else 1


def run(backend, suite: Suite | str, *, level: int | None = None, nan_rule: str = "any",
        xfails: Xfails | None = None, select: Callable[[str], bool] | None = None,
        progress: Callable[[int, int, str], None] | None = None, keep_failing: bool = False,
        accumulation: str | None = None, profile: str = "fp8ref") -> RunResult:
    """Run ``suite`` (a Suite, a path or a shipped suite name) against ``backend`` (an object
    or a name for ``load_backend``). ``keep_failing``: a case with mismatches keeps its tensors
    (``input/NAME``, ``expected/NAME``, ``got/NAME``) in ``CaseResult.tensors``.

    ``accumulation``: a registered accumulation model or "best" (fp8ref.golden.accumulation): the
    GEMM cases are run with ``accumulate=MODEL`` (under "best": as declared) and judged bit for bit
    against that model (under "best": the top-ranked one), whatever the backend's
    ``accumulation_order`` says; ``RunResult.accumulation`` holds the ranking of every model.

    ``profile``: encode cases are judged against what that specification prescribes (``fp8ref.profiles``;
    "onnx": ONNX Cast's tables) instead of fp8ref's codec. Other operations are unchanged (ONNX's
    QuantizeLinear is recipe "onnx", a case parameter)."""
    if isinstance(backend, str):
        backend = load_backend(backend)
    else:
        check_capabilities(backend)
    if isinstance(suite, str):
        suite = load_suite(suite)
    if nan_rule not in NAN_RULES:
        raise ValueError(f"nan_rule: expected one of {NAN_RULES}, got {nan_rule!r}")
    level = suite.level if level is None else level
    judge = None if accumulation is None else ModelJudge(accumulation, nan_rule, keep_failing=keep_failing)
    if profile not in PROFILES:
        raise ValueError(f"profile: expected one of {PROFILES}, got {profile!r}")
    todo = [(op, entry, name, with_profile(op, params, profile)) for op, entry, name, params in cases(suite, level)
            if select is None or select(name)]
    version = guarded(backend.name, "version()", backend.version) if hasattr(backend, "version") else ""
    out = RunResult(backend.name, version, suite.name, level, nan_rule, xfails=xfails, accumulation=judge,
                    profile=profile)
    for done, (op, entry, name, params) in enumerate(todo, 1):
        try:
            with np.errstate(all="ignore"):  # peers' overflow/invalid-cast warnings are not results
                out.results.append(run_case(backend, op, entry, name, params, suite, level, nan_rule,
                                            keep_failing=keep_failing, judge=judge))
        except CaseExit as exc:  # the backend exited inside this case: report what ran, call it no more
            out.results.append(exc.result)
            out.stopped, out.not_run = f"{exc}; the run stopped there", len(todo) - done
            break
        if progress:
            progress(done, len(todo), name)
    if judge is not None:
        judge.finish()
    if xfails is not None:
        xfails.record(out.results)
    return out


def with_profile(op, params: dict, profile: str) -> dict:
    """An encode case's parameters with ``profile`` (fp8ref's own: unchanged, so its name and report stay)."""
    return {**params, "profile": profile} if profile != "fp8ref" and op.name == "encode" else params


class CaseExit(BackendExit):
    """BackendExit inside a case, with that case's result (status error)."""

    def __init__(self, exc: BackendExit, result: CaseResult):
        super().__init__(str(exc), exc.exc)
        self.result = result


def _exited(exc: BackendExit, result: CaseResult) -> CaseExit:
    """The case failed by the backend's exit; the run stops after it."""
    result.status, result.mismatches = "error", []
    result.reason = f"backend {describe_failure(exc.exc)}; the run stopped here"
    return CaseExit(exc, result)


def expected_outputs(backend, op, params, inputs) -> dict:
    """fp8ref's outputs the backend is compared with: the case's model, or the exact result
    when the backend's accumulation order is unspecified."""
    if accumulation_order(backend, op.name) == "unspecified":
        params = exact_params(params)
    return op.reference(params, inputs)


def run_case(backend, op, entry, name, params, suite, level, nan_rule, *, keep_failing: bool = False,
             judge: ModelJudge | None = None) -> CaseResult:
    if judge is not None and covers(op):
        return _run_model_case(backend, op, entry, name, params, suite, level, judge)
    result = CaseResult(name, op.name, dict(params))
    bounded = accumulation_order(backend, op.name) == "unspecified"
    reason = (guarded(backend.name, f"implements({op.name!r}, ...)", backend.implements, op.name, params)
              or (bound_reason(op.name, params) if bounded else None))
    if reason:
        result.status, result.reason = "not-implemented", reason
        return result
    case = op.make_case(name, params, entry, suite, level)
    expected = expected_outputs(backend, op, case.params, case.inputs)
    if bounded:
        result.rule = getattr(op, "tolerance_rule", "fp32-order bound")
    try:
        got = call_backend(backend.name, f"case {name}", op.call, backend, case.params,
                           {k: v.copy() for k, v in case.inputs.items()})
        for out_name, exp in expected.items():
            judge_output(result, op, name, case.params, case.inputs, out_name, exp, got[out_name], nan_rule,
                         bounded=bounded)
        if keep_failing and result.mismatches:
            result.tensors = {**{f"input/{k}": v for k, v in case.inputs.items()},
                              **{f"expected/{k}": v for k, v in expected.items()},
                              **{f"got/{k}": np.asarray(got[k]) for k in expected}}
    except OutputError as exc:
        result.status, result.reason, result.mismatches = "error", f"wrong output: {exc}", []
    except BackendExit as exc:
        raise _exited(exc, result) from None
    except Exception as exc:  # noqa: BLE001 - a backend failure is that case's result, not ours
        result.status, result.reason, result.mismatches = "error", f"backend raised {type(exc).__name__}: {exc}", []
    return result


def _run_model_case(backend, op, entry, name, params, suite, level, judge: ModelJudge) -> CaseResult:
    """A GEMM case under ``--accumulation``: the backend asked for ``judge.call_params``, its
    outputs handed to the judge (which compares them with every model)."""
    call = judge.call_params(params)
    result = CaseResult(name, op.name, call)
    reason = guarded(backend.name, f"implements({op.name!r}, ...)", backend.implements, op.name, call)
    if reason:
        result.status, result.reason = "not-implemented", reason
        return result
    case = op.make_case(name, params, entry, suite, level)
    try:
        got = call_backend(backend.name, f"case {name}", op.call, backend, call,
                           {k: v.copy() for k, v in case.inputs.items()})
    except BackendExit as exc:
        raise _exited(exc, result) from None
    except Exception as exc:  # noqa: BLE001 - a backend failure is that case's result, not ours
        result.status, result.reason = "error", f"backend raised {type(exc).__name__}: {exc}"
        return result
    judge.judge(result, op, name, case.params, case.inputs, got)
    return result


def repro(backend: str, suite: str, case: str, *, level: int = 1, index: tuple = (), nan_rule: str = "any",
          accumulation: str | None = None, model: str | None = None) -> None:
    """Re-run one case of a suite and print the element at ``index``: its inputs, the
    expected output and the backend's (used by the one-line repros of non-codec cases).
    ``accumulation``: as given to ``run``; ``model``: the model a "best" run judged against."""
    be = load_backend(backend)
    s = load_suite(suite)
    for op, entry, name, params in cases(s, level):
        if name != case:
            continue
        c = op.make_case(name, params, entry, s, level)
        modelled = accumulation is not None and covers(op)
        if modelled:  # as the run did: the backend asked for the model (under best: as declared)
            model = accumulation if accumulation != BEST else model
            expected = op.reference(under(c.params, model), c.inputs)
            got = op.call(be, c.params if accumulation == BEST else under(c.params, model), c.inputs)
        else:
            expected = expected_outputs(be, op, c.params, c.inputs)
            got = op.call(be, c.params, c.inputs)

        print(f"{case} [{', '.join(map(str, index))}]:")
        for label, value in op.operands(c.params, c.inputs, tuple(index)).items():
            print(f"  {label} = {operand_text(value)}")
        for out_name, exp in expected.items():
            g = np.asarray(got[out_name])
            if np.ndim(exp) != len(index) or any(i >= d for i, d in zip(index, np.shape(exp), strict=True)):
                continue  # the index is another output's (quantize's codes beside their scale)
            print(f"  {out_name}: expected {exp[index]!r}, got {g[index]!r}")
            if not modelled and accumulation_order(be, op.name) == "unspecified":
                iv = getattr(op, "bound_interval", bound_interval)(c.params, c.inputs)
                print(f"  fp32-order bound: exact {iv['x'][index]!r}, allowed [{iv['lo'][index]!r}, "
                      f"{iv['hi'][index]!r}]" + _domain_note(iv["domain"][index], exp[index], g[index]))
        return
    raise KeyError(f"suite {suite!r} level {level} has no case {case!r}")


def _domain_note(in_domain: bool, expected, got) -> str:
    """A NaN where a number is due is a wrong result, not a question of the bound's domain."""
    if np.isnan(np.float64(got)) and not np.isnan(np.float64(expected)):
        return " (got NaN: a wrong NaN result)"
    return "" if in_domain else " (outside the bound's domain)"
