"""Judging GEMM outputs against a named accumulation model, and naming the model that explains them.

``fp8ref golden check --accumulation MODEL`` and ``fp8ref conform --accumulation MODEL``: the
outputs of every GEMM case (an operation with an ``accumulate`` parameter: scaled_mm, linear)
are compared bit for bit with ``op.reference`` of the case's inputs under ``accumulate=MODEL``
(any name of ``fp8ref.matmul.ACCUMULATION_MODELS``: exact, fp32, fp32-limited and every kernel
preset of ``fp8ref.hardware``), with the case's other parameters (output dtype and rounding,
bias, scale order) as declared. A case MODEL cannot compute (a CDNA3 FNUZ instruction on e4m3fn
codes, an instruction that takes block-scale codes) is "not implemented", with the model's reason.

Every registered model is also computed once per GEMM case and ranked by the output elements it
matches bit for bit (the case's NaN rule), ties broken by the largest ULP distance, then by
registry order: the ranking says which model explains the outputs best, and which models the
cases cannot tell apart. ``BEST`` (``--accumulation best``) judges every GEMM case against the
top-ranked model, so a run passes when one registered model explains every output bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import Fp8RefError, GoldenError, did_you_mean
from ..formats import get_format
from ..matmul import ACCUMULATION_MODELS
from .judge import CaseResult, OutputError, _nan_mask, check_output, differing, judge_output, ulp_distance

BEST = "best"


def choices() -> tuple[str, ...]:
    """What ``--accumulation`` accepts: every registered model, then ``best``."""
    return (*ACCUMULATION_MODELS, BEST)


def check_name(name: str) -> str:
    """``name`` when it is a registered model or ``best``, else a GoldenError with a did-you-mean."""
    if name not in choices():
        raise GoldenError(f"accumulation: unknown model {name!r}{did_you_mean(name, choices(), clause=True)} "
                          f"(known: {', '.join(choices())})")
    return name


def covers(op) -> bool:
    """Operations whose outputs an accumulation model determines (their cases declare ``accumulate``)."""
    return "accumulate" in op.params


def under(params: Mapping, model: str) -> dict:
    """The case's parameters as if it had declared ``accumulate=model``."""
    return dict(params, accumulate=model)


def model_outputs(op, params: Mapping, inputs: Mapping[str, np.ndarray], model: str) -> tuple[dict | None, str]:
    """(outputs, "") of the case under ``model``, or (None, why the model cannot compute it)."""
    try:
        with np.errstate(all="ignore"):
            return op.reference(under(params, model), inputs), ""
    except Fp8RefError as exc:
        return None, str(exc)


@dataclass
class Standing:
    """One model's record over a run: GEMM cases ranked, cases it cannot compute (with the first
    reason), output elements, elements equal bit for bit, and the largest ULP distance of the
    others (None: none differs, or only NaN against a number)."""

    model: str
    cases: int = 0
    not_applicable: int = 0
    reason: str = ""
    elements: int = 0
    matched: int = 0
    max_ulp: int | None = None

    def to_json(self) -> dict:
        return {"model": self.model, "cases": self.cases, "not_applicable": self.not_applicable,
                "reason": self.reason or None, "elements": self.elements, "matched": self.matched,
                "max_ulp": self.max_ulp}


@dataclass
class _Deferred:
    result: CaseResult
    op: object
    case: str
    params: Mapping
    inputs: Mapping
    got: dict
    labels: dict
    candidates: dict


@dataclass
class ModelJudge:
    """One run's judge of GEMM cases: ``judge`` each case as it comes, ``finish`` after the last."""

    model: str
    nan_rule: str = "any"
    keep_failing: bool = False  # a case with mismatches keeps its tensors (conformance --dump-failing)
    # the status of a case the model cannot compute: a live run's "not-implemented"; a golden
    # check's "error" (the outputs are there and cannot be judged as asked)
    cannot: str = "not-implemented"
    standings: dict[str, Standing] = field(default_factory=dict)
    _deferred: list[_Deferred] = field(default_factory=list)
    judged_against: str | None = None

    def __post_init__(self):
        check_name(self.model)
        self.standings = {m: Standing(m) for m in ACCUMULATION_MODELS}
        if self.model != BEST:
            self.judged_against = self.model

    def call_params(self, params: Mapping) -> dict:
        """The parameters a backend is asked for: accumulate=MODEL, or the case's own under ``best``."""
        return dict(params) if self.model == BEST else under(params, self.model)

    def judge(self, result: CaseResult, op, case: str, params: Mapping, inputs: Mapping[str, np.ndarray],
              got: Mapping, labels: Mapping[str, str] | None = None) -> None:
        """Rank every model on this case's outputs ``got``, then judge it against MODEL now (under
        ``best``: in ``finish``). A wrong dtype or shape makes the case an error and is not ranked."""
        labels = dict(labels or {})
        candidates = {m: model_outputs(op, params, inputs, m) for m in self.standings}
        shapes = next((outs for outs, _ in candidates.values() if outs is not None), None)
        if shapes is None:
            result.status, result.rule = self.cannot, f"model {self.model}"
            result.reason = ("no registered accumulation model computes this case" if self.model == BEST
                             else f"accumulate={self.model!r} cannot compute it: {candidates[self.model][1]}")
            return
        try:  # the output dtype and shape are the case's, whichever model computes it
            checked = {name: check_output(labels.get(name, name), ref, got[name], op.output_format(params, name))
                       for name, ref in shapes.items()}
        except OutputError as exc:
            result.status, result.reason = "error", str(exc)
            return
        self._rank(op, params, candidates, checked)
        pending = _Deferred(result, op, case, params, inputs, checked, labels, candidates)
        if self.model == BEST:
            self._deferred.append(pending)
        else:
            _judge_against(pending, self.model, self)

    def _rank(self, op, params, candidates, got) -> None:
        for model, (outs, reason) in candidates.items():
            row = self.standings[model]
            row.cases += 1
            n = sum(g.size for g in got.values())
            row.elements += n
            if outs is None:
                row.not_applicable += 1
                row.reason = row.reason or reason
                continue
            for name, g in got.items():
                fmt, exp = op.output_format(params, name), outs[name]
                diff = differing(exp, g, fmt, self.nan_rule)
                row.matched += int(g.size - diff.sum())
                finite = diff & ~(_is_nan(exp, fmt) | _is_nan(g, fmt))
                if finite.any():
                    top = int(ulp_distance(exp[finite], g[finite], fmt).max())
                    row.max_ulp = top if row.max_ulp is None else max(row.max_ulp, top)

    def ranked(self) -> list[Standing]:
        order = {m: i for i, m in enumerate(self.standings)}
        return sorted(self.standings.values(), key=lambda s: (-s.matched, s.not_applicable == s.cases,
                                                               -1 if s.max_ulp is None else s.max_ulp,
                                                               order[s.model]))

    def best(self) -> Standing | None:
        """The top-ranked model that computes at least one case, or None (no GEMM case ranked)."""
        return next((s for s in self.ranked() if s.cases > s.not_applicable), None)

    def tied(self) -> list[str]:
        """The other models that match exactly as many elements as the best one."""
        top = self.best()
        if top is None:
            return []
        return [s.model for s in self.ranked() if s.model != top.model and s.matched == top.matched
                and s.cases > s.not_applicable]

    def finish(self) -> None:
        """Under ``best``: judge every deferred case against the top-ranked model."""
        if self.model == BEST:
            top = self.best()
            self.judged_against = top.model if top else None
            for pending in self._deferred:
                if top is None:
                    pending.result.status = self.cannot
                    pending.result.reason = "no registered accumulation model computes this case"
                else:
                    _judge_against(pending, top.model, self)
        self._deferred = []

    def to_json(self) -> dict:
        top = self.best()
        return {"model": self.model, "judged_against": self.judged_against, "best": top.model if top else None,
                "tied": self.tied(), "ranking": [s.to_json() for s in self.ranked()]}

    def header(self) -> str:
        """How the run's GEMM cases were judged, for a report's first line."""
        if self.model == BEST:
            return f"accumulation model 'best' (judged against {self.judged_against or 'none'})"
        return f"accumulation model {self.model!r}"

    def report_lines(self) -> list[str]:
        """The ranking as text, then the best model (and those the cases cannot tell from it)."""
        rows = [s for s in self.ranked() if s.cases]
        if not rows:
            return ["accumulation models: no GEMM case was compared, nothing to rank"]
        total = rows[0].elements
        lines = [f"accumulation models ranked by the GEMM output elements each explains bit for bit "
                 f"({rows[0].cases} case(s), {total} element(s)):"]
        width = max(len(s.model) for s in rows)
        for s in rows:
            if s.not_applicable == s.cases:
                lines.append(f"  {s.model:<{width}}  n/a: {s.reason}")
                continue
            ulp = "-" if s.max_ulp is None else str(s.max_ulp)
            na = f"  ({s.not_applicable} case(s) n/a: {s.reason})" if s.not_applicable else ""
            lines.append(f"  {s.model:<{width}}  {s.matched:>{len(str(total))}} / {total} match  max ulp {ulp}{na}")
        top, tied = self.best(), self.tied()
        if top is None:
            return [*lines, "best: none (no registered model computes these cases)"]
        every = top.matched == total
        same = ""
        if tied:
            same = (f"; {', '.join(tied)} also every element (these cases do not tell them apart)" if every
                    else f"; {', '.join(tied)} as many")
        return [*lines, f"best: {top.model} ({'every element' if every else f'{top.matched} of {total} elements'})"
                        f"{same}"]


def _is_nan(a: np.ndarray, fmt: str | None) -> np.ndarray:
    return _nan_mask(a, get_format(fmt) if fmt else None)


def _judge_against(p: _Deferred, model: str, judge: ModelJudge) -> None:
    """Judge one case against ``model``'s outputs into its CaseResult (not implemented when the
    model cannot compute it)."""
    outs, reason = p.candidates[model]
    p.result.params = under(p.params, model)
    p.result.rule = f"model {model}"
    if outs is None:
        p.result.status, p.result.reason = judge.cannot, f"accumulate={model!r} cannot compute it: {reason}"
        return
    for name, exp in outs.items():
        try:
            judge_output(p.result, p.op, p.case, p.result.params, p.inputs, name, exp, p.got[name], judge.nan_rule,
                         label=p.labels.get(name))
        except OutputError as exc:
            p.result.status, p.result.reason = "error", str(exc)
            return
    if judge.keep_failing and p.result.mismatches:
        p.result.tensors = {**{f"input/{k}": v for k, v in p.inputs.items()},
                            **{f"expected/{k}": v for k, v in outs.items()},
                            **{f"got/{k}": np.asarray(v) for k, v in p.got.items()}}
