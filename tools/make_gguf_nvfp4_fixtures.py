"""Write the GGUF NVFP4 fixtures with llama.cpp's own quantizer: tests/fixtures/gguf/{original_,}nvfp4.gguf,
and gguf-py's own dequantization of them: tests/fixtures/gguf/nvfp4_dequantized.gguf.

gguf 0.19.0 (gguf-py) dequantizes GGML_TYPE_NVFP4 but cannot quantize it (``gguf.quants.quantize``
raises NotImplementedError), so the blocks come from llama.cpp's C: this script takes the four
functions ``ggml_ue4m3_to_fp32``, ``ggml_fp32_to_ue4m3`` (ggml/src/ggml-impl.h),
``best_index_mxfp4`` and ``quantize_row_nvfp4_ref`` (ggml/src/ggml-quants.c), the ``block_nvfp4``
struct, the QK_NVFP4 defines and the ``kvalues_mxfp4`` table (ggml/src/ggml-common.h) out of a
llama.cpp checkout, compiles them as they are (cc -O2 -ffp-contract=off) and runs them through
ctypes. gguf 0.19.0's GGUFWriter writes the files (the blocks as raw NVFP4 bytes), and
``nvfp4_dequantized.gguf`` holds ``gguf.quants.dequantize`` of every NVFP4 tensor (F32, same name)
plus ``all_bytes.blocks`` (NVFP4 [1, 4096]: every scale byte once, the 16 codes under each)
and ``all_bytes.weight`` (gguf-py's dequantization of them: 0x7F, bytes >= 0x80 and code 0x8 pinned).

Run with the engines venv: /work/venvs/engines/bin/python tools/make_gguf_nvfp4_fixtures.py LLAMA_CPP_DIR
The weights hold the quantizer's edge cases: all-zero sub-blocks, exact ties of the scaled grid,
single outliers, scales in ggml's subnormal range (amax/6 < 2^-6, where (int)(x*512.0f + 0.5f)
rounds in float32), amax/6 in [240, 256) (the mantissa carry into exponent 15 -> 0x7E) and in
[256, 448] (all 0x7E), and amax/6 above 448 (clamped).
"""

import ctypes
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gguf"
FUNCTIONS = {"ggml-impl.h": ("ggml_ue4m3_to_fp32", "ggml_fp32_to_ue4m3"),
             "ggml-quants.c": ("best_index_mxfp4", "quantize_row_nvfp4_ref")}


def function(text: str, name: str) -> str:
    """The definition of C function ``name`` (signature line to its closing brace)."""
    m = re.search(r"^[^\n;{}]*\b" + name + r"\s*\([^;{]*\{", text, re.M)
    if m is None:
        sys.exit(f"no definition of {name} found")
    depth, i = 0, m.end() - 1
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
        if depth == 0:
            return text[m.start():i]


def define(text: str, name: str) -> str:
    return re.search(r"#define " + name + r"\s+(\d+)", text).group(1)


def c_source(src: Path) -> str:
    common = (src / "ggml-common.h").read_text()
    block = re.search(r"typedef struct \{[^}]*\} block_nvfp4;", common).group(0)
    defines = "".join(f"#define {n} {define(common, n)}\n" for n in ("QK_NVFP4", "QK_NVFP4_SUB"))
    table = re.search(r"GGML_TABLE_BEGIN\(int8_t, kvalues_mxfp4, 16\)(.*?)GGML_TABLE_END\(\)", common, re.S).group(1)
    parts = ["#include <assert.h>\n#include <math.h>\n#include <stdint.h>\n#include <string.h>\n"
             "#define GGML_RESTRICT\n", defines, block, "\n",
             f"static const int8_t kvalues_mxfp4[16] = {{{table.strip().rstrip(',')}}};\n"]
    for file, names in FUNCTIONS.items():
        text = (src / file).read_text()
        parts += [function(text, n) + "\n" for n in names]
    return "".join(parts)


def quantizer(src: Path):
    tmp = Path(tempfile.mkdtemp())
    (tmp / "nvfp4.c").write_text(c_source(src))
    subprocess.run(["cc", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(tmp / "nvfp4.so"),
                    str(tmp / "nvfp4.c"), "-lm"], check=True)
    lib = ctypes.CDLL(str(tmp / "nvfp4.so"))
    lib.quantize_row_nvfp4_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def quantize(w: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(w, np.float32).reshape(-1, w.shape[-1])
        out = np.zeros((rows.shape[0], w.shape[-1] // 64 * 36), np.uint8)
        for r in range(rows.shape[0]):
            lib.quantize_row_nvfp4_ref(rows[r].ctypes.data, out[r].ctypes.data, rows.shape[1])
        return out.reshape(*w.shape[:-1], -1)

    return quantize


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(40)
    w = {}
    for i in range(2):
        w[f"blk.{i}.attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
        w[f"blk.{i}.attn_q.weight"] = (0.05 * rng.standard_normal((16, 128))).astype(np.float32)
        w[f"blk.{i}.ffn_down.weight"] = (0.02 * rng.standard_normal((8, 192))).astype(np.float32)
    d = w["blk.0.attn_q.weight"]
    d[0, :16] = 0.0                                                          # an all-zero sub-block
    s = np.float32(1.5)                                                      # exact ties of d = s/2 ... x kvalues
    d[1, :16] = s * np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6] * 2, np.float32) * np.array([1, -1] * 8)
    d[2, :16] = 1e-4
    d[2, 5] = 3.0                                                            # a single outlier
    d[3, :16] = 6 * np.float32(2.0 ** -8) * np.linspace(0.1, 1, 16, dtype=np.float32)  # subnormal scales
    d[4, :16] = np.float32(6 * (0.5 - 2.0 ** -25) / 512)                     # x*512+0.5 rounds up in float32
    d[5, :16] = np.float32(6 * 250.0)                                        # carry into exponent 15 -> 0x7E
    d[6, :16] = np.float32(6 * 300.0) * np.linspace(0.5, 1, 16, dtype=np.float32)   # [256, 448] -> 0x7E
    d[7, :16] = np.float32(6 * 1000.0)                                       # clamped at 448
    d[8] = (rng.standard_normal(128) * 2.0 ** rng.integers(-12, 4, 128)).astype(np.float32)  # mixed magnitudes
    w["blk.0.ffn_down_exps.weight"] = (0.03 * rng.standard_normal((2, 16, 64))).astype(np.float32)
    return w


def write(path: Path, tensors: dict[str, np.ndarray], quantize=None) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("fp8ref-tiny-nvfp4")
    writer.add_block_count(2)
    for name, value in tensors.items():
        if quantize is not None and name.startswith("blk.") and value.ndim >= 2:
            q = quantize(value)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.NVFP4)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def all_bytes_blocks() -> np.ndarray:
    """64 NVFP4 blocks: block b has the scale bytes 4b..4b+3 and, under each, the codes 0..15."""
    qs = np.tile(np.arange(8, dtype=np.uint8) | (np.arange(8, 16, dtype=np.uint8) << 4), 4)
    return np.concatenate([np.arange(256, dtype=np.uint8).reshape(64, 4), np.tile(qs, (64, 1))], axis=1)


def write_dequantized(path: Path, quantized: Path) -> None:
    from gguf import GGUFReader, quants

    writer = GGUFWriter(str(path), "llama")
    for t in GGUFReader(str(quantized)).tensors:
        if t.tensor_type == GGMLQuantizationType.NVFP4:
            writer.add_tensor(t.name, quants.dequantize(np.asarray(t.data), GGMLQuantizationType.NVFP4))
    blocks = all_bytes_blocks()
    writer.add_tensor("all_bytes.blocks", blocks.reshape(1, -1), raw_shape=(1, blocks.size),
                      raw_dtype=GGMLQuantizationType.NVFP4)
    writer.add_tensor("all_bytes.weight", quants.dequantize(blocks.reshape(1, -1), GGMLQuantizationType.NVFP4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    OUT.mkdir(parents=True, exist_ok=True)
    w = weights()
    write(OUT / "original_nvfp4.gguf", w)
    write(OUT / "nvfp4.gguf", w, quantizer(Path(sys.argv[1]) / "ggml" / "src"))
    write_dequantized(OUT / "nvfp4_dequantized.gguf", OUT / "nvfp4.gguf")
    print(*(f"{p.name}: {p.stat().st_size} bytes" for p in sorted(OUT.glob("*nvfp4.gguf"))), sep="\n")
