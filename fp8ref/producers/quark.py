"""The AMD Quark vocabulary (amd-quark 0.13 ``export_safetensors``): ``quant_method: quark`` with
``global_quant_config`` / ``layer_quant_config`` / ``kv_cache_quant_config`` (each a QLayerConfig of
``weight`` / ``input_tensors`` / ``output_tensors`` QTensorConfigs), ``exclude`` and ``export``.
One reader (``Config``) and one writer (``quantization_config``), checked against
tests/fixtures/interop/checkpoints/quark_*.

Two schemes are read and written, the ones the fixtures verify: FP8 per tensor (``dtype fp8_e4m3``,
``qscheme per_tensor``, static inputs, KV output scales on ``*k_proj``/``*v_proj``) and MXFP4
(``dtype fp4``, ``per_group`` 32, ``scale_format e8m0``, ``scale_calculation_mode even``, dynamic
MX inputs).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from ..errors import CheckpointError

NAME = "quark"
METHOD = "quark"
VERSION = "0.13"  # the Quark config version whose vocabulary this module reads and writes
KV_GROUP = ["*k_proj", "*v_proj"]
KNOWN_KEYS = {"algo_config", "exclude", "export", "global_quant_config", "kv_cache_post_rope",
              "kv_cache_quant_config", "layer_quant_config", "layer_type_quant_config", "quant_method",
              "quant_mode", "softmax_quant_spec", "version"}
SCHEMES = ("fp8", "mxfp4")  # fp8: weight_strategy tensor; mxfp4: mx


def fp8_tensor(scale_type: str | None = "float") -> dict:
    """The QTensorConfig Quark 0.13 writes for a static per-tensor FP8 E4M3 tensor."""
    return {"block_size": None, "ch_axis": None, "dtype": "fp8_e4m3", "enable_buffer_reuse": False,
            "group_size": None, "is_dynamic": False, "is_scale_quant": False, "max_input_numel": 4194304,
            "mx_element_dtype": None, "observer_cls": "PerTensorMinMaxObserver", "qscheme": "per_tensor",
            "round_method": "half_even", "scale_calculation_mode": None, "scale_format": None,
            "scale_type": scale_type, "symmetric": True, "zero_point_type": "int32"}


def mxfp4_tensor(dynamic: bool) -> dict:
    """The QTensorConfig Quark 0.13 writes for MXFP4 (E2M1 per 32 along the last dim, E8M0 'even')."""
    return {"block_size": None, "ch_axis": -1, "dtype": "fp4", "enable_buffer_reuse": False, "group_size": 32,
            "is_dynamic": dynamic, "is_scale_quant": False, "max_input_numel": 4194304, "mx_element_dtype": None,
            "observer_cls": "PerBlockMXObserver", "qscheme": "per_group", "round_method": "half_even",
            "scale_calculation_mode": "even", "scale_format": "e8m0", "scale_type": "float", "symmetric": None,
            "zero_point_type": "int32"}


def _tensor_kind(t: object, where: str) -> str | None:
    """'fp8' (static per tensor), 'fp8-dynamic' is refused, 'mxfp4' or None for a null QTensorConfig."""
    if t is None:
        return None
    if not isinstance(t, dict):
        raise CheckpointError(f"{where}: expected a QTensorConfig object or null, got {t!r:.80}")
    dtype, qscheme = t.get("dtype"), t.get("qscheme")
    if dtype == "fp8_e4m3" and qscheme == "per_tensor":
        if t.get("is_dynamic"):
            raise CheckpointError(f"{where}.is_dynamic: true; fp8ref reads static per-tensor FP8 Quark tensors")
        return "fp8"
    if dtype == "fp4" and qscheme == "per_group":
        for key, want in (("group_size", 32), ("scale_format", "e8m0"), ("ch_axis", -1)):
            if t.get(key) != want:
                raise CheckpointError(f"{where}.{key}: {t.get(key)!r}; Quark MXFP4 has {want!r}")
        mode = t.get("scale_calculation_mode")
        if mode != "even":
            raise CheckpointError(f"{where}.scale_calculation_mode: {mode!r}; fp8ref reads Quark's default "
                                  f"'even' (the rule the fixtures verify)")
        return "mxfp4"
    raise CheckpointError(f"{where}: dtype {dtype!r} qscheme {qscheme!r}; fp8ref reads Quark fp8_e4m3 "
                          f"per_tensor and fp4 per_group (MXFP4) tensors")


class LayerScheme:
    """One QLayerConfig: the scheme of the weight (``fp8``/``mxfp4``), how the input is quantized
    (``static`` / ``mx`` / None) and whether the output is (KV cache: ``output_tensors`` fp8)."""

    def __init__(self, lc: object, where: str):
        if not isinstance(lc, dict):
            raise CheckpointError(f"{where}: expected a QLayerConfig object, got {lc!r:.80}")
        self.weight = _tensor_kind(lc.get("weight"), f"{where}.weight")
        if self.weight is None:
            raise CheckpointError(f"{where}.weight: null; fp8ref reads weight-quantized Quark layers")
        inp = _tensor_kind(lc.get("input_tensors"), f"{where}.input_tensors")
        if inp is not None and inp != self.weight:
            raise CheckpointError(f"{where}.input_tensors: {inp} inputs with {self.weight} weights; fp8ref reads "
                                  f"matching schemes")
        if inp == "mxfp4" and not lc["input_tensors"].get("is_dynamic"):
            raise CheckpointError(f"{where}.input_tensors.is_dynamic: false; MXFP4 inputs are dynamic")
        self.input = None if inp is None else ("static" if inp == "fp8" else "mx")
        out = _tensor_kind(lc.get("output_tensors"), f"{where}.output_tensors")
        if out not in (None, "fp8"):
            raise CheckpointError(f"{where}.output_tensors: {out}; fp8ref reads FP8 per-tensor output (KV) scales")
        self.output = out == "fp8"


class Config:
    """A parsed ``quantization_config`` of ``quant_method: quark``."""

    def __init__(self, qc: dict, where: str, warnings: list[str]):
        unknown = sorted(set(qc) - KNOWN_KEYS)
        if unknown:
            warnings.append(f"{where}: keys {unknown} are not part of Quark's export config and were ignored")
        if qc.get("layer_type_quant_config"):
            raise CheckpointError(f"{where}.layer_type_quant_config: per-module-type schemes are not read by fp8ref")
        if qc.get("algo_config"):
            warnings.append(f"{where}.algo_config: set; pre-quantization algorithms (smoothing, rotation) change "
                            f"the stored weights but not how they are read")
        self.global_ = LayerScheme(qc.get("global_quant_config"), f"{where}.global_quant_config")
        layer = qc.get("layer_quant_config") or {}
        if not isinstance(layer, dict):
            raise CheckpointError(f"{where}.layer_quant_config: expected an object of pattern -> QLayerConfig")
        self.layer = {p: LayerScheme(c, f"{where}.layer_quant_config.{p}") for p, c in layer.items()}
        exclude = qc.get("exclude", [])
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise CheckpointError(f"{where}.exclude: expected a list of module names or patterns, got {exclude!r:.100}")
        self.exclude = exclude
        group = (qc.get("export") or {}).get("kv_cache_group", [])
        if not isinstance(group, list):
            raise CheckpointError(f"{where}.export.kv_cache_group: expected a list of patterns, got {group!r:.80}")
        self.kv_group = group

    def excluded(self, name: str) -> bool:
        return any(name == p or fnmatchcase(name, p) for p in self.exclude)

    def scheme_of(self, name: str) -> tuple[str, LayerScheme]:
        """(the config group that names ``name``, its scheme): the first matching layer_quant_config
        pattern, else global_quant_config."""
        for pattern, scheme in self.layer.items():
            if name == pattern or fnmatchcase(name, pattern):
                return pattern, scheme
        return "global_quant_config", self.global_


def quantization_config(scheme: str, exclude: list[str], kv: bool) -> dict:
    """config.json's ``quantization_config`` as Quark 0.13 writes it for one ``scheme`` (fp8 / mxfp4)
    over all layers, ``exclude`` left unquantized, ``kv``: FP8 output scales on k_proj / v_proj."""
    if scheme == "fp8":
        layer = {"bias": None, "input_tensors": fp8_tensor(), "output_tensors": None, "target_device": None,
                 "weight": fp8_tensor()}
    else:
        layer = {"bias": None, "input_tensors": mxfp4_tensor(True), "output_tensors": None, "target_device": None,
                 "weight": mxfp4_tensor(False)}
    kv_layers = {}
    if kv:
        kv_layers = {p: {"bias": None, "input_tensors": fp8_tensor(), "output_tensors": fp8_tensor(None),
                         "target_device": None, "weight": fp8_tensor()} for p in KV_GROUP}
    return {"algo_config": None, "exclude": list(exclude),
            "export": {"kv_cache_group": list(KV_GROUP) if kv else [], "min_kv_scale": 0.0, "pack_method": "reorder",
                       "weight_format": "real_quantized", "weight_merge_groups": None},
            "global_quant_config": layer, "kv_cache_post_rope": False, "kv_cache_quant_config": kv_layers,
            "layer_quant_config": {p: dict(c) for p, c in kv_layers.items()}, "layer_type_quant_config": {},
            "quant_method": METHOD, "quant_mode": "eager_mode", "softmax_quant_spec": None, "version": VERSION}
