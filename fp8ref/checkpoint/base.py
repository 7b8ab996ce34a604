"""The ``CheckpointFormat`` protocol and the registry of formats.

A format is one object, registered once with ``register``: how to recognise its checkpoints
(``methods``: the ``quant_method`` values of its config; ``detect``: from tensor names alone),
which layers a checkpoint holds (``layers``), what else to check once the layout is valid
(``validate``), how a layer is stored (``cannot_express``, ``tensor_plan``: the export plan) and
what config it writes (``quantization_config``, ``extra_files``). Loader, export, CLI and forward
ask the registry; nothing else dispatches on a format's name. A new format is one module in
``fp8ref.producers`` (its config vocabulary) plus one registered class here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import CheckpointError
from ..io.safetensors import TensorStore
from .layout import LayerEntry, LayerQuant, weight_shape

Plan = list[tuple[str, str, str, tuple]]  # (role, tensor name, safetensors dtype, shape)
MEANINGS = ("multiplier", "divisor", "E8M0 exponent")


@dataclass(frozen=True)
class ScaleDecl:
    """What one stored scale tensor means, declared once per format (docs/checkpoints.md's scale
    table is generated from these; tests check them against the committed fixtures).

    ``meaning``: ``multiplier`` (x ~ q * s), ``divisor`` (x ~ q * ... / g) or ``E8M0 exponent``
    (a uint8 biased exponent b: multiplier 2**(b - 127)). ``dtype``/``shape`` as stored
    (``D``: the model dtype); ``block``: where the block size comes from."""

    layout: str          # the layers it applies to (a LayerQuant.weight_strategy, optionally qualified)
    tensor: str          # tensor name suffix after the module name
    meaning: str
    dtype: str
    shape: str
    block: str = "-"
    note: str = ""


class CheckpointFormat(Protocol):
    name: str
    methods: tuple[str, ...]  # quant_method values that name this format in a config
    detect_rank: int  # order of the config-less guesses (``detect``), lowest first
    scheme_scale_dtype: str  # the scale_dtype field of its layers' schemes: "model" or "float32"
    scales_follow_recipe: bool  # export stores scales in the recipe's dtype (False: the plan's own)
    kv_refusal: str | None  # why fp8ref cannot write KV-cache scales in this format (None: it can)
    scales: tuple[ScaleDecl, ...]  # what each stored scale means (the one declaration of it)
    # mode="producer" forward: (layer, D weight from forward.producer_weight, fp32 input, D) -> (weight,
    # input) as the producer's loader prepares them; None when no producer emulation is modelled
    emulate: Callable | None
    # Defaults supplies these: config_files (files besides config.json it owns), nvfp4_global
    # (divisor | multiplier | None), recipe_of(quant) (the recipe reproducing its bytes),
    # producer_refusal(quant) (why mode="producer" cannot run such a layer, or None), the KV-cache
    # vocabulary (kv_name, kv_shape, kv_store, kv_recipe, kv_shared), kv_tensor(name, shape) (a
    # loaded KV scale's name and shape when written in this format), input_recipe(entry) (dynamic
    # inputs' recipe) and carry_config(source, qc) (config fields kept on a rewrite)

    def detect(self, store: TensorStore, fp8_layers: list[str]) -> bool:
        """Without a config: do float8 weights with these tensor names look like this format?"""

    def layers(self, qc: dict | None, store: TensorStore, where: str,
               warnings: list[str]) -> tuple[list[LayerEntry], dict[str, str]]:
        """The quantized layers and KV-cache scales (name -> tensor) ``qc`` describes (None: inferred)."""

    def validate(self, store: TensorStore, entries: list[LayerEntry], warnings: list[str]) -> None:
        """Value checks after the layout is valid (producer quirks become warnings)."""

    def cannot_express(self, quant: LayerQuant) -> str | None:
        """Why this format cannot store ``quant`` (None: it can)."""

    def tensor_plan(self, name: str, quant: LayerQuant, out: int, inp: int, dtype: str) -> Plan:
        """The tensors of one layer (export and rewrite write exactly these)."""

    def quantization_config(self, layers: dict[str, LayerQuant], unquantized: list[str], kv: bool | str = False,
                            **options) -> dict:
        """The config for ``layers``, ``unquantized`` linear layers left in the model dtype; ``options``:
        ``version`` for a format in ``config_versions`` (``config_options``). ``kv``: KV-cache scales
        per tensor (True) or, in a ``kv_per_head`` format only, ``"attn_head"``."""

    def extra_files(self, qc: dict) -> dict[str, dict]:
        """Files besides config.json that carry the config (file name -> JSON object)."""


def config_options(module, version: str | None) -> dict:
    """The ``quantization_config`` options for writing ``module``'s format as its producer ``version``
    writes it (None: the format's default, the newest)."""
    if version is None:
        return {}
    if version not in module.config_versions:
        known = (f"one of {', '.join(module.config_versions)}" if module.config_versions else
                 "none: the format has one config writer")
        raise CheckpointError(f"config version {version!r} for the {module.name} format: expected {known}")
    return {"version": version}


class Defaults:
    """What a format without producer quirks, extra config files or producer emulation inherits."""

    emulate = None
    # dequantize(mode="producer"): (layer, D) -> float32 holding the D weight the producer's own
    # dequantization gives, its signed-zero convention included; None: forward.producer_weight
    producer_dequantize = None
    # block scales of 0 are valid (llama.cpp's NVFP4 stores 0 for an all-zero block: it dequantizes to 0)
    zero_block_scales = False
    # the recipes verify tries, in order, when a checkpoint records none (None: every recipe for the
    # layer's granularity and format, the format's recipe_of first)
    known_recipes: tuple[str, ...] | None = None
    # (regex, replacement) pairs: a producer's tensor name -> the original model's (verify --original)
    original_names: tuple[tuple[str, str], ...] = ()
    # mode="producer" after the D matmul: (layer, fp32 y holding D values, D) -> y as the producer's
    # output quantizer leaves it (Quark's k/v_proj KV-cache fake quantization); None: y as it is
    emulate_output = None
    # mode="producer" of one MoE expert's projection: (layer, D) -> the D weight the producer's reload puts
    # in the model's fused experts (which it runs unquantized, no activation quantization); None: not modelled
    emulate_experts = None
    # mode="producer" attention: the producer's reload fake-quantizes K and V with the stored KV-cache
    # scales (compressed-tensors' forward_quantize); False: its reload drops them (auto-round 0.16.1)
    kv_reload_quantizes = True
    kv_producer_refusal: str | None = None  # why mode="producer" cannot run its KV cache (None: it can)
    config_files: tuple[str, ...] = ()  # files besides config.json that carry its config (extra_files' names)
    # the producer versions whose config writer it reproduces (quantization_config(..., version=)); () : one
    config_versions: tuple[str, ...] = ()
    nvfp4_global: str | None = None  # how it stores NVFP4 global scales: divisor, multiplier (None: no NVFP4)
    fuses_nvfp4_globals = True  # NVFP4 global scales shared across fused siblings (q/k/v, gate/up); torchao: not
    config_takes_recipes = False  # quantization_config(..., recipes={layer: recipe}) at export (torchao's MX mode)
    nvfp4_global_optional = False  # an NVFP4 layer may store no global scale (torchao's NVFP4Tensor without one)
    pow2_scale_fmt: str | None = None  # the LayerQuant.scale_fmt of layers a power-of-two recipe quantizes
    # KV-cache scales (one K and one V multiplier per attention module), compressed-tensors' by default:
    kv_shape: tuple = (1,)
    kv_store: str | None = None  # the stored dtype: None (the recipe's: D or F32), "F32", or "model" (D)
    # the producer's own KV rule (a recipe name), or None: the recipe= override, else the k/v projection's
    # recipe, else compressed-tensors'
    kv_recipe: str | None = None
    kv_shared: bool = False  # K and V of one module store one value, the larger scale (Quark's kv_cache_group)
    kv_per_head: bool = False  # it can store one K and one V scale per KV head ([n_kv_heads, 1, 1], attn_head)
    kv_query: bool = False  # it can store the query's scale (ATTN.q_scale: compressed-tensors' attention group)

    def kv_name(self, attn: str, which: str) -> str:
        """The tensor holding attention module ``attn``'s ``which`` ("k" / "v") KV-cache scale."""
        return f"{attn}.{which}_scale"

    def kv_tensor(self, name: str, shape: tuple) -> tuple[str, tuple]:
        """(name, shape) a loaded KV-cache scale (any format's name) gets when written in this format;
        a per-head scale keeps one value per head ([n, 1, 1]) where the format stores them."""
        attn, which = kv_parts(name)
        if which == "q" and not self.kv_query:
            raise CheckpointError(f"{name}: a query scale; the {self.name} format stores none (compressed-tensors "
                                  f"does, in an attention config group)")
        n = int(np.prod(shape))
        if n > 1 and not self.kv_per_head:
            raise CheckpointError(f"{name}: one KV-cache scale per head ({list(shape)}); the {self.name} format "
                                  f"stores one per tensor")
        return self.kv_name(attn, which), (n, 1, 1) if n > 1 else self.kv_shape

    def recipe_of(self, quant: LayerQuant) -> str:
        """The recipe that reproduces this format's bytes for ``quant`` (the layers' scheme recipe)."""
        return self.name

    def producer_refusal(self, quant: LayerQuant) -> str | None:
        """Why mode="producer" cannot run a layer of ``quant`` (None: it can): known before any forward,
        so a whole-model run stops at once, naming the layer."""
        if self.emulate is None:
            return f"no producer emulation for {self.name!r} checkpoints; use mode='reference'"
        return None

    def input_recipe(self, entry: LayerEntry):
        """The recipe a dynamic input is quantized with in mode="reference" (None: fp8ref's)."""
        return None

    def block_input_recipe(self, quant: LayerQuant) -> str:
        """The recipe an NVFP4 / MX input is quantized with at run time (the weights' by default)."""
        return self.recipe_of(quant)

    def config_version_of(self, source: dict | None) -> str | None:
        """The ``config_versions`` entry whose writer wrote ``source`` (a loaded quantization_config of
        this format), kept when the checkpoint is written again (None: the newest)."""
        return None

    def carry_config(self, source: dict | None, qc: dict) -> dict:
        """``qc`` for a checkpoint of this format written again: the config fields of ``source``
        (its loaded quantization_config) that no LayerQuant holds (FBGEMM's activation_scale_ub)."""
        return qc

    def validate(self, store: TensorStore, entries: list[LayerEntry], warnings: list[str]) -> None:
        pass

    def extra_files(self, qc: dict) -> dict[str, dict]:
        return {}


_FORMATS: dict[str, CheckpointFormat] = {}
# every format's KV-cache scale names: compressed-tensors' ATTN.k_scale, ModelOpt's ATTN.k_proj.k_scale,
# Quark's (and old compressed-tensors') ATTN.k_proj.output_scale
_KV_NAMES = (re.compile(r"^(.+)\.([kv])_proj\.(?:output_scale|\2_scale)$"), re.compile(r"^(.+)\.([kvq])_scale$"))


def kv_parts(name: str) -> tuple[str, str]:
    """(attention module, "k" | "v" | "q") of a KV-cache (or query) scale tensor name in any format's
    vocabulary."""
    m = _KV_NAMES[0].match(name) or _KV_NAMES[1].match(name)
    if m is None:
        raise CheckpointError(f"{name}: not a K, V or Q scale (ATTN.k_scale, ATTN.k_proj.k_scale, "
                              "ATTN.k_proj.output_scale or ATTN.q_scale)")
    return m.group(1), m.group(2)


def scale_table() -> str:
    """The markdown table of every registered format's declared scales (docs/checkpoints.md)."""
    rows = ["| format | layers | tensor | meaning | dtype | shape | block size from | note |",
            "|---|---|---|---|---|---|---|---|"]
    for f in _FORMATS.values():
        for d in f.scales:
            rows.append(f"| {f.name} | {d.layout} | `{d.tensor}` | {d.meaning} | {d.dtype} | {d.shape} | {d.block} "
                        f"| {d.note} |")
    return "\n".join(rows) + "\n"


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    if fmt.name in _FORMATS:
        raise CheckpointError(f"checkpoint format {fmt.name!r} is registered twice")
    bad = [d for d in fmt.scales if d.meaning not in MEANINGS]
    if not fmt.scales or bad:
        raise CheckpointError(f"checkpoint format {fmt.name!r}: declare its scales (ScaleDecl, meaning one of "
                              f"{MEANINGS}); got {bad or 'none'}")
    _FORMATS[fmt.name] = fmt
    return fmt


def names() -> tuple[str, ...]:
    return tuple(_FORMATS)


def get(name: str) -> CheckpointFormat:
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"format: {name!r}; expected one of {', '.join(_FORMATS)}") from None


def by_method(method: object) -> CheckpointFormat | None:
    return next((f for f in _FORMATS.values() if method in f.methods), None)


def methods() -> list[str]:
    return [m for f in _FORMATS.values() for m in f.methods]


def by_detection() -> list[CheckpointFormat]:
    return sorted(_FORMATS.values(), key=lambda f: f.detect_rank)


# --- what the formats share -----------------------------------------------------------------

def fp8_weights(store: TensorStore) -> list[str]:
    """Module names whose ``.weight`` is stored in a float8 dtype."""
    return sorted(n[: -len(".weight")] for n in store
                  if n.endswith(".weight") and store.info(n).dtype.startswith("F8_"))


def is_float(store: TensorStore, name: str) -> bool:
    return store.info(name).dtype in ("F32", "BF16", "F16", "F64")


def unquantized_linears(store: TensorStore, quantized: set[str]) -> list[str]:
    """2-D float ``.weight`` tensors (linear-like) of modules that are not quantized, embeddings excluded."""
    out = []
    for n in store:
        if n.endswith(".weight") and is_float(store, n) and len(store.info(n).shape) == 2:
            module = n[: -len(".weight")]
            if module not in quantized and not re.search(r"embed|(^|\.)(wte|wpe)$", module):
                out.append(module)
    return sorted(out)


def scale_on_float_weight(store: TensorStore, modules: list[str], names: tuple[str, ...]) -> None:
    for m in modules:
        for suffix in names:
            if f"{m}.{suffix}" in store:
                raise CheckpointError(f"{store.where(m + '.weight')}: dtype {store.info(m + '.weight').dtype} "
                                      f"but {m}.{suffix} exists; a quantized weight must be float8")


def accept(store: TensorStore, entry: LayerEntry, scale_shapes) -> LayerEntry:
    """``entry`` with the scale shapes its format's loaders read correctly for its weight's
    [out, in] ((0, 0) when the weight is not 2-D: check_layer reports that)."""
    shape = weight_shape(store, entry) if entry.tensors["weight"] in store else ()
    entry.accepted_scale_shapes = scale_shapes(entry.quant, *(shape if len(shape) == 2 else (0, 0)))
    return entry


def plain_linears(store: TensorStore, entries: list[LayerEntry], scale_suffixes: tuple[str, ...]) -> list[str]:
    """The linear layers stored unquantized; none of them may carry a scale tensor."""
    plain = unquantized_linears(store, {e.name for e in entries})
    scale_on_float_weight(store, plain, scale_suffixes)
    return plain


def infer_block(store: TensorStore, suffix: str) -> tuple[int, int] | None:
    """The block size that explains every 2-D scale shape: the first of 128, 64, ..., 8 (per
    dimension) with ceil(n / b) == scale size; None when no layer has 2-D scales."""
    pairs = []
    for name in fp8_weights(store):
        w, s = store.info(f"{name}.weight"), store.info(f"{name}.{suffix}") if f"{name}.{suffix}" in store else None
        if s is not None and len(s.shape) == 2 and len(w.shape) == 2 and s.shape != (w.shape[0], 1):
            pairs.append((w.shape, s.shape))
    if not pairs:
        return None
    sizes = (128, 64, 32, 16, 8, 256)
    block = []
    for dim in (0, 1):
        fits = [b for b in sizes if all(-(-ws[dim] // b) == ss[dim] for ws, ss in pairs)]
        if not fits:
            raise CheckpointError(f"{store.root}: no quantization_config, and the {suffix} shapes fit no block "
                                  f"size; add the producer's quantization_config to config.json")
        block.append(fits[0])
    return block[0], block[1]


# --- the recipe a checkpoint was written with ---------------------------------------------------
# None of the formats has a config field for it, so fp8ref records it in each shard's safetensors
# metadata: {recipe name: [layer names]} as JSON, for the layers whose weight the shard holds.
RECIPE_METADATA = "fp8ref_recipes"


def with_recipes(metadata: dict | None, recipes: dict[str, str]) -> dict[str, str]:
    """A shard's metadata with ``recipes`` (layer -> recipe) recorded (none: ``metadata`` as it was)."""
    out = dict(metadata or {"format": "pt"})
    if recipes:
        by_recipe: dict[str, list[str]] = {}
        for layer, recipe in sorted(recipes.items()):
            by_recipe.setdefault(recipe, []).append(layer)
        out[RECIPE_METADATA] = json.dumps(by_recipe, sort_keys=True, separators=(",", ":"))
    return out


def recorded_recipes(store: TensorStore) -> dict[str, str]:
    """layer -> recipe as recorded by ``with_recipes`` in the shards' metadata; a malformed record is
    an error naming the file (it would otherwise pick the wrong recipe silently)."""
    out: dict[str, str] = {}
    for f in store.files.values():
        raw = (f.metadata or {}).get(RECIPE_METADATA)
        if raw is None:
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, list)
                                                and all(isinstance(n, str) for n in v) for k, v in doc.items()):
            raise CheckpointError(f"{f.path}: __metadata__.{RECIPE_METADATA}: expected a JSON object of recipe name "
                                  f"-> [layer names], got {raw[:80]!r}")
        out.update({layer: recipe for recipe, layers in doc.items() for layer in layers})
    return out


# --- where a layer's original weight is ----------------------------------------------------------
def original_name(fmt: CheckpointFormat, name: str, store: TensorStore) -> str | None:
    """The original tensor of checkpoint tensor ``name``: the same name, else the name the producer
    renamed it from (its format's ``original_names`` table, applied to the module part); None if neither."""
    if name in store:
        return name
    module, dot, leaf = name.rpartition(".")
    for pattern, repl in fmt.original_names:
        mapped = re.sub(pattern, repl, module)
        if mapped != module and f"{mapped}{dot}{leaf}" in store:
            return f"{mapped}{dot}{leaf}"
    return None


def original_key(layer, store: TensorStore) -> str | None:
    """The original tensor ``original_weight`` reads for checkpoint ``layer`` (the format's own
    ``original_key`` where it maps the weight itself: gpt-oss's fused experts), None if absent."""
    fmt = get(layer.producer)
    hook = getattr(fmt, "original_key", None)
    if hook is not None:
        key = hook(layer)
        return key if key in store else None
    return original_name(fmt, f"{layer.name}.weight", store)


def original_weight(layer, store: TensorStore, *, mapped: bool = False):
    """The original (unquantized) weight of checkpoint ``layer`` in ``store``, as [out, in] rows like its
    codes: the format's own mapping where it has one (gpt-oss's fused [E, in, out] experts), else
    ``NAME.weight`` under ``original_name`` (``mapped``: a read-only view of the mapped file, ``TensorStore.get``)."""
    fmt = get(layer.producer)
    hook = getattr(fmt, "original_weight", None)
    if hook is not None:
        return hook(layer, store)
    return store.get(_original_key(layer, fmt, store), mapped=mapped)


def original_values(layer, store: TensorStore, *, mapped: bool = False) -> tuple[np.ndarray, str]:
    """``original_weight`` as (array, dtype name), a BF16 tensor as its uint16 bit patterns with
    dtype 'bfloat16' (ml_dtypes not imported: ``fp8ref.quant.quantize_bits`` takes them so)."""
    fmt = get(layer.producer)
    hook = getattr(fmt, "original_weight", None)
    if hook is not None:
        w = np.asarray(hook(layer, store))
        return (w.view(np.uint16), "bfloat16") if w.dtype.name == "bfloat16" else (w, w.dtype.name)
    key = _original_key(layer, fmt, store)
    w = store.get(key, mapped=mapped, bf16_bits=True)
    return w, "bfloat16" if store.info(key).dtype == "BF16" else w.dtype.name


def _original_key(layer, fmt: CheckpointFormat, store: TensorStore) -> str:
    key = original_name(fmt, f"{layer.name}.weight", store)
    if key is None:
        renamed = " (nor under the names its producer renamed it from)" if fmt.original_names else ""
        raise CheckpointError(f"{store.root}: no tensor {layer.name + '.weight'!r} for the quantized layer "
                              f"{layer.name!r}{renamed}")
    return key


def refuse_fused(checkpoint, layer, fmt: CheckpointFormat) -> None:
    """Fused experts (gpt-oss's [E, out, in] projections) go only to a format that writes them as such
    (``layer_plan``): another format would hold them as one [E * out, in] linear no loader expects."""
    if getattr(layer, "experts", None) is not None and not hasattr(fmt, "layer_plan"):
        raise CheckpointError(f"{checkpoint.path}: layer {layer.name!r}: {layer.experts} fused experts; the {fmt.name} "
                              f"format stores per-expert linear layers, and fp8ref does not split fused experts")
