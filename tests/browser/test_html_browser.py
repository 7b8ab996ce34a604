"""The ``compare --html`` page in a real headless browser (Debian's chromium; tox -e browser): it
renders, every image decodes, and nothing reaches the console. A probe script is appended to a
copy of the page (the page itself has none) and reports through document.title; a broken page is
the control that shows the probe and the console check can fail."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("needs chromium (Debian: apt-get install chromium)", allow_module_level=True)
pytest.importorskip("matplotlib")
torch = pytest.importorskip("torch")

PROBE = ("<script>window.addEventListener('load',()=>{const im=[...document.images];document.title="
         "'IMAGES '+im.length+' OK '+im.filter(i=>i.complete&&i.naturalWidth>0).length;});</script>")


def _open(page: str, tmp_path: Path) -> tuple[str, list[str]]:
    """(document.title after load, console lines) of ``page`` + the probe."""
    f = tmp_path / "page.html"
    f.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    run = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                          "--v=0", "--virtual-time-budget=5000", "--dump-dom", f.as_uri()],
                         capture_output=True, text=True, timeout=120)
    title = re.search(r"<title>([^<]*)</title>", run.stdout)
    return (title.group(1) if title else ""), [ln for ln in run.stderr.splitlines() if ":CONSOLE" in ln]


def _report_page() -> str:
    import fp8ref
    from fp8ref.nn import load_unquantized, swap_linears
    from fp8ref.nn.compare import compare
    from fp8ref.nn.html import render
    from fp8ref.nn.metrics import json_safe
    from tests.support.tiny_llama import TinyLlama

    ckpt = fp8ref.load_checkpoint(Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
                                  / "llmc_fp8")
    model = TinyLlama(torch.bfloat16)
    swap_linears(model, ckpt)
    load_unquantized(model, ckpt)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    r = compare(model, ids, ["reference", "reference:fp32", "producer"], with_perplexity=True)
    return render(json_safe({"checkpoint": str(ckpt.path), "format": ckpt.format, "input": "ids", **r}), ckpt)


def test_report_renders_with_every_image_and_a_silent_console(tmp_path):
    page = _report_page()
    n = page.count("<img")
    assert n == 2 * 2 + 1
    title, console = _open(page, tmp_path)
    assert title == f"IMAGES {n} OK {n}" and console == []


def test_the_probe_sees_a_broken_image_and_a_console_message(tmp_path):
    page = ('<!DOCTYPE html><html><head><title>x</title></head><body><img src="data:image/png;base64,AAAA">'
            '<script>console.error("boom")</script></body></html>')
    title, console = _open(page, tmp_path)
    assert title == "IMAGES 1 OK 0" and len(console) == 1 and '"boom"' in console[0]
