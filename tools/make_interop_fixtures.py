"""Write ground-truth FP8 fixtures produced by the REAL peer tools (tests/fixtures/interop/).

Runs only inside the interop venv (see tools/README.md); it installs nothing. Every tensor is
generated from fixed seeds, so two runs with the same tool versions write the same bytes.

  recipes/      weights and activations quantized by compressed-tensors' eager CPU path,
                auto-round's quant_fp8_sym + exporter pack_layer, and transformers' Fp8Quantize.
  checkpoints/  a tiny random Llama exported by llm-compressor oneshot (FP8, FP8_DYNAMIC,
                FP8_BLOCK) and by auto-round FP8_STATIC RTN (auto_round and llm_compressor
                formats), plus each tool's own reloaded Linear outputs.

Usage: /work/venvs/interop/bin/python tools/make_interop_fixtures.py [--out DIR] [--only recipes|checkpoints]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "interop"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOOLS = ("torch", "compressed-tensors", "llmcompressor", "auto-round", "transformers", "accelerate", "safetensors")


def versions() -> dict[str, str]:
    return {name: md.version(name) for name in TOOLS}


def codes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a float8_e4m3fn tensor (the bytes a checkpoint holds)."""
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected float8_e4m3fn, got {t.dtype}")
    return t.contiguous().view(torch.uint8)


def describe(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in tensors.items()}


# ----------------------------------------------------------------------------------------------
# inputs


def heavy_tailed(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp32 values with log-normal magnitudes plus planted zeros, -0.0 and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(1.5 * torch.randn(rows, cols, generator=g)) * 0.05
    flat = x.view(-1)
    n = flat.numel()
    idx = torch.randperm(n, generator=g)
    k = max(4, n // 64)
    flat[idx[:k]] = 0.0
    flat[idx[k : 2 * k]] = -0.0
    # tiny values, far below amax/448/2**9 of any row: they round to (signed) zero
    flat[idx[2 * k : 3 * k]] = torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0) * 1e-7
    # values near the bottom of the e4m3 subnormal range after scaling
    flat[idx[3 * k : 4 * k]] = torch.randn(k, generator=g) * 1e-4
    return x


def weight_set(dtype: torch.dtype, full: bool) -> dict[str, torch.Tensor]:
    """Shapes not divisible by 128 plus degenerate rows/blocks for the zero-scale rules.

    `full` (bf16 only, to keep the committed fixtures small) adds a 136x130 weight (2x2 blocks, both
    partial) and the 128-divisible 128x256 weight, the only kind HF's Fp8Quantize quantizes.
    """
    w = {"w_48x80": heavy_tailed(48, 80, 2)}
    w["w_48x80"][5] = 0.0  # all-zero row: channel zero-amax rule
    w["w_48x80"][7] = -0.0  # all -0.0 row
    w["w_48x80"][9] = w["w_48x80"][9] * 1e-6  # tiny row: auto-round's scale floor
    if full:
        w["w_136x130"] = heavy_tailed(136, 130, 3)
        w["w_136x130"][128:, 128:] = 0.0  # all-zero partial 8x2 block: block zero-amax rule
        w["w_128x256"] = heavy_tailed(128, 256, 4)
        w["w_128x256"][:, 128:] = 0.0  # one all-zero 128x128 block: HF's zero guard
    w["w_16x32_zero"] = torch.zeros(16, 32)  # all-zero tensor: tensor zero-amax rule
    w["w_16x32_zero"][0, :8] = -0.0
    return {k: v.to(dtype) for k, v in w.items()}


def activation_set(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100)
    a3 = torch.randn(2, 4, 256, generator=g) * torch.exp(torch.randn(2, 4, 256, generator=g))
    a3[0, 0, :] = 0.0  # an all-zero token
    a3[1, 0, 128:] = 0.0  # an all-zero 128-group
    a3[1, 3, 5] = -0.0
    a3[1, 2, 17] = 1e-7
    a3[1, 2, 18] = -1e-7
    a2 = torch.randn(8, 256, generator=g) * torch.exp(torch.randn(8, 256, generator=g))
    a2[2, :] = 0.0
    return {"act_2x4x256": a3.to(dtype), "act_8x256": a2.to(dtype)}


# ----------------------------------------------------------------------------------------------
# recipes: compressed-tensors (eager CPU path; llm-compressor's observers feed calculate_qparams)


def ct_weight(w: torch.Tensor, preset: str) -> tuple[dict[str, torch.Tensor], dict]:
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from llmcompressor.observers import Observer

    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
    args = scheme.weights
    # llmcompressor's calibration.py: weights default to (and static observers become) memoryless_minmax
    observer = "memoryless_minmax"
    obs = Observer.load_from_registry(observer, base_name="weight", args=args)
    obs(w)
    qp = obs.get_qparams()
    state = {"weight": w, "weight_scale": qp["scale"], "weight_zero_point": qp["zero_point"]}
    out = FloatQuantizationCompressor.compress(state, scheme)
    tensors = {"codes": codes(out["weight"]), "weight_scale": out["weight_scale"]}
    meta = {
        "tool": "compressed-tensors",
        "function": "llmcompressor.observers.Observer(" + observer + ") -> "
        "compressed_tensors.quantization.utils.helpers.calculate_qparams; "
        "compressed_tensors.compressors.naive_quantized.base.FloatQuantizationCompressor.compress "
        "(-> compressed_tensors.quantization.lifecycle.forward.quantize, eager CPU)",
        "arguments": {"preset": preset, "weights": args.model_dump(mode="json")},
        "zero_point_passed": True,
    }
    return tensors, meta


def ct_act_static(a: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from llmcompressor.observers import Observer

    args = PRESET_SCHEMES["FP8"]["input_activations"]
    obs = Observer.load_from_registry(args.observer, base_name="input", args=args)
    # two calibration passes (the running max folds over batches)
    obs(a[: a.shape[0] // 2])
    obs(a[a.shape[0] // 2 :])
    qp = obs.get_qparams()
    s, zp = qp["scale"], qp["zero_point"]
    fq = fake_quantize(a, s, zp, args)
    q = quantize(a, s, zp, args, dtype=torch.float8_e4m3fn)
    tensors = {"input_scale": s, "fake_quant": fq, "codes": codes(q)}
    meta = {
        "tool": "compressed-tensors",
        "function": "llmcompressor.observers.Observer(static_minmax) over two halves of the batch "
        "-> calculate_qparams; compressed_tensors...forward.fake_quantize and quantize(dtype=float8_e4m3fn)",
        "arguments": {"input_activations": args.model_dump(mode="json")},
    }
    return tensors, meta


def ct_act_dynamic(a: torch.Tensor, preset: str) -> tuple[dict[str, torch.Tensor], dict]:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = PRESET_SCHEMES[preset]["input_activations"]
    s, zp = compute_dynamic_scales_and_zp(value=a, args=args, module=torch.nn.Module())
    fq = fake_quantize(a, s, zp, args)
    q = quantize(a, s, zp, args, dtype=torch.float8_e4m3fn)
    tensors = {"scale": s, "fake_quant": fq, "codes": codes(q)}
    meta = {
        "tool": "compressed-tensors",
        "function": "compressed_tensors.quantization.utils.helpers.compute_dynamic_scales_and_zp; "
        "forward.fake_quantize (what forward_quantize does) and quantize(dtype=float8_e4m3fn)",
        "arguments": {"preset": preset, "input_activations": args.model_dump(mode="json")},
    }
    return tensors, meta


# ----------------------------------------------------------------------------------------------
# recipes: auto-round


class _Holder(torch.nn.Module):
    """Minimal parent module for auto-round's pack_layer (it reads model.dtype)."""

    def __init__(self, lin: torch.nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.lin = lin
        self._dtype = dtype

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype


def ar_weight(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    from auto_round.data_type.fp8 import quant_fp8_sym
    from auto_round.export.export_to_autoround.export_to_fp8 import pack_layer

    qdq, s32, zp = quant_fp8_sym(w, group_size=-1, max_scale=1.0, v=0)
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    lin.weight.data = qdq.clone()
    # the attributes auto-round's wrapper leaves on an RTN-quantized FP8_STATIC layer
    lin.bits, lin.group_size, lin.data_type, lin.sym = 8, -1, "fp", True
    lin.act_bits, lin.act_group_size, lin.act_data_type, lin.act_dynamic = 8, 0, "fp", False
    lin.scale, lin.zp = s32, zp
    holder = _Holder(lin, w.dtype)
    pack_layer("lin", holder, "fp", device="cpu")
    packed = holder.lin
    tensors = {
        "scale_fp32": s32,
        "codes": codes(packed.weight),
        "weight_scale": packed.weight_scale,
    }
    if w.numel() <= 4096:  # the in-memory QDQ weight is kept for small cases only (size budget)
        tensors["qdq_in_memory"] = qdq
    meta = {
        "tool": "auto-round",
        "function": "auto_round.data_type.fp8.quant_fp8_sym(group_size=-1, max_scale=1.0, v=0) -> "
        "(qdq_in_memory, scale_fp32); then auto_round.export.export_to_autoround.export_to_fp8.pack_layer "
        "on a Linear whose weight is qdq_in_memory (model dtype = input dtype) -> codes, weight_scale",
        "arguments": {"group_size": -1, "max_scale": 1.0, "v": 0, "data_type": "fp", "model_dtype": str(w.dtype)},
    }
    return tensors, meta


def ar_input_scale(a: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    from auto_round.data_type.fp8 import quant_fp8_sym

    # act_max as auto-round's calibration hook records it: running max|x| per layer, shape [1]
    act_max = a.abs().amax().reshape(1)
    _, s32, _ = quant_fp8_sym(torch.zeros(1), tensor_max=act_max, max_scale=torch.tensor(1.0), group_size=0)
    stored = s32.view(-1).to(a.dtype)  # FP8QLinear registers input_scale.to(model dtype)
    tensors = {"act_max": act_max, "scale_fp32": s32, "input_scale": stored}
    meta = {
        "tool": "auto-round",
        "function": "act_max = amax|x| (dtype of x); auto_round.data_type.fp8.quant_fp8_sym(torch.zeros(1), "
        "tensor_max=act_max, max_scale=1.0, group_size=0) as WrapperLinear._qdq_act does at unwrap; "
        "input_scale = scale.view(-1).to(model dtype) as FP8QLinear stores it",
        "arguments": {"group_size": 0, "max_scale": 1.0},
    }
    return tensors, meta


# ----------------------------------------------------------------------------------------------
# recipes: transformers fine-grained fp8


def hf_block(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = FineGrainedFP8Config(weight_block_size=[128, 128])
    op = Fp8Quantize(SimpleNamespace(quantization_config=cfg))
    out = op.convert({"x.weight": w})
    meta = {
        "tool": "transformers",
        "function": "transformers.integrations.finegrained_fp8.Fp8Quantize.convert",
        "arguments": {"weight_block_size": [128, 128], "scale_fmt": cfg.scale_fmt},
    }
    if "x.weight_scale_inv" not in out:
        meta["passed_through_unquantized"] = True
        return {"passthrough": out["x.weight"]}, meta
    return {"codes": codes(out["x.weight"]), "weight_scale_inv": out["x.weight_scale_inv"]}, meta


# ----------------------------------------------------------------------------------------------


def write_recipes(out: Path, vers: dict[str, str]) -> None:
    rdir = out / "recipes"
    shutil.rmtree(rdir, ignore_errors=True)
    rdir.mkdir(parents=True)
    manifest: dict = {"versions": vers, "inputs": {}, "cases": []}

    def emit(fname: str, case_tensors: dict[str, dict[str, torch.Tensor]], metas: list[dict]) -> None:
        if not case_tensors:
            return
        flat = {f"{case}.{k}": v.contiguous().clone() for case, ts in case_tensors.items() for k, v in ts.items()}
        save_file(flat, str(rdir / fname))
        for m in metas:
            m["file"] = fname
            m["tensors"] = describe({k: v for k, v in flat.items() if k.startswith(m["case"] + ".")})
            manifest["cases"].append(m)
        print(f"wrote recipes/{fname}: {len(flat)} tensors, {(rdir / fname).stat().st_size} bytes")

    for dname, dtype in DTYPES.items():
        ws, acts = weight_set(dtype, full=dname == "bf16"), activation_set(dtype)
        inputs = {**ws, **acts}
        save_file({k: v.contiguous() for k, v in inputs.items()}, str(rdir / f"inputs_{dname}.safetensors"))
        manifest["inputs"][f"inputs_{dname}.safetensors"] = describe(inputs)
        print(f"wrote recipes/inputs_{dname}.safetensors")

        for preset, tag in (("FP8", "tensor"), ("FP8_DYNAMIC", "channel"), ("FP8_BLOCK", "block")):
            tensors, metas = {}, []
            for wn, w in ws.items():
                t, m = ct_weight(w, preset)
                case = f"{wn}"
                tensors[case] = t
                metas.append({"case": case, "input": f"inputs_{dname}.safetensors:{wn}", "dtype": dname,
                              "shape": list(w.shape), "strategy": tag, **m, "version": vers["compressed-tensors"]})
            emit(f"ct_weight_{tag}_{dname}.safetensors", tensors, metas)

        tensors, metas = {}, []
        for an, a in acts.items():
            for kind, fn in (("static_tensor", lambda x: ct_act_static(x)),
                             ("dynamic_token", lambda x: ct_act_dynamic(x, "FP8_DYNAMIC")),
                             ("dynamic_group128", lambda x: ct_act_dynamic(x, "FP8_BLOCK"))):
                t, m = fn(a)
                case = f"{an}.{kind}"
                tensors[case] = t
                metas.append({"case": case, "input": f"inputs_{dname}.safetensors:{an}", "dtype": dname,
                              "shape": list(a.shape), "kind": kind, **m, "version": vers["compressed-tensors"]})
        emit(f"ct_act_{dname}.safetensors", tensors, metas)

        tensors, metas = {}, []
        for wn, w in ws.items():
            t, m = ar_weight(w)
            tensors[wn] = t
            metas.append({"case": wn, "input": f"inputs_{dname}.safetensors:{wn}", "dtype": dname,
                          "shape": list(w.shape), "strategy": "channel", **m, "version": vers["auto-round"]})
        for an, a in acts.items():
            t, m = ar_input_scale(a)
            case = f"{an}.input_scale"
            tensors[case] = t
            metas.append({"case": case, "input": f"inputs_{dname}.safetensors:{an}", "dtype": dname,
                          "shape": list(a.shape), "kind": "static_input_scale", **m, "version": vers["auto-round"]})
        emit(f"ar_fp8_static_{dname}.safetensors", tensors, metas)

        tensors, metas = {}, []
        for wn, w in ws.items():
            t, m = hf_block(w)
            if m.get("passed_through_unquantized"):
                # record the behaviour without storing a copy of the input
                metas_only = {"case": wn, "input": f"inputs_{dname}.safetensors:{wn}", "dtype": dname,
                              "shape": list(w.shape), **m, "version": vers["transformers"], "file": None,
                              "tensors": {}, "output_equals_input": bool(torch.equal(t["passthrough"], w))}
                manifest["cases"].append(metas_only)
                continue
            tensors[wn] = t
            metas.append({"case": wn, "input": f"inputs_{dname}.safetensors:{wn}", "dtype": dname,
                          "shape": list(w.shape), "strategy": "block", **m, "version": vers["transformers"]})
        emit(f"hf_finegrained_{dname}.safetensors", tensors, metas)

    (rdir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print("wrote recipes/manifest.json")

# ----------------------------------------------------------------------------------------------
# checkpoints

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
PROBE_LAYERS = ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj", "lm_head")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(**LLAMA, dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                # heavier tails than the default init, plus planted zeros, -0.0 and tiny values
                w = p.float() * torch.exp(0.8 * torch.randn(p.shape, generator=g))
                flat = w.view(-1)
                idx = torch.randperm(flat.numel(), generator=g)[:24]
                flat[idx[:8]] = 0.0
                flat[idx[8:16]] = -0.0
                flat[idx[16:]] = 1e-7
                p.copy_(w)
        # one all-zero output row in a channel-quantized layer (zero-amax rule in a real export)
        model.model.layers[1].mlp.down_proj.weight[3].zero_()
    return model


def saved_tiny_llama(folder: Path):
    """The tiny Llama saved to disk and reloaded: llmcompressor 0.14 re-reads model.config.name_or_path."""
    from transformers import AutoModelForCausalLM

    tiny_llama().save_pretrained(str(folder))
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()


def calib_batches(n: int = 4, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(0, LLAMA["vocab_size"], (1, seq), generator=g) for _ in range(n)]


def probe_inputs(layers: tuple[str, ...] = PROBE_LAYERS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    h, i = LLAMA["hidden_size"], LLAMA["intermediate_size"]
    xs = {}
    for name in layers:
        k = i if name.endswith("down_proj") else h
        x = torch.randn(1, 4, k, generator=g) * torch.exp(torch.randn(1, 4, k, generator=g))
        x[0, 1, 0] = -0.0
        xs[name] = x.to(torch.bfloat16)
    return xs


def tiny_tokenizer():
    """A 128-token word-level tokenizer built in code (oneshot wants a processor with a dataset)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(LLAMA["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1", bos_token="t2")


def llmc_export(scheme: str, folder: Path) -> dict:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = saved_tiny_llama(folder.parent / "base")
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    kwargs = {}
    if scheme == "FP8":  # static activations need calibration data: random token batches, no download
        ids = [b[0].tolist() for b in calib_batches()]
        kwargs = dict(dataset=Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}),
                      num_calibration_samples=len(ids), max_seq_length=len(ids[0]), processor=tiny_tokenizer())
    oneshot(model=model, recipe=recipe, **kwargs)
    model.save_pretrained(str(folder), save_compressed=True)
    return {"tool": "llmcompressor", "function": "llmcompressor.oneshot + model.save_pretrained(save_compressed=True)",
            "arguments": {"recipe": f"QuantizationModifier(targets='Linear', scheme='{scheme}', ignore=['lm_head'])",
                          **({"calibration": "4 random token batches of 16 tokens (seed 77), "
                              "datasets.Dataset.from_dict"} if kwargs else {})}}


def autoround_export(fmt: str, folder: Path) -> dict:
    from auto_round import AutoRound

    model = saved_tiny_llama(folder.parent / "base")
    ar = AutoRound(model, tokenizer=tiny_tokenizer(), scheme="FP8_STATIC", iters=0, dataset=calib_batches(),
                   nsamples=4, seqlen=16, batch_size=1)
    ar.quantize_and_save(output_dir=str(folder), format=fmt)
    return {"tool": "auto-round",
            "function": "auto_round.AutoRound(scheme='FP8_STATIC', iters=0, tokenizer=<tiny in-code tokenizer>, "
                        f"dataset=<4 random token batches>).quantize_and_save(format={fmt!r})",
            "arguments": {"scheme": "FP8_STATIC", "iters": 0, "nsamples": 4, "seqlen": 16, "format": fmt}}


def reload_outputs(folder: Path, layers: tuple[str, ...] = PROBE_LAYERS,
                   model=None) -> tuple[dict[str, torch.Tensor], dict]:
    """Load the checkpoint with the tool's own loader (transformers dispatches on quant_method)
    and run each probe Linear on its fixed input. `model`: an already loaded model (another loader)."""
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    desc: dict = {}
    with torch.no_grad():
        # compressed-tensors decompresses in a model-level forward pre-hook on the first call;
        # calling a Linear before that would see the raw float8 weight
        try:
            logits = model(torch.tensor([[1, 2, 3]])).logits
            desc["warmup_forward"] = {"ok": True, "logits_finite": bool(torch.isfinite(logits).all())}
        except Exception as e:  # recorded: the decompress hook has already run by then
            desc["warmup_forward"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    out = {}
    with torch.no_grad():
        for name, x in probe_inputs(layers).items():
            mod = model.get_submodule(name)
            w = getattr(mod, "weight", None)  # packed formats (CT weight_packed) may hold none
            d = {"module_class": f"{type(mod).__module__}.{type(mod).__name__}",
                 "weight_dtype": None if w is None else str(w.dtype),
                 "buffers": sorted(n for n, _ in mod.named_buffers()),
                 "parameters": sorted(n for n, _ in mod.named_parameters())}
            desc[name] = d
            out[f"{name}.x"] = x
            if name == layers[0] and w is not None and w.dtype not in (torch.float8_e4m3fn, torch.uint8):
                out[f"{name}.reloaded_weight"] = w.detach()  # one layer only (size budget)
            try:
                y = mod(x)
            except Exception as e:  # a layer the tool's own loader cannot run is a finding
                d["error"] = f"{type(e).__name__}: {e}"
                continue
            out[f"{name}.y"] = y
            d.update(y_finite=bool(torch.isfinite(y).all()), y_nan_count=int(torch.isnan(y).sum()))
    return out, desc


def write_checkpoints(out: Path, vers: dict[str, str]) -> None:
    cdir = out / "checkpoints"
    shutil.rmtree(cdir, ignore_errors=True)
    cdir.mkdir(parents=True)
    jobs = {
        "llmc_fp8": lambda f: llmc_export("FP8", f),
        "llmc_fp8_dynamic": lambda f: llmc_export("FP8_DYNAMIC", f),
        "llmc_fp8_block": lambda f: llmc_export("FP8_BLOCK", f),
        "autoround_fp8_static": lambda f: autoround_export("auto_round", f),
        "autoround_fp8_static_llmc": lambda f: autoround_export("llm_compressor", f),
    }
    for name, job in jobs.items():
        with tempfile.TemporaryDirectory() as work:
            tmp = Path(work) / "export"
            meta = job(tmp)
            subdirs = [p for p in tmp.iterdir() if p.is_dir()]
            if len(subdirs) == 1 and not (tmp / "config.json").exists():
                meta["tool_output_subfolder"] = subdirs[0].name  # auto-round appends one
                tmp = subdirs[0]
            dest = cdir / name
            dest.mkdir()
            kept = []
            for f in sorted(tmp.iterdir()):
                if f.suffix in (".json", ".safetensors") and not f.name.startswith(("tokenizer", "generation")):
                    shutil.copy2(f, dest / f.name)
                    kept.append(f.name)
            meta["files_written_by_tool"] = sorted(p.name for p in tmp.iterdir())
            meta["files_kept"] = kept
        try:
            ys, desc = reload_outputs(dest)
            save_file({k: v.contiguous().clone() for k, v in ys.items()}, str(dest / "reference_outputs.safetensors"))
            meta["reference_outputs"] = {
                "loader": "transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16) "
                "(dispatches to compressed-tensors or auto-round by quant_method); one warm-up model forward on "
                "token ids [[1, 2, 3]] (triggers compressed-tensors' decompress hook); "
                "then y = module(x) under no_grad",
                "x": "bf16 [1, 4, in_features], seed 99, log-normal magnitudes, x[0,1,0] = -0.0",
                "layers": desc, "tensors": describe(ys)}
        except Exception as e:  # the reload failing is itself a finding; keep the checkpoint
            meta["reference_outputs"] = {"error": f"{type(e).__name__}: {e}"}
        meta["versions"] = vers
        meta["model"] = {"class": "LlamaForCausalLM", "config": LLAMA, "dtype": "bfloat16", "seed": 1234,
                         "weight_edit_seed": 4321}
        (dest / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        size = sum(p.stat().st_size for p in dest.iterdir())
        print(f"wrote checkpoints/{name}: {sorted(p.name for p in dest.iterdir())} ({size} bytes)")
    write_original(cdir / "original_bf16", vers)


def write_original(dest: Path, vers: dict[str, str]) -> None:
    """The unquantized tiny Llama every checkpoint above was made from (``fp8ref verify --original``,
    ``compare --modes original``): transformers' save_pretrained, config.json and model.safetensors."""
    with tempfile.TemporaryDirectory() as work:
        tiny_llama().save_pretrained(work)
        dest.mkdir()
        for f in ("config.json", "model.safetensors"):
            shutil.copy2(Path(work) / f, dest / f)
    meta = {"tool": "transformers", "function": "tiny_llama().save_pretrained(folder)", "versions": vers,
            "model": {"class": "LlamaForCausalLM", "config": LLAMA, "dtype": "bfloat16", "seed": 1234,
                      "weight_edit_seed": 4321}}
    (dest / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    print(f"wrote checkpoints/{dest.name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--only", choices=("recipes", "checkpoints"))
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    vers = versions()
    print("versions:", json.dumps(vers))
    if a.only in (None, "recipes"):
        write_recipes(a.out, vers)
    if a.only in (None, "checkpoints"):
        write_checkpoints(a.out, vers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
