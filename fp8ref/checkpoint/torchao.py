"""torchao checkpoints (transformers' ``TorchAoConfig``, ``quant_method: torchao``), saved through
torchao's ``flatten_tensor_state_dict``; the vocabulary is ``fp8ref.producers.torchao``.

A Float8Tensor weight ``M.weight`` is stored as ``M._weight_qdata`` F8_E4M3 [out, in] and
``M._weight_scale`` F32 ([out, 1] per row, [1, 1] per tensor), a dequantization multiplier, with its
description (block size, model dtype, activation granularity) as JSON in the shard's
``__metadata__["M.weight"]``. Recipe ``torchao-float8`` (Float8Tensor.from_hp's torch path):
s = D(amax / 448) stored as F32, q = e4m3(fp32(W) / s). An all-zero row (or tensor) stores scale 0
and NaN codes (pytorch/ao #4713): refused at load with that named.

An MXTensor weight stores ``M._weight_qdata`` (F8_E4M3 / F8_E5M2 [out, in]; FP4 E2M1 as U8 [out, in/2],
low nibble the even element; FP6 E2M3 / E3M2 as U8 [out, in], one code per byte, unpacked) and
``M._weight_scale`` F8_E8M0, swizzled into cuBLAS's 128x4 tiles when ``is_swizzled_scales`` (what the
MX config writes): recipe ``torchao-mx-<mode>`` for its ScaleCalculationMode. An NVFP4Tensor stores
``_weight_qdata`` U8 [out, in/2], ``_weight_scale`` F8_E4M3 (swizzled likewise) and, with the
per-tensor scale, ``_weight_per_tensor_scale`` F32 [] (a multiplier: W = q * (m * s_b)); without it
fp8ref reads a multiplier of 1. Recipes ``torchao-nvfp4`` / ``torchao-nvfp4-no-tensor-scale``.
"""

from __future__ import annotations

import numpy as np

from ..codec import decode
from ..errors import CheckpointError
from ..io.safetensors import TensorStore, unpack_nibbles
from ..producers import torchao as ta
from ..scaling import e8m0_value
from .base import Defaults, ScaleDecl, accept, register
from .layout import BLOCK_SCALED, LayerEntry, LayerQuant, nan_count
from .layout import check_layer as check_linear
from .loader import QuantizedLayer

NAME = ta.NAME
RECIPE = "torchao-float8"
MX_RECIPES = tuple(f"torchao-mx-{m.lower()}" for m in ta.MX_MODES)
NVFP4_RECIPES = ("torchao-nvfp4", "torchao-nvfp4-no-tensor-scale")
QDATA, SCALE, TENSOR_SCALE = "._weight_qdata", "._weight_scale", "._weight_per_tensor_scale"
QDATA_DTYPES = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float4_e2m1fn": "U8", "float6_e2m3fn": "U8",
                "float6_e3m2fn": "U8"}
NVFP4_INPUT_NOTE = ("torchao quantizes this layer's activations to NVFP4 at run time ({}); fp8ref's forward "
                    "runs it weight-only")


def description(store: TensorStore, module: str) -> dict:
    """The parsed JSON description of ``module``'s weight, from the shard whose metadata holds it."""
    key = f"{module}.weight"
    for f in store.files.values():
        if key in (f.metadata or {}):
            return ta.weight_descriptions({key: f.metadata[key]}, str(f.path))[key]
    raise CheckpointError(f"{store.where(module + QDATA)}: no torchao tensor description in __metadata__ for it")


def _block_entry(store: TensorStore, module: str, desc: dict, warnings: list[str]) -> LayerEntry:
    tensors = {"weight": f"{module}{QDATA}", "weight_scale": f"{module}{SCALE}", "bias": f"{module}.bias"}
    if desc["kind"] == "mx":
        quant = LayerQuant("mx", None, "mx" if desc["input"] else None, weight_fmt=desc["fmt"],
                           input_fmt=desc["input"] or "float8_e4m3fn")
    else:
        quant = LayerQuant("nvfp4", None, None, weight_fmt="float4_e2m1fn", global_scale="multiplier")
        if desc["tensor_scale"]:
            tensors["weight_global"] = f"{module}{TENSOR_SCALE}"
        if desc["input"] is not None:
            how = "a dynamic per-tensor scale" if desc["input"] == "dynamic" else "block scales only"
            warnings.append(f"{store.where(tensors['weight'])}: {NVFP4_INPUT_NOTE.format(how)}")
    return LayerEntry(module, quant, tensors, NAME)


def layers(qc, store: TensorStore, where: str, warnings: list[str]):
    if qc is None:
        raise CheckpointError(f"{store.root}: torchao layouts are only read with their quantization_config")
    ta.check_config(qc, where)
    entries = []
    for f in store.files.values():
        for weight, desc in ta.weight_descriptions(f.metadata, str(f.path)).items():
            module = weight[: -len(".weight")] if weight.endswith(".weight") else None
            if module is None or f"{module}{QDATA}" not in store or f"{module}{SCALE}" not in store:
                raise CheckpointError(f"{f.path}: __metadata__ describes {weight!r} as a torchao tensor, but "
                                      f"{weight.rpartition('.')[0]}{QDATA} / {SCALE} are not both stored")
            if desc["kind"] != "float8":
                entries.append(_block_entry(store, module, desc, warnings))
                continue
            shape = store.info(f"{module}{QDATA}").shape
            out, inp = shape if len(shape) == 2 else (0, 0)  # check_layer names a wrong rank
            strategy = {(1, inp): "channel", (out, inp): "tensor"}.get(desc["block_size"])
            if strategy is None:
                raise CheckpointError(f"{f.path}: tensor {weight!r}: block_size {list(desc['block_size'])} is neither "
                                      f"per row [1, {inp}] nor per tensor [{out}, {inp}]")
            quant = LayerQuant(strategy, None, desc["input"])
            entry = LayerEntry(module, quant, {"weight": f"{module}{QDATA}", "weight_scale": f"{module}{SCALE}",
                                               "bias": f"{module}.bias"}, NAME)
            entries.append(accept(store, entry, scale_shapes))
    stray = [n for n in store if n.endswith((QDATA, SCALE, TENSOR_SCALE))
             and not any(n in e.tensors.values() for e in entries)]
    if stray:
        raise CheckpointError(f"{store.where(stray[0])}: no torchao tensor description in __metadata__ for it")
    return entries, {}


def scale_shapes(quant: LayerQuant, out: int, inp: int):
    return ((out, 1),) if quant.weight_strategy == "channel" else ((1, 1),)


def block_shape(store: TensorStore, entry: LayerEntry) -> tuple[int, int]:
    """The logical [out, in] of an MX / NVFP4 weight from its stored qdata (FP4: two codes a byte)."""
    shape = store.info(entry.tensors["weight"]).shape
    if len(shape) != 2 or 0 in shape:
        raise CheckpointError(f"{store.where(entry.tensors['weight'])}: shape {list(shape)}, expected a 2-D "
                              f"[out, in{' / 2' if entry.quant.weight_fmt == 'float4_e2m1fn' else ''}] weight")
    return shape[0], shape[1] * (2 if entry.quant.weight_fmt == "float4_e2m1fn" else 1)


def check_block_layer(store: TensorStore, entry: LayerEntry, desc: dict) -> None:
    """Dtypes and shapes of an MXTensor / NVFP4Tensor layer's tensors (values are checked on read)."""
    q, t = entry.quant, entry.tensors
    w = store.info(t["weight"])
    if w.dtype != QDATA_DTYPES[q.weight_fmt]:
        raise CheckpointError(f"{store.where(t['weight'])}: dtype {w.dtype}, expected {QDATA_DTYPES[q.weight_fmt]} "
                              f"for torchao {q.weight_fmt} data")
    out, inp = block_shape(store, entry)
    group, scale_dtype, _ = BLOCK_SCALED[q.weight_strategy]
    if inp % group:
        raise CheckpointError(f"{store.where(t['weight'])}: {inp} values per row is not a multiple of the "
                              f"{group}-value {q.weight_strategy} block (torchao quantizes whole blocks only)")
    s = store.info(t["weight_scale"])
    want_dtype = "F8_E8M0" if q.weight_strategy == "mx" else scale_dtype
    want = ta.swizzled_shape(out, inp // group) if desc["swizzled"] else (out, inp // group)
    if s.dtype != want_dtype or s.shape != want:
        raise CheckpointError(f"{store.where(t['weight_scale'])}: {s.dtype} {list(s.shape)}, expected {want_dtype} "
                              f"{list(want)} ({'swizzled ' if desc['swizzled'] else ''}block scales of a "
                              f"[{out}, {inp}] weight)")
    if "weight_global" in t:
        g = store.info(t["weight_global"])
        if g.dtype != "F32" or g.shape not in ((), (1,)):
            raise CheckpointError(f"{store.where(t['weight_global'])}: {g.dtype} {list(g.shape)}, expected the "
                                  f"per-tensor scale: F32 []")
    if desc["kind"] == "nvfp4" and not desc["tensor_scale"] and f"{entry.name}{TENSOR_SCALE}" in store:
        raise CheckpointError(f"{store.where(entry.name + TENSOR_SCALE)}: stored, but the description lists no "
                              f"per_tensor_scale")


def check_layer(store: TensorStore, entry: LayerEntry, *, check_values: bool, dtype: str | None = None) -> None:
    """The linear check, with torchao's zero-row NaN named before the generic 'scale is zero'; MX and
    NVFP4 layers by their own layout (``check_block_layer``)."""
    if entry.quant.weight_strategy in BLOCK_SCALED:
        check_block_layer(store, entry, description(store, entry.name))
        return
    if check_values:
        s = np.asarray(store.get(entry.tensors["weight_scale"])).reshape(-1)
        if (s == 0).any():
            rows = np.flatnonzero(s == 0)
            raise CheckpointError(f"{store.where(entry.tensors['weight_scale'])}: {rows.size} zero scales (first "
                                  f"row {int(rows[0])}): an all-zero row that torchao quantized to scale 0 and NaN "
                                  f"codes (pytorch/ao #4713); the layer cannot be dequantized")
    check_linear(store, entry, check_values=check_values, dtype=dtype)


def cannot_express(quant: LayerQuant) -> str | None:
    if quant.weight_strategy == "mx":
        if quant.weight_fmt not in ta.ELEM_NAMES or quant.input != "mx" or quant.input_fmt != quant.weight_fmt:
            return (f"torchao's MXTensor (MXDynamicActivationMXWeightConfig) holds MX weights with MX inputs of the "
                    f"same element format ({', '.join(ta.ELEM_NAMES)}); got {quant.describe()}")
        return None
    if quant.weight_strategy == "nvfp4":
        if quant.input is not None or quant.weight_fmt != "float4_e2m1fn":
            return (f"torchao's NVFP4Tensor stores NVFP4 weights only (its config quantizes inputs at run time with a "
                    f"dynamic per-tensor scale, which no stored scale declares): give the weights without input "
                    f"quantization; got {quant.describe()}")
        return None
    if (quant.weight_strategy not in ("channel", "tensor") or quant.weight_fmt != "float8_e4m3fn"
            or quant.input not in (None, "dynamic-token", "dynamic-tensor")):
        return (f"torchao's Float8Tensor holds per-row or per-tensor float8_e4m3fn weights with dynamic "
                f"per-token / per-tensor inputs or none; got {quant.describe()}")
    return None


def tensor_plan(name: str, quant: LayerQuant, out: int, inp: int, dtype: str):
    if quant.weight_strategy == "mx":
        qshape = (out, inp // 2) if quant.weight_fmt == "float4_e2m1fn" else (out, inp)
        return [("weight", f"{name}{QDATA}", QDATA_DTYPES[quant.weight_fmt], qshape),
                ("weight_scale", f"{name}{SCALE}", "F8_E8M0", ta.swizzled_shape(out, -(-inp // 32)))]
    if quant.weight_strategy == "nvfp4":
        return [("weight", f"{name}{QDATA}", "U8", (out, inp // 2)),
                ("weight_scale", f"{name}{SCALE}", "F8_E4M3", ta.swizzled_shape(out, -(-inp // 16))),
                ("weight_global", f"{name}{TENSOR_SCALE}", "F32", ())]
    scale = (out, 1) if quant.weight_strategy == "channel" else (1, 1)
    return [("weight", f"{name}{QDATA}", "F8_E4M3", (out, inp)), ("weight_scale", f"{name}{SCALE}", "F32", scale)]


def store_block(quant: LayerQuant, codes: np.ndarray, scale_codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Element codes and block-scale bytes as torchao stores them: FP4 two a byte (low nibble the even
    element), FP6 one a byte, FP8 as is; scales swizzled into 128x4 tiles, zero padded."""
    codes = np.asarray(codes, np.uint8)
    if quant.weight_fmt == "float4_e2m1fn":
        codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return codes, ta.swizzle(np.asarray(scale_codes, np.uint8))


def _mode(recipe: str | None) -> str:
    return (recipe.removeprefix("torchao-mx-") if recipe in MX_RECIPES else "rceil").upper()


def quantization_config(layers: dict[str, LayerQuant], unquantized: list[str], kv: bool = False,
                        recipes: dict[str, str] | None = None) -> dict:
    """TorchAoConfig(...).to_dict() of the one torchao config every layer was made with. ``recipes``
    (layer -> recipe, when exporting) gives MX's ScaleCalculationMode (RCEIL, the config's default,
    without it: a checkpoint written again keeps its own config, ``carry_config``)."""
    if kv:
        raise CheckpointError(f"{NAME}: {KV_REFUSAL}")
    kinds = {(q.weight_strategy, q.input, q.weight_fmt) for q in layers.values()}
    modes = {_mode((recipes or {}).get(n)) for n, q in layers.items() if q.weight_strategy == "mx"}
    if len(kinds) != 1 or len(modes) > 1:
        raise CheckpointError(f"{NAME}: TorchAoConfig holds one config for every layer; got "
                              f"{sorted(map(str, kinds | {('mode', m) for m in modes}))}")
    for q in layers.values():
        why = cannot_express(q)
        if why:
            raise CheckpointError(f"{NAME}: {why}")
    strategy, inp, fmt = kinds.pop()
    if strategy == "mx":
        return ta.mx_quantization_config(fmt, modes.pop())
    if strategy == "nvfp4":
        used = sorted(set((recipes or {}).values()) or {NVFP4_RECIPES[0]})
        if len(used) > 1 or used[0] not in NVFP4_RECIPES:
            raise CheckpointError(f"{NAME}: TorchAoConfig holds one NVFP4 config for every layer (with the "
                                  f"per-tensor scale, recipe {NVFP4_RECIPES[0]}, or without, {NVFP4_RECIPES[1]}); "
                                  f"got recipes {used}")
        return ta.nvfp4_quantization_config(per_tensor_scale=used[0] == NVFP4_RECIPES[0])
    return ta.quantization_config(strategy, inp)


def shard_metadata(metadata: dict | None, layers: dict, plain: list[str]) -> dict:
    """A shard's __metadata__ with each written layer's torchao description (``layers``: name ->
    (LayerQuant, [out, in], model dtype[, recipe])), ``{"_type": "Tensor"}`` for each ``plain`` tensor and
    torchao's ``tensor_names``, as flatten_tensor_state_dict writes them."""
    import json

    out = dict(metadata or {})
    for name in plain:
        out.setdefault(name, json.dumps({"_type": "Tensor"}))
    for name, (quant, (rows, cols), dtype, *recipe) in layers.items():
        if quant.weight_strategy == "mx":
            out[f"{name}.weight"] = ta.mx_description(quant.weight_fmt, dtype, _mode(recipe[0] if recipe else None))
            continue
        if quant.weight_strategy == "nvfp4":
            with_m = (recipe or [None])[0] != NVFP4_RECIPES[1]  # rewritten: descriptions are copied, not made
            out[f"{name}.weight"] = ta.nvfp4_description(dtype, per_tensor_scale=with_m)
            continue
        block = (1, cols) if quant.weight_strategy == "channel" else (rows, cols)
        out[f"{name}.weight"] = ta.float8_description(block, dtype, quant.input, quant.weight_strategy)
    names = json.loads(out.get("tensor_names", "[]")) if isinstance(out.get("tensor_names"), str) else []
    new = [f"{n}.weight" for n in layers] + list(plain)
    out["tensor_names"] = json.dumps(names + [n for n in new if n not in names])
    return out


KV_REFUSAL = "TorchAoConfig has no KV-cache scale field"
# where torchao 0.18.0's F.linear stops on CPU (tools/make_torchao_block_fixtures.py prints it)
FORWARD_STOPS = {"mx": "MXFP8: torch._scaled_mm 'Invalid scaling configuration'; MXFP4: 'CPU does not support "
                       "swizzle'; E5M2 / FP6: an AssertionError choosing the kernel",
                 "nvfp4": "'mslk is required for NVFP4 triton quantization' for its dynamic NVFP4 inputs"}


def own_recipe(desc: dict) -> str:
    """The recipe a description names: its ScaleCalculationMode (RCEIL, the config's default, when no
    activation kwargs record it), or NVFP4 with or without the per-tensor scale."""
    if desc["kind"] == "mx":
        return f"torchao-mx-{(desc['mode'] or 'RCEIL').lower()}"
    return NVFP4_RECIPES[0] if desc["tensor_scale"] else NVFP4_RECIPES[1]


class TorchAoBlockLayer(QuantizedLayer):
    """An MXTensor / NVFP4Tensor layer: codes unpacked as torchao stores them (FP6 one a byte), block
    scales unswizzled, the NVFP4 per-tensor scale a multiplier (1 where none is stored)."""

    def __init__(self, checkpoint, entry: LayerEntry):
        self.description = description(checkpoint.store, entry.name)
        super().__init__(checkpoint, entry)
        if entry.quant.weight_strategy in BLOCK_SCALED:
            self.shape = block_shape(checkpoint.store, entry)
            self.scheme = self.scheme.replace(recipe=own_recipe(self.description))


    def read_weight_codes(self, *, mapped: bool = False) -> np.ndarray:
        if self.quant.weight_strategy not in BLOCK_SCALED:
            return super().read_weight_codes(mapped=mapped)
        store, name = self._ckpt.store, self.tensors["weight"]
        raw = np.asarray(store.get(name)).view(np.uint8)
        fmt = self.quant.weight_fmt
        codes = unpack_nibbles(raw) if fmt == "float4_e2m1fn" else raw
        if fmt.startswith("float6") and (codes > 0x3F).any():
            idx = tuple(int(i) for i in np.argwhere(codes > 0x3F)[0])
            raise CheckpointError(f"{store.where(name)}: byte {int(codes[idx]):#04x} at {list(idx)} is not a 6-bit "
                                  f"{fmt} code (torchao stores one code in the low 6 bits of each byte)")
        n, idx = nan_count(codes, fmt)
        if n:
            raise CheckpointError(f"{store.where(name)}: {n} NaN codes (first at {list(idx)}); a quantized weight "
                                  f"must be finite")
        return codes

    @property
    def weight_scale_codes(self) -> np.ndarray:
        if self.quant.weight_strategy not in BLOCK_SCALED:
            return super().weight_scale_codes
        store, name = self._ckpt.store, self.tensors["weight_scale"]
        out, inp = self.shape
        cols = inp // BLOCK_SCALED[self.quant.weight_strategy][0]
        raw = np.asarray(store.get(name)).view(np.uint8)
        if not self.description["swizzled"]:
            return raw.reshape(out, cols)
        codes, zero_padded = ta.unswizzle(raw, out, cols)
        if not zero_padded:
            raise CheckpointError(f"{store.where(name)}: nonzero bytes in the padding of the swizzled 128x4 tiles "
                                  f"(torchao pads with zeros): not a torchao scale layout")
        return np.ascontiguousarray(codes)

    @property
    def weight_scale(self) -> np.ndarray:
        if self.quant.weight_strategy not in BLOCK_SCALED:
            return super().weight_scale
        codes = self.weight_scale_codes
        name = self._ckpt.store.where(self.tensors["weight_scale"])
        if self.quant.weight_strategy == "mx":
            if (codes == 0xFF).any():
                raise CheckpointError(f"{name}: E8M0 NaN scale bytes (0xff): torchao writes them for a block "
                                      f"holding NaN; the layer cannot be dequantized")
            return e8m0_value(codes.astype(np.int64) - 127)
        values = decode(codes, "float8_e4m3fn").astype(np.float32)
        if not np.isfinite(values).all() or (values <= 0).any():
            first = tuple(int(i) for i in np.argwhere(~(values > 0))[0])
            raise CheckpointError(f"{name}: block scale {float(values[first])!r} at {list(first)}: torchao stores NaN "
                                  f"block scales for an all-zero tensor (its per-tensor scale is 0); the layer cannot "
                                  f"be dequantized")
        return values

    @property
    def weight_global(self) -> np.ndarray | None:
        if self.quant.weight_strategy != "nvfp4":
            return super().weight_global
        name = self.tensors.get("weight_global")
        if name is None:
            return np.ones(1, np.float32)  # no per-tensor scale: q * s_b
        g = np.asarray(self._ckpt.store.get(name), np.float32).reshape(1)
        if not (np.isfinite(g).all() and g[0] >= np.float32(2.0**-126)):
            raise CheckpointError(f"{self._ckpt.store.where(name)}: per-tensor scale {float(g[0])!r}: expected a "
                                  f"normal positive float32 (torchao stores 0 for an all-zero tensor)")
        return g


class TorchAo(Defaults):
    name = NAME
    scales = (
        ScaleDecl("channel (Float8Tensor PerRow)", "_weight_scale", "multiplier", "F32", "[out, 1]", "-",
                  "D(amax/448) stored as fp32; 0 for an all-zero row (NaN codes, pytorch/ao #4713)"),
        ScaleDecl("tensor (Float8Tensor PerTensor)", "_weight_scale", "multiplier", "F32", "[1, 1]", "-",
                  "D(amax/448) stored as fp32; description JSON in __metadata__[M.weight]"),
        ScaleDecl("mx (MXTensor)", "_weight_scale", "E8M0 exponent", "F8_E8M0",
                  "[32 ceil(out/128), 16 ceil(in/128)] (swizzled)", "block_size 32",
                  "cuBLAS 128x4 tiles, zero padded; ScaleCalculationMode FLOOR/CEIL/RCEIL/EVEN: recipe "
                  "torchao-mx-<mode>"),
        ScaleDecl("nvfp4 (NVFP4Tensor)", "_weight_scale", "multiplier", "F8_E4M3",
                  "[32 ceil(out/128), 16 ceil(in/64)] (swizzled)", "block_size 16",
                  "E4M3 per 16, clamped below at 2^-6; W = q * fp32(m * s_b)"),
        ScaleDecl("nvfp4 (NVFP4Tensor)", "_weight_per_tensor_scale", "multiplier", "F32", "[]", "-",
                  "optional: m = fp32(amax)/2688 (compressed-tensors' global is its inverse, a divisor); "
                  "absent: 1"),
    )
    methods = (ta.METHOD,)
    detect_rank = 6
    scheme_scale_dtype = "float32"
    scales_follow_recipe = False
    kv_refusal = KV_REFUSAL
    known_recipes = (RECIPE,) + MX_RECIPES + NVFP4_RECIPES
    layer_class = TorchAoBlockLayer
    nvfp4_global = "multiplier"
    fuses_nvfp4_globals = False  # each weight's per-tensor scale is its own amax / 2688 (no fused q/k/v, gate/up)
    config_takes_recipes = True
    nvfp4_global_optional = True  # NVFP4Tensor(per_tensor_scale=None): recipe torchao-nvfp4-no-tensor-scale

    def carry_config(self, source: dict | None, qc: dict) -> dict:
        """Written again: torchao's config as the source holds it (MX's mode lives only there)."""
        return source if isinstance(source, dict) and source.get("quant_method") == ta.METHOD else qc

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        return False

    def recipe_of(self, quant: LayerQuant) -> str:
        return {"mx": "torchao-mx-rceil", "nvfp4": "torchao-nvfp4"}.get(quant.weight_strategy, RECIPE)

    def producer_refusal(self, quant: LayerQuant) -> str | None:
        if quant.weight_strategy in BLOCK_SCALED:
            kind = "MXTensor" if quant.weight_strategy == "mx" else "NVFP4Tensor"
            return (f"no producer emulation for torchao {kind} layers: torchao 0.18's own forward does not run on "
                    f"CPU ({FORWARD_STOPS[quant.weight_strategy]})")
        return "no producer emulation for torchao checkpoints (its CPU path quantizes activations only on GPU)"

    def original_weight(self, layer, store: TensorStore):
        key = f"{layer.name}.weight"
        if key not in store:
            raise CheckpointError(f"{store.root}: no tensor {key!r} for the quantized layer {layer.name!r}")
        return store.get(key)

    layers = staticmethod(layers)
    check_layer = staticmethod(check_layer)
    cannot_express = staticmethod(cannot_express)
    tensor_plan = staticmethod(tensor_plan)
    store_block = staticmethod(store_block)
    quantization_config = staticmethod(quantization_config)
    shard_metadata = staticmethod(shard_metadata)


register(TorchAo())
