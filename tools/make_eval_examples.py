"""Write specs/examples/eval/: the tiny lm-eval tasks and BPE tokenizer the README's evaluation recipe
uses with the committed llmc_fp8 checkpoint (its vocabulary: 128 ids; the tokenizer has 120). Data and
tokenizer are generated in code (tests/support/eval_examples.py, tests/support/tokenizers_fixture.py),
the same ones the lm-eval tests build; tests/unit/nn/test_eval_examples.py checks the committed files
still equal what this writes.

    PYTHONPATH=. python tools/make_eval_examples.py [OUT]   (default specs/examples/eval; needs `tokenizers`)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.eval_examples import write_tasks  # noqa: E402
from tests.support.tokenizers_fixture import save_tokenizer  # noqa: E402

DEST = "specs/examples/eval"


def main(out: str = DEST) -> None:
    folder = Path(out)
    write_tasks(folder, data_prefix=DEST)
    save_tokenizer(folder / "tokenizer")
    print(f"wrote {folder}: {', '.join(sorted(p.name for p in folder.rglob('*') if p.is_file()))}")


if __name__ == "__main__":
    main(*sys.argv[1:])
