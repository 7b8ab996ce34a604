"""The README's Python example runs as written, and its commented encode result is the real one."""

import re
from pathlib import Path

import numpy as np

from fp8ref import encode

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_example_runs(monkeypatch):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    monkeypatch.chdir(README.parent)  # the example loads a committed fixture by relative path
    exec(compile(block, str(README), "exec"), {})


def test_readme_encode_comment_is_true():
    text = README.read_text()
    claimed = re.search(r"# array\(\[(\d+), (\d+), (\d+)\], dtype=uint8\)", text).groups()
    got = encode(np.array([464.0, 464.0001, -431.99999999999994]), "float8_e4m3fn", saturate=False)
    assert [int(c) for c in claimed] == got.tolist() == [0x7E, 0x7F, 0xFD]
