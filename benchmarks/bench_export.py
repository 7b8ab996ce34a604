"""Export speed and memory against a plain safetensors load+save of the same data (same run).

Builds a synthetic bf16 checkpoint of many DIM x DIM linears (default 1 GB of 4096 x 4096),
then, each in a fresh subprocess so peak RSS is its own:

* peer:   safetensors.torch.load_file + save_file (the cost of touching every byte once);
* export: fp8ref.checkpoint.export_checkpoint with one scheme for every layer.

Prints the throughput ratio export/peer (target >= 0.5), export peak RSS against
3 x the largest tensor + 200 MB, and the bytes of tensor data read when loading a sharded
checkpoint's headers (target 0) and when validating its scales too.

Usage: python benchmarks/bench_export.py [--gb 1.0] [--dim 4096] [--scheme FP8_DYNAMIC]
       [--format compressed-tensors] [--repeat 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8ref.io.safetensors import SafetensorsWriter, TensorSpec  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
mode, src, dst = sys.argv[1:4]
t = time.perf_counter()
if mode == "peer":
    from safetensors.torch import load_file, save_file
    save_file(load_file(src + "/model.safetensors"), dst)
else:
    from fp8ref.checkpoint.export import export_checkpoint
    from fp8ref.io.safetensors import open_store
    amax = {{n.removesuffix(".weight"): 4.0 for n in open_store(src)}}  # for static-input schemes
    export_checkpoint(src, dst, {{"scheme": sys.argv[4]}}, format=sys.argv[5], calibration=amax)
elapsed = time.perf_counter() - t
# VmHWM: this process image's own peak RSS (ru_maxrss would include the parent's, kept across exec)
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({{"seconds": elapsed, "peak_rss": hwm}}))
"""


def make_source(folder: Path, gb: float, dim: int, shards: int = 1) -> tuple[int, int]:
    """Write ``gb`` GB of bf16 DIM x DIM weights in ``shards`` files; returns (bytes, largest tensor)."""
    folder.mkdir(parents=True)
    per = dim * dim * 2
    n = max(1, round(gb * 1e9 / per))
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(n)]
    rng = np.random.default_rng(0)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        w = SafetensorsWriter(folder / fname, [TensorSpec(nm, "BF16", (dim, dim)) for nm in part], {"format": "pt"})
        for nm in part:
            w.write(nm, (rng.standard_normal((dim, dim), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16))
        w.close()
        weight_map.update(dict.fromkeys(part, fname))
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": n * per}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    return n * per, per


def run_child(mode: str, src: Path, dst: Path, scheme: str, fmt: str) -> dict:
    code = CHILD.format(root=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code, mode, str(src), str(dst), scheme, fmt],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def clear(path: Path) -> None:
    if path.is_dir():
        for p in path.iterdir():
            p.unlink()
        path.rmdir()
    elif path.exists():
        path.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--scheme", default="FP8_DYNAMIC")
    ap.add_argument("--format", default="compressed-tensors")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        tmp = Path(tmp)
        total, largest = make_source(tmp / "src", a.gb, a.dim)
        with open(tmp / "src" / "model.safetensors", "rb") as f:  # warm the page cache for both contenders
            while f.read(1 << 24):
                pass
        peer, export = [], []
        for _ in range(a.repeat):
            peer.append(run_child("peer", tmp / "src", tmp / "peer.safetensors", a.scheme, a.format))
            clear(tmp / "peer.safetensors")
            export.append(run_child("export", tmp / "src", tmp / "out", a.scheme, a.format))
            clear(tmp / "out")
        tp, te = min(r["seconds"] for r in peer), min(r["seconds"] for r in export)
        rss = max(r["peak_rss"] for r in export)
        limit = 3 * largest + 200e6
        print(f"data: {total / 1e9:.2f} GB bf16, {total // largest} tensors of {a.dim}x{a.dim}; "
              f"scheme {a.scheme}, format {a.format}")
        print(f"peer  safetensors load+save: {tp:.2f} s  ({total / tp / 1e9:.2f} GB/s), "
              f"peak RSS {max(r['peak_rss'] for r in peer) / 1e6:.0f} MB")
        print(f"fp8ref export_checkpoint:    {te:.2f} s  ({total / te / 1e9:.2f} GB/s), peak RSS {rss / 1e6:.0f} MB")
        print(f"throughput ratio export/peer: {tp / te:.2f}  (target >= 0.5)")
        print(f"export peak RSS / (3 x largest tensor + 200 MB): {rss / limit:.2f}  (target <= 1)")

        from fp8ref.checkpoint import load_checkpoint
        from fp8ref.checkpoint.export import export_checkpoint
        make_source(tmp / "sharded_src", min(a.gb, 0.25), a.dim, shards=4)
        amax = {f"model.layers.{i}.mlp.up_proj": 4.0 for i in range(1000)}
        export_checkpoint(tmp / "sharded_src", tmp / "sharded", {"scheme": a.scheme}, format=a.format,
                          calibration=amax)
        headers = load_checkpoint(tmp / "sharded", check_values=False)
        scales = load_checkpoint(tmp / "sharded")
        data = sum(f.info(n).nbytes for f in scales.store.files.values() for n in f.tensors)
        print(f"sharded load, headers only: {headers.store.bytes_read} tensor bytes read of {data} (target 0)")
        print(f"sharded load with scale checks: {scales.store.bytes_read} tensor bytes read "
              f"({scales.store.bytes_read / data:.2e} of the data)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
