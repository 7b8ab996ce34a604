"""``fp8ref verify`` and ``fp8ref inspect --original`` with ``--executor ray`` against the local run
(same run, same checkpoint, every command a process of its own).

Builds an original of LAYERS bf16 DIM x DIM linears (default 16 x 2048 x 4096, random), exports it
FP8_DYNAMIC with fp8ref, warms the page cache, then times, alternated --repeat times:

* read:  reading every byte of both checkpoints' files (the floor; timed from its first read);
* local: ``fp8ref verify CKPT --original SRC`` and ``fp8ref inspect CKPT --original SRC``, whole processes;
* ray:   the same with ``--executor ray`` on a cluster this script starts first (RAY_ADDRESS: the
  children connect to it, as to any running cluster), and once on a cluster each command starts
  itself (no RAY_ADDRESS: what a first ``--executor ray`` costs).

Checks that each ray run's JSON equals the local run's byte for byte, and prints the CPU model, the
load average, min and median of each and the ratios ray / local and local verify / read.
Needs ray (``pip install 'fp8ref[ray]'``; here: ``/work/venvs/ray/bin/python benchmarks/bench_verify.py``).

Usage: python benchmarks/bench_verify.py [--layers 16] [--rows 2048] [--cols 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._util import READ_FILES as READ  # noqa: E402
from benchmarks._util import cpu_model  # noqa: E402
from fp8ref.io.safetensors import SafetensorsWriter, TensorSpec  # noqa: E402


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def write_original(folder: Path, layers: int, rows: int, cols: int) -> None:
    """bf16 normal weights (std 0.02), one [rows, cols] down_proj per layer, streamed into one file."""
    folder.mkdir()
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(layers)]
    w = SafetensorsWriter(folder / "model.safetensors", [TensorSpec(n, "BF16", (rows, cols)) for n in names])
    rng = np.random.default_rng(0)
    for n in names:
        v = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        w.write(n, (v.view(np.uint32) >> 16).astype(np.uint16))  # truncated to bf16
    w.close()


def timed(argv: list[str], env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv[:4])}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return wall, p.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        import ray
    except ImportError:
        raise SystemExit("bench_verify needs ray: pip install 'fp8ref[ray]'") from None
    import fp8ref

    print(f"bench_verify: CPU {cpu_model()}, {os.cpu_count()} cores; python {platform.python_version()}, "
          f"ray {ray.__version__}; {args.layers} layers of [{args.rows}, {args.cols}] bf16, FP8_DYNAMIC; {load()}")
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="fp8ref-bench-verify-") as tmp:
        tmp = Path(tmp)
        write_original(tmp / "orig", args.layers, args.rows, args.cols)
        fp8ref.export_checkpoint(tmp / "orig", tmp / "q", {"scheme": "FP8_DYNAMIC"})
        files = [str(tmp / d / "model.safetensors") for d in ("q", "orig")]
        size = sum(os.path.getsize(f) for f in files)
        timed([py, "-c", READ, *files])  # warm the page cache
        commands = {"verify": ["verify", str(tmp / "q"), "--original", str(tmp / "orig"), "--no-progress"],
                    "inspect": ["inspect", str(tmp / "q"), "--original", str(tmp / "orig")]}
        ctx = ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                       configure_logging=False)
        cluster = {**os.environ, "RAY_ADDRESS": ctx.address_info["gcs_address"]}
        times: dict[str, list[float]] = {}
        try:
            for i in range(args.repeat):
                times.setdefault("read", []).append(float(timed([py, "-c", READ, *files])[1].strip()))
                for cmd, rest in commands.items():
                    t_local, local = timed([py, "-m", "fp8ref", *rest, "--json", "-"])
                    t_ray, remote = timed([py, "-m", "fp8ref", *rest, "--executor", "ray", "--json", "-"], cluster)
                    if remote != local:
                        raise SystemExit(f"{cmd} --executor ray: the JSON differs from the local run's")
                    times.setdefault(f"{cmd} local", []).append(t_local)
                    times.setdefault(f"{cmd} ray", []).append(t_ray)
                print(f"  run {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()) + f" ({load()})")
        finally:
            ray.shutdown()
        for cmd, rest in commands.items():  # a cluster the command starts itself, once
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            times[f"{cmd} ray, own cluster"] = [timed([py, "-m", "fp8ref", *rest, "--executor", "ray", "--json", "-"],
                                                      env)[0]]
    print(f"reading both files: {size / 1e9:.2f} GB; ray JSON byte-identical to local in every run")
    for k, v in times.items():
        print(f"  {k:<26} min {min(v):7.2f} s   median {statistics.median(v):7.2f} s   ({len(v)} runs)")
    print("ratios (min / min, median / median):")
    for num, den in (("verify local", "read"), ("verify ray", "verify local"), ("inspect ray", "inspect local"),
                     ("verify ray, own cluster", "verify local"), ("inspect ray, own cluster", "inspect local")):
        a, b = times[num], times[den]
        print(f"  {num} / {den}: {min(a) / min(b):.2f}x, {statistics.median(a) / statistics.median(b):.2f}x")
    print(load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
