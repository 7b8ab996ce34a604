"""``fp8ref compare --html OUT``: one self-contained page (inline CSS, PNG plots as data: URIs, no
script, no network resource) from a compare report: end-to-end agreement, the per-layer error
chart worst first, error histograms, the first divergent layers, the checkpoint's scale statistics.
Plots need matplotlib (the optional extra ``fp8ref[report]``)."""

from __future__ import annotations

import base64
import html
import io
import math

import numpy as np

from ..errors import ModelError

_CSS = ("body{font-family:sans-serif;margin:2em;max-width:70em;color:#222}table{border-collapse:collapse;"
        "margin:1em 0}td,th{border:1px solid #bbb;padding:.25em .6em;text-align:right}th{background:#eee}"
        "td:first-child,th:first-child{text-align:left}img{max-width:100%;display:block;margin:1em 0}"
        "code{background:#f4f4f4;padding:0 .2em}")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ModelError("--html needs matplotlib, which is not installed: pip install 'fp8ref[report]' "
                         "(or: pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight", metadata={"Software": None})
    fig.clf()
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _num(v) -> str:
    if isinstance(v, str):
        return html.escape(v)
    if v is None:
        return "–"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return html.escape(str(v))


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_num(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def scale_stats(ckpt) -> list[list]:
    """Per layer: scale strategy, weight-scale min / median / max, input scale (static) or mode."""
    rows = []
    for name in ckpt:
        layer = ckpt[name]
        s = np.asarray(layer.weight_scale).astype(np.float64).reshape(-1)
        inp = layer.input_scale
        rows.append([name, layer.quant.weight_strategy, float(s.min()), float(np.median(s)), float(s.max()),
                     float(np.asarray(inp).astype(np.float64).reshape(-1)[0]) if inp is not None
                     else (layer.quant.input or "none")])
    return rows


def render(report: dict, ckpt=None) -> str:
    plt = _pyplot()
    modes = report["modes"][1:]
    parts = [f"<h1>fp8ref compare: {html.escape(report.get('checkpoint', ''))}</h1>",
             f"<p>format <code>{html.escape(str(report.get('format')))}</code>, input "
             f"{html.escape(str(report.get('input')))}, baseline <code>{html.escape(report['baseline'])}</code>, "
             f"{len(report['layers'])} quantized layers.</p>", "<h2>End to end</h2>"]
    rows = []
    for mode, e in report["end_to_end"].items():
        first = report["first_divergent"].get(mode, {})
        rows.append([mode, e.get("kl"), e.get("top1_agree"), e.get("max_abs_diff"), e.get("perplexity"),
                     first.get("teacher_forced"), first.get("free_running")])
    parts.append(_table(["mode", "KL(baseline‖mode)", "top-1 agreement", "max |logit diff|", "perplexity",
                         "first divergent (teacher-forced)", "first divergent (free-running)"], rows))
    for mode in modes:
        parts.append(f"<h2>Per layer: {html.escape(mode)} against {html.escape(report['baseline'])}</h2>")
        layers = sorted(report["layers"], key=lambda x: -float(x["teacher_forced"][mode]["rel_rms"]))
        names = [x["name"] for x in layers]
        tf = [float(x["teacher_forced"][mode]["rel_rms"]) for x in layers]  # "inf" from json_safe too
        fr = [float(x["free_running"][mode]["rel_rms"]) for x in layers]
        fig, ax = plt.subplots(figsize=(9, 0.25 * len(names) + 1))
        y = np.arange(len(names))
        ax.barh(y - 0.2, tf, 0.4, label="teacher-forced")
        ax.barh(y + 0.2, fr, 0.4, label="free-running")
        ax.set_yticks(y, names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("relative RMS error (worst first)")
        ax.legend()
        parts.append(f'<img alt="relative RMS per layer, {html.escape(mode)}" src="{_png(fig)}">')
        fig, ax = plt.subplots(figsize=(6, 3))
        plotted = False
        for label, vals in (("teacher-forced", tf), ("free-running", fr)):
            logs = [math.log10(v) for v in vals if 0 < v < math.inf]
            if logs:
                ax.hist(logs, bins=20, alpha=0.6, label=label)
                plotted = True
        ax.set_xlabel("log10 relative RMS error")
        ax.set_ylabel("layers")
        if plotted:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "every layer bit-identical to the baseline", ha="center", transform=ax.transAxes)
        parts.append(f'<img alt="error histogram, {html.escape(mode)}" src="{_png(fig)}">')
        parts.append(_table(["layer", "rel. RMS (tf)", "max ULP (tf)", "SNR dB (tf)", "rel. RMS (fr)",
                             "codes differ (fr)"],
                            [[x["name"], x["teacher_forced"][mode]["rel_rms"], x["teacher_forced"][mode]["max_ulp"],
                              x["teacher_forced"][mode]["snr_db"], x["free_running"][mode]["rel_rms"],
                              x["free_running"][mode]["code_differ"]] for x in layers]))
    if ckpt is not None and len(ckpt):
        stats = scale_stats(ckpt)
        parts.append("<h2>Scales of the checkpoint</h2>")
        fig, ax = plt.subplots(figsize=(9, 0.25 * len(stats) + 1))
        y = np.arange(len(stats))
        lo, mid, hi = (np.log2([max(r[i], 2.0 ** -149) for r in stats]) for i in (2, 3, 4))
        ax.hlines(y, lo, hi)
        ax.plot(mid, y, "o")
        ax.set_yticks(y, [r[0] for r in stats], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("log2 weight scale (min, median, max)")
        parts.append(f'<img alt="weight scales per layer" src="{_png(fig)}">')
        parts.append(_table(["layer", "weight scale", "min", "median", "max", "input scale"], stats))
    plt.close("all")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>fp8ref compare</title>"
            f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n")
