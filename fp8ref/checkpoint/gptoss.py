"""gpt-oss MXFP4 checkpoints (``quant_method: mxfp4``); the config vocabulary is ``fp8ref.producers.gptoss``.

Each experts module M holds two fused projections P (gate_up_proj, down_proj) of all E experts:
``M.P_blocks`` U8 [E, out, in/32, 16] (E2M1 pairs, low nibble = even element), ``M.P_scales`` U8
[E, out, in/32] (E8M0 multipliers 2**(byte - 127)), ``M.P_bias`` D [E, out]. fp8ref reads one
projection as one MX layer named ``M.P`` (the model's parameter name) of shape [E * out, in]: expert
e's rows are e*out .. (e+1)*out - 1, so every MX tool of fp8ref (dequantize, quantize, verify) applies
unchanged. ``ExpertsLayer.experts_weight`` gives the model's [E, in, out] layout.

Producer (transformers 5.17 on CPU: no triton, so ``Mxfp4Config.dequantize`` is forced): the
``Mxfp4Dequantize`` weight converter: a bf16 LUT of the 16 E2M1 values, ``torch.ldexp(v, byte - 127)``
into bf16 (the exact product rounded once), reshaped [E, out, in] and transposed to [E, in, out].
The model then runs ``GptOssExperts`` on those bf16 weights (fp8ref.nn.gptoss). Written with the
recipe ``gpt-oss-mxfp4`` (transformers' Mxfp4Quantize: triton_kernels' ROUND_UP) by default; a
checkpoint quantized by the OCP floor rule verifies with recipe ``fp8ref``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, Fp8RefError
from ..io.atomic import atomic_folder
from ..io.files import read_json
from ..io.safetensors import INDEX_NAME, TensorSpec, TensorStore, open_store, pack_nibbles, unpack_nibbles
from ..producers import gptoss as gx
from ..quant import QuantArgs, quantize
from . import base
from .base import Defaults, ScaleDecl, register
from .layout import LayerEntry, LayerQuant, check_scale_values, from_scheme
from .loader import QuantizedLayer
from .plan import layer_config
from .writer import copy_others, write_metadata, write_shard

NAME = gx.NAME
QUANT = LayerQuant("mx", None, None, weight_fmt="float4_e2m1fn")  # weight-only MXFP4 (bf16 activations)
RECIPE = "gpt-oss-mxfp4"  # transformers' Mxfp4Quantize (ROUND_UP)
RECIPES = (RECIPE, "fp8ref")  # what verify tries: ROUND_UP, then the OCP floor rule (fp8ref's MX default)
MX = 32


def projection_of(name: str) -> tuple[str, str, str] | None:
    """(module, projection, suffix) of a ``M.P_blocks`` / ``M.P_scales`` / ``M.P_bias`` tensor name."""
    module, _, leaf = name.rpartition(".")
    for suffix in (gx.BLOCKS, gx.SCALES, gx.BIAS):
        proj = leaf[: -len(suffix)] if leaf.endswith(suffix) else None
        if proj in gx.PROJECTIONS:
            return module, proj, suffix
    return None


class ExpertsLayer(QuantizedLayer):
    """One fused MXFP4 expert projection ``M.P`` as an MX layer of [E * out, in]."""

    def __init__(self, checkpoint, entry: LayerEntry):
        super().__init__(checkpoint, entry)
        e, n, g, _ = checkpoint.store.info(entry.tensors["weight"]).shape
        self.experts, self.expert_shape = e, (n, g * MX)  # expert_shape: one expert's [out, in]
        self.shape = (e * n, g * MX)

    def __repr__(self) -> str:
        return f"ExpertsLayer({self.name!r}, {self.experts} experts of [out, in] {list(self.expert_shape)})"

    @property
    def weight_codes(self) -> np.ndarray:
        """E2M1 codes [E * out, in] (E2M1 has no NaN code)."""
        packed = self._ckpt.store.get(self.tensors["weight"])
        return unpack_nibbles(packed.reshape(self.shape[0], self.shape[1] // 2))

    @property
    def weight_scale_codes(self) -> np.ndarray:
        return self._ckpt.store.get(self.tensors["weight_scale"]).reshape(self.shape[0], -1)

    def _tensor(self, role: str, *, bf16_bits: bool = False):
        name = self.tensors.get(role)
        if name is None:
            return None
        if role == "weight_scale":  # E8M0 values (0xFF, NaN, refused), exact in float32
            values = check_scale_values(self._ckpt.store, name, "float8_e8m0fnu")
            return values.astype(np.float32).reshape(self.shape[0], -1)
        return self._ckpt.store.get(name, bf16_bits=bf16_bits)

    def experts_weight(self, dtype: str = "bfloat16") -> np.ndarray:
        """The dequantized weight in the model's layout [E, in, out] (decode(q) * 2**k rounded once to
        ``dtype``: bit for bit what transformers' Mxfp4Dequantize gives for bfloat16)."""
        n, k = self.expert_shape
        return np.ascontiguousarray(self.dequantize(dtype).reshape(self.experts, n, k).transpose(0, 2, 1))


# --- loading ---------------------------------------------------------------------------------

def layers(qc, store: TensorStore, where: str, warnings: list[str]):
    if qc is None:
        raise CheckpointError(f"{store.root}: gpt-oss MXFP4 layouts are only read with their quantization_config")
    cfg = gx.Config(qc, where, warnings)
    found: dict[str, dict[str, str]] = {}
    for name in store:
        parts = projection_of(name)
        if parts is not None:
            module, proj, suffix = parts
            found.setdefault(f"{module}.{proj}", {})[suffix] = name
    entries = []
    for layer, tensors in sorted(found.items()):
        if gx.BLOCKS not in tensors:
            if gx.SCALES in tensors:
                raise CheckpointError(f"{store.where(tensors[gx.SCALES])}: MXFP4 scales without {layer}{gx.BLOCKS}")
            continue  # a bias of unquantized experts (checked with them below)
        blocks = tensors[gx.BLOCKS]
        if gx.SCALES not in tensors:
            raise CheckpointError(f"{store.where(blocks)}: MXFP4 blocks without {layer}{gx.SCALES} (the E8M0 scales)")
        module = layer.rpartition(".")[0]
        skip = cfg.skipped(module)
        if skip is not None:
            raise CheckpointError(f"{store.where(blocks)}: MXFP4 blocks, but {where}.modules_to_not_convert lists "
                                  f"{skip!r}, which matches {module!r}: config and tensors disagree")
        entry = LayerEntry(layer, QUANT, {"weight": blocks, "weight_scale": tensors[gx.SCALES],
                                          "bias": f"{layer}{gx.BIAS}"}, NAME, group="experts")
        _check_shapes(store, entry)
        entries.append(entry)
    _check_pairs(store, entries)
    for name in store:  # unquantized 3-D experts the config would convert
        parts = name.rpartition(".")
        if parts[2] in gx.PROJECTIONS and len(store.info(name).shape) == 3 and cfg.skipped(parts[0]) is None:
            warnings.append(f"{store.where(name)}: experts stored unquantized, but {where}.modules_to_not_convert "
                            f"does not list {parts[0]!r}; transformers' MXFP4 loader would expect {name}{gx.BLOCKS}. "
                            f"Fix: add {parts[0]!r} to modules_to_not_convert")
    return entries, {}


def _check_shapes(store: TensorStore, entry: LayerEntry) -> None:
    """Structure of one projection: dtypes, ranks, scales = blocks[:-1], bias [E, out] (one line each)."""
    t = entry.tensors
    b, s = store.info(t["weight"]), store.info(t["weight_scale"])
    if b.dtype != "U8" or len(b.shape) != 4 or b.shape[3] != 16 or 0 in b.shape:
        raise CheckpointError(f"{store.where(t['weight'])}: {b.dtype} {list(b.shape)}, expected U8 [experts, out, "
                              f"in/32, 16] (two E2M1 codes a byte)")
    if s.dtype != "U8" or s.shape != b.shape[:3]:
        raise CheckpointError(f"{store.where(t['weight_scale'])}: {s.dtype} {list(s.shape)}, expected U8 "
                              f"{list(b.shape[:3])} (one E8M0 byte per 32 elements of {t['weight']})")
    if t["bias"] not in store:
        raise CheckpointError(f"{store.where(t['weight'])}: no {t['bias']}; gpt-oss experts have biases "
                              f"(transformers would leave them randomly initialised)")
    bias = store.info(t["bias"])
    if bias.dtype not in ("BF16", "F16", "F32") or bias.shape != b.shape[:2]:
        raise CheckpointError(f"{store.where(t['bias'])}: {bias.dtype} {list(bias.shape)}, expected a float "
                              f"{list(b.shape[:2])} ([experts, out] of {t['weight']})")


def _check_pairs(store: TensorStore, entries: list[LayerEntry]) -> None:
    """gate_up_proj [E, 2I, H] and down_proj [E, H, I] of one module must agree (E, H, I)."""
    shapes = {e.name: store.info(e.tensors["weight"]).shape for e in entries}
    for name, (e, n, g, _) in shapes.items():
        module, _, proj = name.rpartition(".")
        other = f"{module}.{'down_proj' if proj == 'gate_up_proj' else 'gate_up_proj'}"
        if other not in shapes:
            raise CheckpointError(f"{store.where(f'{name}{gx.BLOCKS}')}: {module} has {proj}{gx.BLOCKS} but no "
                                  f"{other.rpartition('.')[2]}{gx.BLOCKS}; gpt-oss quantizes both projections")
        if proj != "gate_up_proj":
            continue
        e2, n2, g2, _ = shapes[other]
        if (e2, n2, g2 * MX, n) != (e, g * MX, n // 2, 2 * (n // 2)) or n % 2:
            raise CheckpointError(f"{store.where(f'{other}{gx.BLOCKS}')}: [experts, out, in] = [{e2}, {n2}, {g2 * MX}] "
                                  f"does not fit {name}{gx.BLOCKS}'s [{e}, {n}, {g * MX}]; expected [{e}, {g * MX}, "
                                  f"{n // 2}] (down_proj maps the intermediate size {n}/2 back to hidden {g * MX})")


def check_layer(store: TensorStore, entry: LayerEntry, *, check_values: bool, dtype: str | None = None) -> None:
    """The loader's per-layer check for this format (structure was checked by ``layers``): the E8M0
    scale bytes, 0xFF (NaN) refused with the tensor and index named."""
    if check_values:
        check_scale_values(store, entry.tensors["weight_scale"], "float8_e8m0fnu")


# --- writing ---------------------------------------------------------------------------------

def layer_plan(layer: ExpertsLayer, dtype: str) -> list[tuple[str, str, str, tuple]]:
    """The tensors of one projection as stored (a rewrite keeps names and shapes)."""
    e, (n, k) = layer.experts, layer.expert_shape
    store = layer._ckpt.store
    plan = [("weight", f"{layer.name}{gx.BLOCKS}", "U8", (e, n, k // MX, 16)),
            ("weight_scale", f"{layer.name}{gx.SCALES}", "U8", (e, n, k // MX))]
    bias = f"{layer.name}{gx.BIAS}"
    return plan + [("bias", bias, store.info(bias).dtype, (e, n))]


def quantize_experts(weight: np.ndarray, recipe: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks U8 [E, out, in/32, 16], scales U8 [E, out, in/32]) of a model-layout [E, in, out] weight."""
    e, k, n = weight.shape
    rows = np.ascontiguousarray(np.swapaxes(weight, 1, 2)).reshape(e * n, k)
    res = quantize(rows, QuantArgs(format="float4_e2m1fn", granularity="mx"), recipe=recipe)
    blocks = pack_nibbles(np.asarray(res.codes)).reshape(e, n, k // MX, 16)
    return blocks, np.asarray(res.scale_codes, np.uint8).reshape(e, n, k // MX)


def export(source: str | os.PathLike, output: str | os.PathLike, spec, *, recipe: str | None = None,
           force: bool = False, symlinks_out: bool = False) -> Path:
    """Quantize the fused experts of an original gpt-oss checkpoint (``M.gate_up_proj`` / ``M.down_proj``,
    [E, in, out]) that ``spec`` gives a weight-only MXFP4 scheme; everything else is copied. The recipe
    (the scheme's, or ``recipe``) is recorded in each shard's metadata (``fp8ref_recipes``)."""
    src = Path(source)
    store = open_store(src, symlinks_out=symlinks_out)
    folder = src if src.is_dir() else src.parent
    config = read_json(folder / "config.json", "config") if (folder / "config.json").is_file() else {}
    if not isinstance(config, dict) or config.get("quantization_config") is not None:
        raise CheckpointError(f"{folder / 'config.json'}: expected the original model's config (a JSON object "
                              f"without quantization_config)")
    experts = sorted(n for n in store if n.rpartition(".")[2] in gx.PROJECTIONS and len(store.info(n).shape) == 3)
    cfg = layer_config(spec)
    plans: dict[str, str] = {}
    for name, scheme in cfg.resolve_all(experts).items():
        if scheme is None:
            continue
        where = f"{cfg.source}: layer {name!r}"
        if from_scheme(scheme, where, None) != QUANT:
            raise CheckpointError(f"{where}: gpt-oss stores weight-only MXFP4 experts (data_type mx_fp, 4 bits, "
                                  f"act_bits 16); got {scheme.to_dict()}")
        info = store.info(name)
        if info.dtype not in ("BF16", "F16", "F32") or info.shape[1] % MX:
            raise CheckpointError(f"{store.where(name)}: {info.dtype} {list(info.shape)}: expected float [experts, in, "
                                  f"out] with in a multiple of {MX}")
        plans[name] = recipe or scheme.recipe
    if not plans:
        raise CheckpointError(f"{cfg.source}: the spec quantizes none of the {len(experts)} gpt-oss expert "
                              f"projections of {store.root} (e.g. model.layers.0.mlp.experts.gate_up_proj)")
    for name in plans:
        for t in (f"{name}{gx.BLOCKS}", f"{name}{gx.SCALES}"):
            if t in store:
                raise CheckpointError(f"{store.where(t)}: the source already has a tensor the {NAME} export writes")
    module = base.get(NAME)
    skip = [m.rpartition(".")[0] for m in experts if m not in plans]
    qc = gx.quantization_config(gx.DEFAULT_NOT_CONVERT + sorted(set(skip)))
    with atomic_folder(output, force=force, protect=[src]) as tmp:
        weight_map, total = {}, 0
        for fname, f in store.files.items():
            specs, mine = [], {}
            for tname, info in f.tensors.items():
                if tname in plans:
                    e, k, n = info.shape
                    specs += [TensorSpec(f"{tname}{gx.BLOCKS}", "U8", (e, n, k // MX, 16)),
                              TensorSpec(f"{tname}{gx.SCALES}", "U8", (e, n, k // MX))]
                    mine[tname] = plans[tname]
                else:
                    specs.append(TensorSpec(tname, info.dtype, info.shape))

            def items(f=f, mine=mine):
                for tname in f.tensors:
                    if tname in mine:
                        try:
                            blocks, scales = quantize_experts(np.asarray(store.get(tname)), mine[tname])
                        except Fp8RefError as exc:
                            raise CheckpointError(f"{store.where(tname)}: cannot quantize: {exc}") from None
                        yield f"{tname}{gx.BLOCKS}", blocks
                        yield f"{tname}{gx.SCALES}", scales
                    else:
                        yield tname, f.read_bytes(tname)

            meta = base.with_recipes(f.metadata, {n: r for n, r in mine.items()})
            total += write_shard(tmp, fname, specs, meta, items(), weight_map)
        write_metadata(tmp, store.index is not None, weight_map, total, dict(config), qc, module)
        if src.is_dir():
            copy_others(folder, tmp, set(store.files) | {INDEX_NAME, "config.json"}, symlinks_out=symlinks_out)
    return Path(output)


# --- the format --------------------------------------------------------------------------------

def cannot_express(quant: LayerQuant) -> str | None:
    if quant != QUANT:
        return f"gpt-oss holds weight-only MXFP4 experts (mx, E2M1, no input quantization); got {quant.describe()}"
    return None


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str):
    raise CheckpointError(f"{NAME}: {name}: gpt-oss holds fused [experts, out, in] projections, not linear layers; "
                          f"write them with fp8ref quantize --format gpt-oss, or rewrite a gpt-oss checkpoint (fp8ref "
                          f"convert CKPT OUT --format gpt-oss)")


class GptOss(Defaults):
    name = NAME
    scales = (ScaleDecl("mx (fused experts)", "{gate_up,down}_proj_scales", "E8M0 exponent", "U8",
                        "[E, out, in/32]", "32 (fixed)", "blocks [E, out, in/32, 16] beside them; bias D [E, out]"),)
    methods = (gx.METHOD,)
    detect_rank = 4  # never guessed: gpt-oss always carries its config
    scheme_scale_dtype = "model"
    scales_follow_recipe = False
    kv_refusal = "transformers' Mxfp4Config has no KV-cache field"
    layer_class = ExpertsLayer  # the loader builds ExpertsLayer, not QuantizedLayer, for these entries
    known_recipes = RECIPES

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        return False

    def recipe_of(self, quant: LayerQuant) -> str:
        return RECIPE

    def quantization_config(self, layers: dict, unquantized: list[str], kv: bool = False) -> dict:
        if kv:
            raise CheckpointError(f"{NAME}: {self.kv_refusal}")
        return gx.quantization_config()

    def carry_config(self, source: dict | None, qc: dict) -> dict:
        if isinstance(source, dict) and "modules_to_not_convert" in source:
            return {**qc, "modules_to_not_convert": source["modules_to_not_convert"]}
        return qc

    def original_key(self, layer: ExpertsLayer) -> str:
        """The original's tensor of ``layer``: the model-layout [E, in, out] ``M.P`` itself."""
        return layer.name

    def original_weight(self, layer: ExpertsLayer, store: TensorStore) -> np.ndarray:
        """The original of ``layer`` in its [E * out, in] rows: the model-layout [E, in, out] tensor
        ``M.P`` of an unquantized gpt-oss checkpoint, transposed."""
        if layer.name not in store:
            raise CheckpointError(f"{store.root}: no tensor {layer.name!r} for the quantized experts {layer.name!r}")
        w = np.asarray(store.get(layer.name))
        n, k = layer.expert_shape
        if w.shape != (layer.experts, k, n):
            raise CheckpointError(f"{store.where(layer.name)}: shape {list(w.shape)}, expected [experts, in, out] = "
                                  f"{[layer.experts, k, n]} for {layer.name}{gx.BLOCKS}")
        return np.ascontiguousarray(np.swapaxes(w, 1, 2)).reshape(layer.shape)

    layers = staticmethod(layers)
    check_layer = staticmethod(check_layer)
    cannot_express = staticmethod(cannot_express)
    tensor_plan = staticmethod(tensor_plan)
    layer_plan = staticmethod(layer_plan)
    export = staticmethod(export)


register(GptOss())
