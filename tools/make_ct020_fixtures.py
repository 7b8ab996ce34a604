"""Write compressed-tensors 0.20.1 checkpoint fixtures with the wheel's OWN code, on CPU.

llm-compressor 0.14.0.1 pins compressed-tensors 0.19, so no llm-compressor drives 0.20.1 here. This
script does what llm-compressor's oneshot does around it, with compressed-tensors 0.20.1 for every
step that decides a byte: the preset scheme (``preset_name_to_scheme``), ``apply_quantization_config``,
the scales (``calculate_qparams`` on a plain min/max: what llm-compressor's memoryless_minmax weight
observer and static_minmax input observer reduce to), ``ModelCompressor.compress_model`` (the packers
and the E8M0 scale writer) and ``ModelCompressor.update_config`` (the config writer). The model is
make_fp4_mx_fixtures.py's one-layer Llama (same bytes, planted zeros, -0.0 and a tiny block).

Writes tests/fixtures/interop/checkpoints/ct020_<preset>/ (config.json, model.safetensors,
fixture.json, reference_outputs.safetensors with the original bf16 linears as ``original.<linear>``,
``<probe>.qdq_weight`` (the weight as compressed-tensors' decompressor returns it) and ``<probe>.x`` /
``<probe>.y``: the probe layers of transformers' reload of the written folder on fixed inputs, where
compressed-tensors can run them).

Also writes ``original_fp4_mx_bf16/``: that model before quantization, as transformers saves it (the
original of every FP4 / MX fixture, make_fp4_mx_fixtures.py's included), for ``fp8ref verify --original``.

Usage: /work/venvs/ct-gpu-ct020/bin/python tools/make_ct020_fixtures.py [--only NAME ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("CT_ENFORCE_EAGER", "1")  # CPU anyway; the eager kernels, not Triton's

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_fp4_mx_fixtures as m4  # noqa: E402  (the model, write_fixture, run_jobs)
import make_interop_fixtures as mif  # noqa: E402  (calibration batches)
import torch  # noqa: E402

PRESETS = {"ct020_mxfp6a16": "MXFP6A16", "ct020_mxfp6a8": "MXFP6A8", "ct020_mxfp4xfp8": "MXFP4XFP8",
           "ct020_mxfp8": "MXFP8", "ct020_fp8": "FP8"}


def versions() -> dict[str, str | None]:
    out = {}
    for name in m4.COMMON_TOOLS + ("compressed-tensors",):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _minmax(x: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max over each scale's elements (llm-compressor's min/max observers, one batch)."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        return x.amin(), x.amax()
    if strategy == "channel":
        return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    if strategy == "group":
        g = x.unflatten(-1, (-1, args.group_size))
        return g.amin(dim=-1), g.amax(dim=-1)
    raise ValueError(f"strategy {strategy} is not made here")


def _input_minmax(model, names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Running min/max of each layer's input over the calibration batches (static_minmax), unquantized model."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for name in names:
        def hook(mod, inp, name=name):
            x = inp[0].detach()
            lo, hi = x.amin(), x.amax()
            if name in seen:
                lo, hi = torch.minimum(seen[name][0], lo), torch.maximum(seen[name][1], hi)
            seen[name] = (lo, hi)
        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in mif.calib_batches():
            model(ids)
    for h in hooks:
        h.remove()
    return seen


def ct020_job(preset: str):
    def job(work: Path):
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
        from compressed_tensors.quantization.utils import calculate_qparams

        model = m4.saved_tiny_llama(work / "base")
        scheme = preset_name_to_scheme(preset, ["Linear"])
        static_inputs = scheme.input_activations is not None and scheme.input_activations.dynamic is False
        in_range = _input_minmax(model, list(m4.LINEARS)) if static_inputs else {}
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
        qparams = {}
        for lin in m4.LINEARS:
            mod = model.get_submodule(lin)
            args = mod.quantization_scheme.weights
            with torch.no_grad():
                lo, hi = _minmax(mod.weight, args)
                scale, zp = calculate_qparams(lo, hi, args)
                mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
                if hasattr(mod, "weight_zero_point"):
                    mod.weight_zero_point.data.copy_(zp.reshape(mod.weight_zero_point.shape))
                if lin in in_range:
                    s_in, zp_in = calculate_qparams(*in_range[lin], mod.quantization_scheme.input_activations)
                    mod.input_scale.data.copy_(s_in.reshape(mod.input_scale.shape))
                    if hasattr(mod, "input_zero_point"):
                        mod.input_zero_point.data.copy_(zp_in.reshape(mod.input_zero_point.shape))
            qparams[lin] = {"weight_scale": {"dtype": str(mod.weight_scale.dtype),
                                             "shape": list(mod.weight_scale.shape)}}
        refs = {}
        for lin in m4.LINEARS:
            if lin in in_range:  # the calibrated input range (fp8ref's export takes the amax)
                lo, hi = in_range[lin]
                refs[f"{lin}.input_amax"] = torch.maximum(lo.abs(), hi.abs()).reshape(1).float()
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        export = work / "export"
        model.save_pretrained(str(export))
        compressor.update_config(str(export))
        try:  # compressed-tensors 0.20.1's own reload through transformers, the probe layers on fixed inputs
            ys, reloaded = mif.reload_outputs(export, m4.PROBES)
            refs.update(ys)
            reload = {"loader": "transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16); "
                                "one warm-up forward on [[1, 2, 3]] (decompress hook); y = module(x)",
                      "layers": reloaded}
        except Exception as e:  # noqa: BLE001  (recorded: a finding)
            reload = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        for lin in m4.PROBES[:2]:  # compressed-tensors' own decompression of two layers
            mod = model.get_submodule(lin)
            try:
                from compressed_tensors.compressors.base import decompress_module

                decompress_module(mod)
                refs[f"{lin}.qdq_weight"] = mod.weight.detach().clone()
            except Exception as e:  # noqa: BLE001  (recorded: a finding)
                qparams[lin]["decompress_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        meta = {"tool": "compressed-tensors",
                "function": "preset_name_to_scheme + apply_quantization_config + calculate_qparams(min, max) + "
                            "ModelCompressor.from_pretrained_model(model).compress_model(model) + "
                            "model.save_pretrained + ModelCompressor.update_config",
                "arguments": {"preset": preset, "ignore": ["lm_head"],
                              "calibration": "weights: per-scale min/max of the weight; static inputs: running "
                                             "min/max over 4 random token batches of 16 tokens (seed 77)"},
                "in_memory": {"weight_qparams": qparams},
                "reference_outputs": reload,
                "writer": "tools/make_ct020_fixtures.py"}
        return export, meta, refs

    return job


def original_job(work: Path):
    model = m4.tiny_llama()
    export = work / "export"
    model.save_pretrained(str(export))
    meta = {"tool": "transformers", "function": "make_fp4_mx_fixtures.tiny_llama().save_pretrained(folder)",
            "arguments": {}, "note": "the original weights of every FP4 / MX / ct020 fixture (verify --original)"}
    return export, meta, {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=m4.DEFAULT_OUT)
    p.add_argument("--only", nargs="*")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    vers = versions()
    print("versions:", json.dumps(vers), flush=True)
    jobs = {name: ct020_job(preset) for name, preset in PRESETS.items()} | {"original_fp4_mx_bf16": original_job}
    failed = m4.run_jobs(jobs, a.out, vers, a.only)
    original = a.out / "original_fp4_mx_bf16"
    if (original / "reference_outputs.safetensors").exists():  # the original holds its weights already
        (original / "reference_outputs.safetensors").unlink()
        meta = json.loads((original / "fixture.json").read_text())
        meta.pop("reference_tensors", None)
        (original / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=True, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
