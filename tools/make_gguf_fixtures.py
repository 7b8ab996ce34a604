"""Write the GGUF fixtures with llama.cpp's own Python package (gguf 0.19.0's GGUFWriter and its
MXFP4 quantizer ``gguf.quants.quantize``): tests/fixtures/gguf/{original,mxfp4}.gguf.

Run with the engines venv: /work/venvs/engines/bin/python tools/make_gguf_fixtures.py
``original.gguf`` holds float32 weights in llama.cpp's tensor names; ``mxfp4.gguf`` the same model
with every 2-D ``blk.*`` weight and the 3-D experts quantized to GGML_TYPE_MXFP4 by gguf, the norms
kept F32. The weights include exact ties (0.75, 3.5 times the block scale), all-zero blocks,
single outliers and amax values just below a power of two (where float32 log2f rounds up).
"""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gguf"


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(23)
    w = {}
    for i in range(2):
        w[f"blk.{i}.attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
        w[f"blk.{i}.attn_q.weight"] = (0.05 * rng.standard_normal((64, 64))).astype(np.float32)
        w[f"blk.{i}.ffn_down.weight"] = (0.02 * rng.standard_normal((64, 128))).astype(np.float32)
    d = w["blk.0.attn_q.weight"]
    d[0, :32] = 0.0                                               # an all-zero block
    d[1, :32] = np.float32(0.25) * np.array([0.75, 3.5, -0.75, -3.5, 1.25, -2.5, 5, -5] * 4, np.float32)  # ties
    d[1, 7] = np.float32(0.25) * 6
    d[2, :32] = 1e-4
    d[2, 5] = 3.0                                                 # a single outlier
    d[3, :32] = np.float32(np.nextafter(np.float32(0.125), np.float32(0)))  # log2f rounds up to -3
    d[4, :32] = np.float32(0.0625) * np.float32(1 - 2 ** -24)
    w["blk.0.ffn_down_exps.weight"] = (0.03 * rng.standard_normal((2, 64, 64))).astype(np.float32)
    return w


def write(path: Path, tensors: dict[str, np.ndarray], quantize: bool) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("fp8ref-tiny")
    writer.add_block_count(2)
    for name, value in tensors.items():
        if quantize and name.startswith("blk.") and value.ndim >= 2:
            q = quants.quantize(value, GGMLQuantizationType.MXFP4)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    w = weights()
    write(OUT / "original.gguf", w, quantize=False)
    write(OUT / "mxfp4.gguf", w, quantize=True)
    print(*(f"{p.name}: {p.stat().st_size} bytes" for p in sorted(OUT.glob("*.gguf"))), sep="\n")
