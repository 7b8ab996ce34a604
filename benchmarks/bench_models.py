"""Whole models at real sizes: a Llama-shaped model (random bf16 weights written straight to
safetensors, never built in transformers) quantized FP8_DYNAMIC by fp8ref's own export, then each
fp8ref command run as its own process, its wall time and peak RSS measured, against a named peer
or limit measured in the same run.

    python benchmarks/bench_models.py [--shape 1b|3b|8b] [--workdir DIR] [--skip PART,...] [--keep]
                                      [--rounds N]

Parts (``--skip`` any of them):
* ``eval``: the whole ``fp8ref eval`` process in reference mode (exact accumulation) on --tokens
  (default 4x256) against a transformers float64 forward of the same tokens (the forward alone,
  in its own process; target <= 1.5x), and eval's peak RSS against checkpoint bytes + 1.5 GB.
  ``--rounds N`` runs the peer and eval in turn N times (peer, eval, peer, eval, ...) and reports
  the median of the N ratios with their min and max: a change in the machine's load between two
  processes moves one ratio, not the median. Each side's cores busy on average are printed (the
  peer's over its forward alone). Figures (docs/models.md, "At real sizes"): 1B, one round, 2.51x at
  load 2.5-4.3 and 0.92x at load 7-11 before the edge work of issue 21; after it 1.10x, 1.26x, 1.27x
  in three rounds at load 3.5-4.2 (at load 13-17 the peer got 0.09 cores and was stopped).
* ``decode``: one 1-token forward of the fp8ref model in reference mode (every linear at M = 1)
  against a transformers float64 forward of that token (best of --repeat; target <= 2x); the CPU time
  of the same steps too (the ratio a loaded machine moves least).
* ``compare``: ``fp8ref compare --original --modes reference,original`` peak RSS against checkpoint
  bytes + the largest layer's original bytes + 1.5 GB.
* ``verify``: the whole ``fp8ref verify --original`` process against reading every byte of both
  checkpoints' files (a process reading them into one 64 MiB buffer, timed from its first read; warm page
  cache), alternated --verify-repeat times: min and median of each, both ratios (target <= 1.5x), and
  the same ratios of the two processes' CPU time (verify's imports included, the reader's start too).
The float64 peer needs 8 bytes per parameter (10 GB at 1B): it is skipped (said so) when the
machine has less memory available than that plus 2 GB. Shapes: ``1b`` Llama-3.2-1B, ``3b``
Llama-3.2-3B, ``8b`` Llama-3.1-8B; at 3b and 8b the default parts are eval's memory only (the
peers would not fit), and a child is stopped when the machine's available memory drops under
--min-free GiB. The load average is printed with every figure: other work on the machine slows
both sides of a ratio, not always equally.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._util import READ_FILES as READ  # noqa: E402
from fp8ref.io.safetensors import SafetensorsWriter, TensorSpec  # noqa: E402

GB = 1e9
SHAPES = {  # Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B (their config.json's fields)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_factor=32.0),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_factor=32.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_factor=8.0),
}
PARTS = ("eval", "decode", "compare", "verify")
VOCAB = 128256


def config_of(shape: str) -> dict:
    s = dict(SHAPES[shape])
    factor = s.pop("rope_factor")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
            "bos_token_id": 128000, "eos_token_id": 128001, **s}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (VOCAB, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    return out


POOL = 1 << 25  # random bf16 values drawn once; each tensor is the pool repeated from its own random offset


def write_original(folder: Path, cfg: dict) -> None:
    """bf16 random weights (normal, std 0.02; norms 1) streamed tensor by tensor into one file:
    each tensor repeats a pool of 32 Mi normal values from a random offset (8B writes at disk speed)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    shapes = tensor_shapes(cfg)
    w = SafetensorsWriter(folder / "model.safetensors", [TensorSpec(n, "BF16", s) for n, s in shapes.items()])
    rng = np.random.default_rng(0)
    v = rng.standard_normal(POOL, dtype=np.float32) * np.float32(0.02)
    pool = (v.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16: any random bf16 will do
    del v
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            bits = np.full(shape, 0x3F80, np.uint16)  # 1.0
        else:
            bits = np.resize(np.roll(pool, int(rng.integers(POOL))), shape)
        w.write(name, bits)
        del bits
    w.close()


def prepare(work: Path, shape: str, tokens: str) -> dict:
    from fp8ref.checkpoint import export_checkpoint

    cfg = config_of(shape)
    orig, quant = work / "original", work / "fp8_dynamic"
    t0 = time.perf_counter()
    if not orig.exists():
        write_original(orig, cfg)
    t1 = time.perf_counter()
    if not quant.exists():
        ignore = [] if cfg["tie_word_embeddings"] else ["lm_head"]  # tied: the embedding is lm_head's weight
        export_checkpoint(orig, quant, {"name": "bench", "scheme": "FP8_DYNAMIC", "ignore": ignore})
    t2 = time.perf_counter()
    b, t = (int(x) for x in tokens.lower().split("x"))
    ids = np.random.default_rng(1).integers(0, VOCAB, (b, t))
    (work / "tokens.txt").write_text("\n".join(" ".join(map(str, row)) for row in ids) + "\n")
    print(f"prepared: original written {t1 - t0:.1f} s, fp8ref quantize (FP8_DYNAMIC) {t2 - t1:.1f} s")
    return {"orig": orig, "quant": quant, "tokens": work / "tokens.txt", "cfg": cfg}


def files_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(argv: list[str], min_free: float, what: str) -> dict:
    """Run a child to completion: wall seconds, peak RSS bytes, stdout; stopped (and said so) when
    the machine's available memory drops under min_free GiB."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    stopped = []

    def watch():
        while p.poll() is None:
            if available() < min_free * 2**30:
                stopped.append(available())
                p.kill()
                return
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if stopped:
        raise SystemExit(f"{what}: stopped: available memory {stopped[0] / 2**30:.1f} GiB < {min_free} GiB")
    if p.returncode not in (0, 1) or not out.strip():
        raise SystemExit(f"{what}: exit {p.returncode}\n{out}")
    cpu = usage.ru_utime + usage.ru_stime
    return {"wall": wall, "rss": usage.ru_maxrss * 1024, "out": out, "rc": p.returncode, "cpu": cpu,
            "cores": cpu / wall}


PEER = r"""
import json, sys, time
import numpy as np, torch, transformers
from fp8ref.io.safetensors import open_store
folder, tokens, repeat, full = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
cfg = json.load(open(folder + "/config.json"))
config = transformers.AutoConfig.for_model(**cfg)
from transformers.initialization import no_init_weights
with no_init_weights():  # transformers' own skipped initialisation
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
store = open_store(folder)
params = model.state_dict()
with torch.no_grad():
    for name in store:
        bits = store.file_of(name).read_bytes(name).view(np.int16).reshape(store.info(name).shape)
        params[name].copy_(torch.from_numpy(bits).view(torch.bfloat16))
        del bits
del params
model.eval()
ids = torch.tensor([[int(t) for t in line.split()] for line in open(tokens) if line.strip()])
with torch.no_grad():
    if full:
        c0, t0 = time.process_time(), time.perf_counter(); model(ids); full = time.perf_counter() - t0
        cores = (time.process_time() - c0) / full
    else:
        full = cores = None
    steps = [(lambda t0, c0: (model(ids[:1, :1]), time.perf_counter() - t0, time.process_time() - c0)[1:])(
        time.perf_counter(), time.process_time()) for _ in range(repeat)]
one, one_cpu = min(steps)
print(json.dumps({"forward": full, "cores": cores, "one_token": one, "one_token_cpu": one_cpu,
                  "threads": torch.get_num_threads()}))
"""

DECODE = r"""
import json, sys, time
import torch
from fp8ref.nn import build_model
ckpt, repeat = sys.argv[1], int(sys.argv[2])
model = build_model(ckpt, mode="reference")
ids = torch.tensor([[128000]])
with torch.no_grad():
    model(ids)  # first call: what is read once (pages of the file) is read here
    steps = [(lambda t0, c0: (model(ids), time.perf_counter() - t0, time.process_time() - c0)[1:])(
        time.perf_counter(), time.process_time()) for _ in range(repeat)]
one, one_cpu = min(steps)
print(json.dumps({"one_token": one, "one_token_cpu": one_cpu}))
"""


def ratio_line(name: str, value: float, limit: float, unit: str = "x", note: str = "") -> str:
    ok = "met" if value <= limit else "NOT met"
    return f"  {name:<46} {value:7.2f}{unit}  (target <= {limit:g}{unit}: {ok}){note}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--workdir", help="where the checkpoints go (default: a temporary folder, deleted unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (reused by a later run with --workdir)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip: {', '.join(PARTS)}")
    p.add_argument("--tokens", default="4x256", help="BxT token ids for eval (default 4x256)")
    p.add_argument("--compare-tokens", default="1x64", help="BxT token ids for compare (default 1x64)")
    p.add_argument("--repeat", type=int, default=3, help="1-token forwards timed (best of)")
    p.add_argument("--verify-repeat", type=int, default=5, help="verify and read runs, alternated (min, median)")
    p.add_argument("--rounds", type=int, default=1,
                   help="eval part: the float64 peer and eval run in turn this many times (the median ratio)")
    p.add_argument("--min-free", type=float, default=4.0, help="stop a child when available memory < this (GiB)")
    a = p.parse_args()
    skip = {s for s in a.skip.split(",") if s}
    if a.shape != "1b" and not a.skip:
        skip = {"decode", "compare", "verify"}
    unknown = skip - set(PARTS)
    if unknown:
        p.error(f"--skip: unknown parts {sorted(unknown)}; expected {', '.join(PARTS)}")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"bench_models: {a.shape} shape; CPU {cpu}, {os.cpu_count()} cores; python {platform.python_version()}; "
          f"{load()}")
    # fp8ref's bytecode compiled first, as an installed package's is: with PYTHONDONTWRITEBYTECODE set,
    # every child would otherwise compile its modules again (about 0.4 s of CPU each)
    compileall.compile_dir(ROOT / "fp8ref", quiet=1)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="fp8ref-bench-models-"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    try:
        paths = prepare(work, a.shape, a.tokens)
        ck_bytes, orig_bytes = files_bytes(paths["quant"]), files_bytes(paths["orig"])
        cfg = paths["cfg"]
        n_params = sum(int(np.prod(s)) for s in tensor_shapes(cfg).values())
        layer_orig = 2 * cfg["hidden_size"] * cfg["intermediate_size"]  # the largest linear's bf16 weight
        print(f"  {n_params / 1e9:.2f} B parameters; checkpoint {ck_bytes / GB:.2f} GB, "
              f"original {orig_bytes / GB:.2f} GB")
        lines = []
        peer = None
        peer_ok = a.shape == "1b" and available() >= 8 * n_params + 2 * 2**30
        if {"eval", "decode"} - skip and a.shape == "1b" and not peer_ok:
            print(f"  float64 peer skipped: {available() / 2**30:.1f} GiB available, "
                  f"needs {(8 * n_params + 2 * 2**30) / 2**30:.1f}")

        def run_peer(full: bool) -> dict:
            r = run([py, "-c", PEER, str(paths["orig"]), str(paths["tokens"]), str(a.repeat), str(int(full))],
                    a.min_free, "float64 peer")
            out = json.loads(r["out"].strip().splitlines()[-1])
            fwd = (f"forward of {a.tokens} {out['forward']:.2f} s ({out['cores']:.2f} cores busy on average), "
                   if out["forward"] is not None else "")
            print(f"  transformers float64: {fwd}one token {out['one_token'] * 1e3:.1f} ms "
                  f"({out['one_token_cpu'] * 1e3:.1f} ms CPU; {out['threads']} threads; {load()})")
            return out

        if "eval" not in skip:
            ratios, rss = [], []
            for n in range(a.rounds):  # peer, eval, peer, eval, ...: a drift in the load hits both sides
                if peer_ok:
                    peer = run_peer(True)
                r = run([py, "-m", "fp8ref", "eval", str(paths["quant"]), "--mode", "reference", "--tokens",
                         str(paths["tokens"]), "--batch", "64", "--no-progress"], a.min_free, "eval")
                rss.append(r["rss"])
                print(f"  fp8ref eval (whole process, reference mode, {a.tokens}): {r['wall']:.2f} s, peak RSS "
                      f"{r['rss'] / GB:.2f} GB, {r['cores']:.2f} cores busy on average ({load()})")
                if peer is not None:
                    ratios.append(r["wall"] / peer["forward"])
                    print(f"  round {n + 1}: eval / float64 forward {ratios[-1]:.2f}x")
            if ratios:
                rs = sorted(ratios)
                lines.append(ratio_line("eval time / transformers float64 forward", statistics.median(rs), 1.5,
                                        note=f"  [median of {len(rs)} rounds; min {rs[0]:.2f}x, max {rs[-1]:.2f}x]"))
            top = max(rss)
            lines.append(ratio_line("eval peak RSS / (checkpoint + 1.5 GB)", top / (ck_bytes + 1.5 * GB), 1.0,
                                    note=f"  [{top / GB:.2f} GB vs {(ck_bytes + 1.5 * GB) / GB:.2f} GB]"))
        if "decode" not in skip and peer is None and peer_ok:
            peer = run_peer(False)
        if "decode" not in skip:
            r = run([py, "-c", DECODE, str(paths["quant"]), str(a.repeat)], a.min_free, "decode")
            step = json.loads(r["out"].strip().splitlines()[-1])
            one = step["one_token"]
            print(f"  fp8ref reference 1-token forward: {one * 1e3:.1f} ms ({step['one_token_cpu'] * 1e3:.1f} ms CPU), "
                  f"peak RSS {r['rss'] / GB:.2f} GB ({load()})")
            if peer is not None:
                lines.append(ratio_line("1-token step / transformers float64 1-token", one / peer["one_token"], 2.0))
                lines.append(ratio_line("  the same in CPU time", step["one_token_cpu"] / peer["one_token_cpu"], 2.0))
        if "compare" not in skip:
            r = run([py, "-m", "fp8ref", "compare", str(paths["quant"]), "--original", str(paths["orig"]),
                     "--modes", "reference,original", "--random", a.compare_tokens, "--no-progress"],
                    a.min_free, "compare")
            limit = ck_bytes + layer_orig + 1.5 * GB
            print(f"  fp8ref compare --original ({a.compare_tokens}): {r['wall']:.2f} s, "
                  f"peak RSS {r['rss'] / GB:.2f} GB "
                  f"({load()})")
            lines.append(ratio_line("compare peak RSS / (ckpt + layer orig + 1.5 GB)", r["rss"] / limit, 1.0,
                                    note=f"  [{r['rss'] / GB:.2f} GB vs {limit / GB:.2f} GB]"))
        if "verify" not in skip:
            files = [str(f) for d in (paths["quant"], paths["orig"]) for f in sorted(d.glob("*.safetensors"))]
            run([py, "-c", READ, *files], a.min_free, "read")  # the page cache warmed for both sides
            reads, walls, rss, codes, cpus, read_cpus = [], [], 0, set(), [], []
            for i in range(a.verify_repeat):
                reader = run([py, "-c", READ, *files], a.min_free, "read")
                reads.append(float(reader["out"].strip()))
                r = run([py, "-m", "fp8ref", "verify", str(paths["quant"]), "--original", str(paths["orig"]),
                         "--no-progress"], a.min_free, "verify")
                walls.append(r["wall"])
                cpus.append(r["cpu"])
                read_cpus.append(reader["cpu"])
                rss, codes = max(rss, r["rss"]), codes | {r["rc"]}
                print(f"  verify run {i + 1}: {r['wall']:.2f} s ({r['cpu']:.2f} s CPU), reading both files "
                      f"{reads[-1]:.2f} s (its process {reader['cpu']:.2f} s CPU) ({load()})")
            print(f"  fp8ref verify ({len(walls)} runs, exit {sorted(codes)}): min {min(walls):.2f} s, median "
                  f"{np.median(walls):.2f} s; reading both files ({(ck_bytes + orig_bytes) / GB:.2f} GB): min "
                  f"{min(reads):.2f} s, median {np.median(reads):.2f} s; verify peak RSS {rss / GB:.2f} GB")
            lines.append(ratio_line("verify time / reading both files (min / min)", min(walls) / min(reads), 1.5))
            lines.append(ratio_line("verify time / reading both files (median / median)",
                                    float(np.median(walls) / np.median(reads)), 1.5))
            lines.append(ratio_line("  in CPU time, whole processes (min / min)", min(cpus) / min(read_cpus), 1.5))
            lines.append(ratio_line("  in CPU time, whole processes (median / median)",
                                    float(np.median(cpus) / np.median(read_cpus)), 1.5))
        print("ratios:")
        print("\n".join(lines))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
