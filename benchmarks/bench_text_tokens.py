"""Memory of ``--text FILE`` token ids: fp8ref's reader against the list-based reader it replaced
(``torch.tensor(list(Path(FILE).read_bytes()), dtype=torch.long) % vocab``), same file, same run.

Each reader runs in a fresh subprocess, so its peak RSS is its own; prints the peak RSS rise per
byte of text for both, and their ratio (the limit for fp8ref's: 1 byte per byte, plus slack).

Usage: python benchmarks/bench_text_tokens.py [--mb 100] [--vocab 128] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
sys.path.insert(0, {bench!r})
import torch
from _util import peak_extra_rss
from fp8ref.nn.tokens import text_tokens

path, vocab, which = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kept = []

def list_based():  # the reader before issue #25
    data = Path(path).read_bytes()
    ids = torch.tensor(list(data), dtype=torch.long) % vocab
    kept.append(ids[: len(ids) // 128 * 128].reshape(-1, 128))

def fp8ref_reader():
    kept.append(text_tokens(path, vocab, 128))

print(json.dumps(peak_extra_rss(list_based if which == "list" else fp8ref_reader)))
"""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def peak(path: Path, vocab: int, which: str) -> int:
    code = CHILD.format(root=str(ROOT), bench=str(ROOT / "benchmarks"))
    out = subprocess.run([sys.executable, "-c", code, str(path), str(vocab), which], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=100.0, help="text size in MB (default 100)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dir", help="folder for the text file (default: a temporary folder)")
    args = p.parse_args()
    print(f"# bench_text_tokens: {cpu_model()}, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "text.txt"
        size = int(args.mb * 1e6)
        line = b"The quick brown fox jumps over the lazy dog. 0123456789\n"
        with open(path, "wb") as f:
            for _ in range(size // len(line)):
                f.write(line)
            f.write(line[: size % len(line)])
        new = peak(path, args.vocab, "fp8ref")
        old = peak(path, args.vocab, "list")
    print(f"text {size} bytes, vocab {args.vocab}")
    print(f"  list-based (torch.tensor(list(bytes))): peak RSS +{old / 1e6:.0f} MB = {old / size:.2f} bytes per byte")
    print(f"  fp8ref text_tokens (uint8, streamed):   peak RSS +{new / 1e6:.0f} MB = {new / size:.2f} bytes per byte")
    print(f"  ratio list-based / fp8ref: {old / max(new, 1):.1f}x; limit for fp8ref: 1.1 bytes per byte: "
          f"{'met' if new <= 1.1 * size else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
