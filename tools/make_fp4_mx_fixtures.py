"""Write the FP4, MX and vendor FP8 checkpoint fixtures (NVFP4, MX, ModelOpt, Quark) with the REAL tools, on CPU.

Each tool lives in its own venv (see tools/README.md), so this script runs once per tool:

  --tool llmc      (/work/venvs/interop)   llm-compressor oneshot: NVFP4, NVFP4A16, MXFP4, MXFP8
  --tool modelopt  (/work/venvs/modelopt)  nvidia-modelopt mtq.quantize + export_hf_checkpoint
  --tool quark     (/work/venvs/quark)     amd-quark ModelQuantizer + export_safetensors

Every run builds the same tiny one-layer Llama from fixed seeds, independent of the transformers
version (all parameters are overwritten from our own generator), and writes
tests/fixtures/interop/checkpoints/<name>/: the tool's config/safetensors files, fixture.json (how,
versions, loader findings) and reference_outputs.safetensors (`original.<linear>` bf16 weights,
`<probe>.x` inputs, `<probe>.y` the tool's reloaded layer outputs, `<probe>.y_in_memory` and
`<probe>.qdq_in_memory` the tool's in-memory fake-quant results before export).

Usage: <venv>/bin/python tools/make_fp4_mx_fixtures.py --tool llmc|modelopt|quark [--only NAME ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_interop_fixtures as mif  # noqa: E402  (shared: describe, calib_batches, tokenizer, reload)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "interop" / "checkpoints"
MODEL = dict(mif.LLAMA, num_hidden_layers=1)
LAYER = "model.layers.0."
LINEARS = tuple(LAYER + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
PROBES = (LAYER + "self_attn.q_proj", LAYER + "self_attn.k_proj", LAYER + "mlp.down_proj")
COMMON_TOOLS = ("torch", "transformers", "accelerate", "safetensors")
TOOL_VERSIONS = {"llmc": ("compressed-tensors", "llmcompressor"), "modelopt": ("nvidia-modelopt",),
                 "quark": ("amd-quark",)}
PLANTED = {
    "zeros": "8 exact 0.0, 8 exact -0.0 and 8 1e-7 entries in every linear weight (seed 4321)",
    "down_proj_row3": "model.layers.0.mlp.down_proj.weight[3] all zero (8 zero NVFP4 blocks, 4 zero MX blocks)",
    "q_proj_outlier": "model.layers.0.self_attn.q_proj.weight[0, 0] = 16 x the q_proj amax (fused global scales)",
    "k_proj_tiny_block": "model.layers.0.self_attn.k_proj.weight[5, 16:32] scaled by 1e-4 (block scale underflow)",
}


def versions(tool: str) -> dict[str, str]:
    out = {}
    for name in COMMON_TOOLS + TOOL_VERSIONS[tool]:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


# ----------------------------------------------------------------------------------------------
# the model (same bytes in every venv)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(**MODEL, dtype="bfloat16")


def original_weights() -> dict[str, torch.Tensor]:
    """All parameters from our own generator (transformers' init differs between versions)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(_config()).named_parameters()}
    g = torch.Generator().manual_seed(4321)
    sd = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:  # norms
            w = torch.ones(shape)
        elif "embed" in name:
            w = torch.randn(shape, generator=g) * 0.5
        else:  # heavy tails, plus planted zeros, -0.0 and tiny values
            w = torch.randn(shape, generator=g) * 0.05 * torch.exp(0.8 * torch.randn(shape, generator=g))
            flat = w.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[:24]
            flat[idx[:8]] = 0.0
            flat[idx[8:16]] = -0.0
            flat[idx[16:]] = 1e-7
        sd[name] = w
    sd[LAYER + "mlp.down_proj.weight"][3] = 0.0
    q = sd[LAYER + "self_attn.q_proj.weight"]
    q[0, 0] = 16 * q.abs().max()
    sd[LAYER + "self_attn.k_proj.weight"][5, 16:32] *= 1e-4
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}


def tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(1234)
    model = LlamaForCausalLM(_config()).to(torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict(original_weights(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: {missing} {unexpected}")
    return model


def saved_tiny_llama(folder: Path):
    """Saved and reloaded (llm-compressor re-reads name_or_path; ModelOpt/Quark export need a config)."""
    from transformers import AutoModelForCausalLM

    tiny_llama().save_pretrained(str(folder))
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()


def probe_inputs() -> dict[str, torch.Tensor]:
    return mif.probe_inputs(PROBES)


def run_probes(model, suffix: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Each probe Linear of an in-memory (fake-quant) model on its fixed input."""
    out, desc = {}, {}
    with torch.no_grad():
        for name, x in probe_inputs().items():
            mod = model.get_submodule(name)
            d = desc[name] = {"module_class": f"{type(mod).__module__}.{type(mod).__name__}"}
            try:
                out[f"{name}.{suffix}"] = mod(x).detach().clone()
            except Exception as e:  # the tool refusing CPU tensors is a finding
                d["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out, desc


def calib_loop(model) -> None:
    with torch.no_grad():
        for ids in mif.calib_batches():
            model(ids)


# ----------------------------------------------------------------------------------------------
# writing a fixture


def write_fixture(dest: Path, export: Path, meta: dict, refs: dict[str, torch.Tensor], vers: dict) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    kept = []
    for f in sorted(export.iterdir()):
        if f.suffix in (".json", ".safetensors") and not f.name.startswith(("tokenizer", "generation")):
            shutil.copy2(f, dest / f.name)
            kept.append(f.name)
    meta["files_written_by_tool"] = sorted(p.name for p in export.iterdir())
    meta["files_kept"] = kept
    orig = original_weights()
    refs = {**{f"original.{k}": orig[k + ".weight"] for k in LINEARS}, **refs}
    save_file({k: v.contiguous().clone() for k, v in sorted(refs.items())}, str(dest / "reference_outputs.safetensors"))
    meta["reference_tensors"] = mif.describe(refs)
    meta["versions"] = vers
    meta["model"] = {"class": "LlamaForCausalLM", "config": MODEL, "dtype": "bfloat16",
                     "weights": "tools/make_fp4_mx_fixtures.py:original_weights (seed 4321)", "planted": PLANTED}
    meta["probe_inputs"] = "bf16 [1,4,in_features], make_interop_fixtures.probe_inputs(PROBES) (seed 99)"
    (dest / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=True, default=str) + "\n")
    size = sum(p.stat().st_size for p in dest.iterdir())
    print(f"wrote {dest.name}: {sorted(p.name for p in dest.iterdir())} ({size} bytes)", flush=True)


def run_jobs(jobs: dict, out: Path, vers: dict, only: list[str] | None) -> int:
    failed = 0
    for name, job in jobs.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as work:
            try:
                export, meta, refs = job(Path(work))
            except Exception as e:  # record and go on: a tool failing on CPU is a finding
                failed += 1
                print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
                continue
            write_fixture(out / name, export, meta, refs, vers)
    return failed


# ----------------------------------------------------------------------------------------------
# llm-compressor / compressed-tensors


def llmc_job(preset: str):
    def job(work: Path):
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier

        model = saved_tiny_llama(work / "base")
        ids = [b[0].tolist() for b in mif.calib_batches()]
        ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
        recipe = QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"])
        oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=len(ids),
                max_seq_length=len(ids[0]), processor=mif.tiny_tokenizer())
        refs, in_mem = run_probes(model, "y_in_memory")
        # the in-memory weight QDQ and qparams of every quantized linear, before compression
        qparams = {}
        for lin in LINEARS:
            mod = model.get_submodule(lin)
            args = mod.quantization_scheme.weights
            ps = {n: getattr(mod, f"weight_{n}") for n in ("scale", "zero_point", "global_scale")
                  if hasattr(mod, f"weight_{n}")}
            qparams[lin] = {n: {"dtype": str(p.dtype), "shape": list(p.shape)} for n, p in ps.items()}
            with torch.no_grad():
                qdq = fake_quantize(mod.weight, ps["scale"], ps.get("zero_point"), args,
                                    global_scale=ps.get("global_scale"))
            if lin in PROBES[:2]:  # two layers only (size budget)
                refs[f"{lin}.qdq_in_memory"] = qdq
            for n, p in ps.items():
                refs[f"{lin}.in_memory_weight_{n}"] = p.detach().clone()
            if hasattr(mod, "input_global_scale"):
                refs[f"{lin}.in_memory_input_global_scale"] = mod.input_global_scale.detach().clone()
        export = work / "export"
        model.save_pretrained(str(export), save_compressed=True)
        recipe_text = f"QuantizationModifier(targets='Linear', scheme='{preset}', ignore=['lm_head'])"
        meta = {"tool": "llmcompressor",
                "function": "llmcompressor.oneshot + model.save_pretrained(save_compressed=True)",
                "arguments": {"recipe": recipe_text,
                              "calibration": "4 random token batches of 16 tokens (seed 77), datasets.Dataset"},
                "in_memory": {"layers": in_mem, "weight_qparams": qparams,
                              "qdq_in_memory": "compressed_tensors.quantization.lifecycle.forward.fake_quantize("
                                               "weight, weight_scale, weight_zero_point, args, weight_global_scale)"}}
        try:
            ys, desc = mif.reload_outputs(export, PROBES)
            refs.update(ys)
            meta["reference_outputs"] = {
                "loader": "transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16); one "
                          "warm-up forward on [[1, 2, 3]] (compressed-tensors' decompress hook); y = module(x)",
                "layers": desc}
        except Exception as e:
            meta["reference_outputs"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        return export, meta, refs

    return job


LLMC_JOBS = {f"llmc_{p.lower()}": llmc_job(p) for p in ("NVFP4", "NVFP4A16", "MXFP4", "MXFP8")}


# ----------------------------------------------------------------------------------------------
# NVIDIA ModelOpt


def modelopt_job(preset: str, kv: bool):
    def job(work: Path):
        import copy

        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint

        model = saved_tiny_llama(work / "base")
        cfg = copy.deepcopy(getattr(mtq, preset))
        if kv:  # FP8 KV cache: k_proj.k_scale / v_proj.v_scale in the export
            cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        mtq.quantize(model, cfg, forward_loop=calib_loop)
        refs, in_mem = run_probes(model, "y_in_memory")
        # the in-memory weight fake quant (what the quantized forward multiplies by)
        for lin in PROBES[:2]:
            mod = model.get_submodule(lin)
            try:
                with torch.no_grad():
                    refs[f"{lin}.qdq_in_memory"] = mod.weight_quantizer(mod.weight).detach().clone()
            except Exception as e:
                in_mem[lin]["weight_quantizer_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        amax = {}
        for lin in LINEARS:
            mod = model.get_submodule(lin)
            for qn in ("weight_quantizer", "input_quantizer"):
                a = getattr(getattr(mod, qn, None), "amax", None)
                if a is not None:
                    refs[f"{lin}.in_memory_{qn}_amax"] = a.detach().float().clone()
                    amax[f"{lin}.{qn}"] = {"dtype": str(a.dtype), "shape": list(a.shape)}
        export = work / "export"
        export_hf_checkpoint(model, export_dir=str(export))
        meta = {"tool": "nvidia-modelopt",
                "function": "modelopt.torch.quantization.quantize(model, cfg, forward_loop) + "
                            "modelopt.torch.export.export_hf_checkpoint(model, export_dir)",
                "arguments": {"cfg": f"mtq.{preset}" + (" + mtq.FP8_KV_CFG quant_cfg entries" if kv else ""),
                              "calibration": "4 random token batches of 16 tokens (seed 77), model(ids) under no_grad"},
                "in_memory": {"layers": in_mem, "amax": amax,
                              "qdq_in_memory": "module.weight_quantizer(module.weight) after quantize()"}}
        try:  # ModelOpt checkpoints have no CPU loader in transformers; record what transformers does
            from safetensors.torch import load_file
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.bfloat16)
            w = loaded.get_submodule(PROBES[1]).weight
            stored = load_file(str(export / "model.safetensors"))[PROBES[1] + ".weight"]
            same = stored.dtype != torch.uint8 and torch.equal(w, stored.to(w.dtype))
            meta["reference_outputs"] = {"transformers_from_pretrained": (
                f"loaded WITHOUT quantization: {PROBES[1]}.weight is {w.dtype}"
                + (" = the stored codes cast unscaled (weight_scale ignored)" if same else ""))}
        except Exception as e:
            meta["reference_outputs"] = {"transformers_from_pretrained": f"{type(e).__name__}: {str(e)[:300]}"}
        return export, meta, refs

    return job


MODELOPT_JOBS = {
    "modelopt_fp8": modelopt_job("FP8_DEFAULT_CFG", kv=True),
    "modelopt_nvfp4": modelopt_job("NVFP4_DEFAULT_CFG", kv=False),
    "modelopt_mxfp8": modelopt_job("MXFP8_DEFAULT_CFG", kv=False),
    "modelopt_fp8_pc_pt": modelopt_job("FP8_PER_CHANNEL_PER_TOKEN_CFG", kv=False),
}


# ----------------------------------------------------------------------------------------------
# AMD Quark


def quark_job(scheme: str, kv: bool):
    def job(work: Path):
        from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

        model = saved_tiny_llama(work / "base")
        cfg = LLMTemplate.get("llama").get_config(scheme=scheme, kv_cache_scheme="fp8" if kv else None,
                                                 exclude_layers=["lm_head"])
        quantizer = ModelQuantizer(cfg)
        model = quantizer.quantize_model(model, mif.calib_batches())
        model = quantizer.freeze(model)
        refs, in_mem = run_probes(model, "y_in_memory")
        export = work / "export"
        export_safetensors(model, str(export))
        meta = {"tool": "amd-quark",
                "function": "quark.torch.LLMTemplate.get('llama').get_config(scheme, kv_cache_scheme, "
                            "exclude_layers=['lm_head']); ModelQuantizer(cfg).quantize_model(model, batches); "
                            "quantizer.freeze(model); quark.torch.export_safetensors(model, dir)",
                "arguments": {"scheme": scheme, "kv_cache_scheme": "fp8" if kv else None,
                              "calibration": "4 random token batches of 16 tokens (seed 77)"},
                "in_memory": {"layers": in_mem}}
        try:  # transformers' quark integration reloads on CPU
            ys, desc = mif.reload_outputs(export, PROBES)
            refs.update(ys)
            meta["reference_outputs"] = {
                "loader": "transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16) "
                          "(quant_method quark -> transformers' quark integration); one warm-up forward; y = module(x)",
                "layers": desc}
        except Exception as e:
            meta["reference_outputs"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        return export, meta, refs

    return job


QUARK_JOBS = {"quark_fp8": quark_job("fp8", kv=True), "quark_mxfp4": quark_job("mxfp4", kv=False)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tool", required=True, choices=sorted(TOOL_VERSIONS))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--only", nargs="*")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    vers = versions(a.tool)
    print("versions:", json.dumps(vers), flush=True)
    jobs = {"llmc": lambda: LLMC_JOBS, "modelopt": lambda: MODELOPT_JOBS, "quark": lambda: QUARK_JOBS}[a.tool]()
    return 1 if run_jobs(jobs, a.out, vers, a.only) else 0



if __name__ == "__main__":
    sys.exit(main())
