"""What a quantized layer looks like on disk, independent of the producer.

``LayerQuant`` is the storage-level description every format module maps its config onto:
weight format and granularity, and how the layer's input is quantized. ``LayerEntry`` ties one
layer to the tensor names that hold it. ``check_layer`` validates a layer against the
safetensors headers (names, dtypes, shapes) and, when asked, the scale values; every message
names the file and the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

import numpy as np

from ..codec import decode
from ..errors import CheckpointError
from ..formats import FORMATS
from ..io.safetensors import DTYPES, PACKINGS, TensorStore
from ..limits import MAX_GROUP, int_in, shown
from ..rounding import FLOAT_FORMATS
from ..scheme import QuantizationScheme

FLOAT_SCALE_DTYPES = ("F32", "BF16", "F16")
# nvfp4: E4M3 scales per 16 along K under a per-tensor global scale; mx: E8M0 (uint8 biased exponent)
# scales per 32 along K. FP4 elements are stored packed two per byte, low nibble = even element; FP6
# (E2M3, compressed-tensors 0.20 MX) four per 3 bytes (fp8ref.io.safetensors.PACKINGS).
WEIGHT_STRATEGIES = ("tensor", "channel", "block", "nvfp4", "mx")
BLOCK_SCALED = {"nvfp4": (16, "F8_E4M3", "float8_e4m3fn"), "mx": (32, "U8", "float8_e8m0fnu")}
# nvfp4 input: per-16 scales computed at run time under a stored (static) global input scale
INPUT_MODES = ("static", "dynamic-tensor", "dynamic-token", "dynamic-group", "nvfp4", "mx")
GLOBAL_MEANINGS = ("divisor", "multiplier")
D_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class LayerQuant:
    """Storage-level quantization of one linear layer.

    ``input`` is None for weight-only layers, ``static`` for a stored per-tensor input scale, or a
    dynamic mode (per tensor, per token, per group of ``input_group`` elements of the last dim).
    """

    weight_strategy: str
    block: tuple[int, int] | None = None
    input: str | None = "static"
    input_group: int | None = None
    weight_fmt: str = "float8_e4m3fn"
    global_scale: str | None = None  # nvfp4: the stored global scales are a divisor or a multiplier
    input_fmt: str = "float8_e4m3fn"
    scale_fmt: str = "float"  # ue8m0: power-of-two weight scales (hf-fp8 scale_fmt, F32 or F8_E8M0 stored)

    @property
    def packed(self) -> bool:
        """Elements stored packed in uint8 (``fp8ref.io.safetensors.PACKINGS``): FP4 two per byte, low
        nibble = even element (compressed-tensors, ModelOpt); FP6 E2M3 four per 3 bytes (compressed-tensors 0.20)."""
        return self.weight_fmt in PACKINGS

    def packed_width(self, inp: int) -> int:
        """Bytes per row of a packed [out, inp] weight."""
        codes, nbytes = PACKINGS[self.weight_fmt]
        return inp * nbytes // codes

    def __post_init__(self) -> None:
        if (self.weight_strategy == "nvfp4") != (self.global_scale is not None):
            raise CheckpointError("global_scale (divisor or multiplier) must be given exactly for 'nvfp4' weights")
        if self.global_scale is not None and self.global_scale not in GLOBAL_MEANINGS:
            raise CheckpointError(f"global_scale {self.global_scale!r}: expected one of {GLOBAL_MEANINGS}")
        if self.input in ("nvfp4", "mx") and self.input != self.weight_strategy:
            raise CheckpointError(f"input mode {self.input!r} goes with {self.input} weights, "
                                  f"not {self.weight_strategy}")
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise CheckpointError(f"weight strategy {self.weight_strategy!r}: expected one of {WEIGHT_STRATEGIES}")
        if (self.weight_strategy == "block") != (self.block is not None):
            raise CheckpointError(f"block {self.block!r} must be given exactly for the 'block' strategy")
        if self.block is not None and not (len(self.block) == 2 and all(int_in(b, 1, MAX_GROUP)
                                                                        for b in self.block)):
            raise CheckpointError(f"block must be two ints in 1..{MAX_GROUP}, got {shown(self.block)}")
        if self.input is not None and self.input not in INPUT_MODES:
            raise CheckpointError(f"input mode {self.input!r}: expected None or one of {INPUT_MODES}")
        if (self.input == "dynamic-group") != (self.input_group is not None):
            raise CheckpointError("input_group must be given exactly for input mode 'dynamic-group'")
        if self.scale_fmt not in ("float", "ue8m0"):
            raise CheckpointError(f"scale_fmt {self.scale_fmt!r}: expected 'float' or 'ue8m0'")

    def scale_shape(self, out: int, inp: int) -> tuple[int, ...]:
        """The canonical (compressed-tensors) weight-scale shape for a [out, in] weight."""
        if self.weight_strategy == "tensor":
            return (1,)
        if self.weight_strategy == "channel":
            return (out, 1)
        if self.weight_strategy in BLOCK_SCALED:
            return (out, ceil(inp / BLOCK_SCALED[self.weight_strategy][0]))
        return (ceil(out / self.block[0]), ceil(inp / self.block[1]))

    def describe(self) -> str:
        w = self.weight_strategy if self.block is None else f"block{list(self.block)}"
        if self.global_scale:
            w += f" (global {self.global_scale})"
        a = "none" if self.input is None else self.input + (f"{self.input_group}" if self.input_group else "")
        if self.input in ("nvfp4", "mx") and self.input_fmt != "float8_e4m3fn":
            a += f" {self.input_fmt}"
        return f"W {self.weight_fmt} {w}, input {a}"


@dataclass
class LayerEntry:
    """One quantized layer: its module name, quantization, and tensor names by role
    (``weight``, ``weight_scale``, ``weight_global`` (nvfp4), ``input_scale`` (a static input
    scale, or nvfp4's global input scale), ``bias``)."""

    name: str
    quant: LayerQuant
    tensors: dict[str, str]
    producer: str
    accepted_scale_shapes: tuple[tuple[int, ...], ...] = ()
    group: str | None = None  # the config group / source that gave this layer its scheme
    # weight-scale dtypes beyond the float ones a float-scaled layer may store (hf-fp8 with
    # scale_fmt ue8m0: F8_E8M0 power-of-two multipliers)
    extra_scale_dtypes: tuple[str, ...] = ()
    # a run-time cap on the dynamic input amax (fbgemm_fp8's activation_scale_ub); None: none
    input_amax_ub: float | None = None


def model_dtype(config: dict | None, store: TensorStore) -> str:
    """The model dtype D: config ``dtype``/``torch_dtype``, else the dtype of the unquantized
    floating tensors (the most common one), else bfloat16."""
    if isinstance(config, dict):
        for key in ("dtype", "torch_dtype"):
            value = config.get(key)
            if isinstance(value, str) and value.removeprefix("torch.") in D_DTYPES:
                return value.removeprefix("torch.")
    counts: dict[str, int] = {}
    for name in store:
        dt = store.info(name).dtype
        if dt in FLOAT_SCALE_DTYPES:
            counts[dt] = counts.get(dt, 0) + 1
    if counts:
        best = max(counts, key=counts.get)
        return {v: k for k, v in D_DTYPES.items()}[best]
    return "bfloat16"


def accepted_scale_shapes(q: LayerQuant, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
    """Every shape some producer writes for this granularity (§3.2 of the reference)."""
    if q.weight_strategy == "tensor":
        return ((), (1,))
    if q.weight_strategy == "channel":
        return ((out,), (out, 1))
    return (q.scale_shape(out, inp),)


def weight_shape(store: TensorStore, entry: LayerEntry) -> tuple[int, ...]:
    """The logical [out, in] of a layer's weight (a packed FP4 weight stores [out, in / 2] bytes)."""
    shape = store.info(entry.tensors["weight"]).shape
    if not (entry.quant.packed and len(shape) == 2):
        return shape
    codes, nbytes = PACKINGS[entry.quant.weight_fmt]
    return (shape[0], shape[1] * codes // nbytes)


def _packed_form(packing: tuple[int, int]) -> str:
    codes, nbytes = packing
    return f"[out, in / {codes}]" if nbytes == 1 else f"[out, in * {nbytes} / {codes}]"


def check_layer(store: TensorStore, entry: LayerEntry, *, check_values: bool, dtype: str | None = None) -> None:
    """Validate one layer's tensors: presence, dtypes, shapes, and (optionally) scale values; a
    weight scale must not overflow the model ``dtype`` when it is given (``check_scale_values``)."""
    t = entry.tensors
    for role in ("weight", "weight_scale") + (("input_scale",) if entry.quant.input in ("static", "nvfp4") else ()):
        if role not in t or t[role] not in store:
            name = t.get(role, f"{entry.name}.{role}")
            where = store.where(t["weight"]) if t.get("weight") in store else f"{store.root}: layer {entry.name!r}"
            raise CheckpointError(f"{where}: missing tensor {name!r} ({entry.quant.describe()} needs it)")
    q = entry.quant
    w = store.info(t["weight"])
    fmt_dtype = "U8" if q.packed else next(k for k, v in DTYPES.items() if v.fmt == q.weight_fmt)
    if w.dtype != fmt_dtype:
        what = f"packed {q.weight_fmt} pairs" if q.packed else "a quantized weight"
        raise CheckpointError(f"{store.where(t['weight'])}: dtype {w.dtype}, expected {fmt_dtype} for {what}")
    packing = PACKINGS.get(q.weight_fmt, (1, 1))
    if len(w.shape) != 2:
        raise CheckpointError(f"{store.where(t['weight'])}: shape {list(w.shape)}, expected "
                              f"{_packed_form(packing) if q.packed else '[out, in]'}")
    if q.packed and w.shape[1] % packing[1]:
        raise CheckpointError(f"{store.where(t['weight'])}: packed shape {list(w.shape)}: {w.shape[1]} bytes per row "
                              f"is not a multiple of {packing[1]}; packed {q.weight_fmt} stores {packing[0]} codes "
                              f"in every {packing[1]} bytes")
    if 0 in w.shape:
        raise CheckpointError(f"{store.where(t['weight'])}: shape {list(w.shape)} holds no element; a quantized "
                              f"layer's weight is [out, in] with out, in >= 1")
    out, inp = weight_shape(store, entry)
    if q.packed and inp >= BLOCK_SCALED[q.weight_strategy][0] and inp % BLOCK_SCALED[q.weight_strategy][0]:
        block = BLOCK_SCALED[q.weight_strategy][0]
        raise CheckpointError(f"{store.where(t['weight'])}: packed shape {list(w.shape)} holds K = {inp} values per "
                              f"row ({packing[0]} per {packing[1]} bytes), not a multiple of the {block}-value "
                              f"{q.weight_strategy} block; "
                              f"producers pack whole blocks (compressed-tensors refuses any other K >= {block})")
    s = store.info(t["weight_scale"])
    scale_dtypes = ((BLOCK_SCALED[q.weight_strategy][1],) if q.weight_strategy in BLOCK_SCALED
                    else FLOAT_SCALE_DTYPES + entry.extra_scale_dtypes)
    if s.dtype not in scale_dtypes:
        raise CheckpointError(f"{store.where(t['weight_scale'])}: dtype {s.dtype}, expected "
                              f"{' or '.join(scale_dtypes)} for {q.weight_strategy} weight scales")
    if q.weight_strategy == "nvfp4":
        if "weight_global" not in t or t["weight_global"] not in store:
            raise CheckpointError(f"{store.where(t['weight'])}: missing tensor {t.get('weight_global')!r} "
                                  f"(the NVFP4 global weight scale, a {q.global_scale})")
        _check_global(store, t["weight_global"])
    shapes = entry.accepted_scale_shapes or accepted_scale_shapes(entry.quant, out, inp)
    if s.shape not in shapes:
        raise CheckpointError(f"{store.where(t['weight_scale'])}: shape {list(s.shape)} does not fit "
                              f"{entry.quant.describe()} of a [{out}, {inp}] weight; expected "
                              f"{' or '.join(str(list(x)) for x in shapes)}")
    if "input_scale" in t and t["input_scale"] in store:
        if entry.quant.input not in ("static", "nvfp4"):
            raise CheckpointError(f"{store.where(t['input_scale'])}: present, but the config says the "
                                  f"input is {entry.quant.input or 'not quantized'}")
        i = store.info(t["input_scale"])
        if entry.quant.input == "nvfp4":
            _check_global(store, t["input_scale"])
        elif i.dtype not in FLOAT_SCALE_DTYPES or i.shape not in ((), (1,)):
            raise CheckpointError(f"{store.where(t['input_scale'])}: {i.dtype} {list(i.shape)}, expected "
                                  f"a per-tensor scale: one of {FLOAT_SCALE_DTYPES}, shape [] or [1]")
    if "bias" in t and t["bias"] in store:
        b = store.info(t["bias"])
        if b.dtype not in FLOAT_SCALE_DTYPES or b.shape != (out,):
            raise CheckpointError(f"{store.where(t['bias'])}: {b.dtype} {list(b.shape)}, expected a "
                                  f"float [{out}] bias")
    if check_values:
        for role in ("weight_scale", "weight_global", "input_scale"):
            if role in t and t[role] in store:
                fmt = BLOCK_SCALED[q.weight_strategy][2] if role == "weight_scale" and q.weight_strategy in \
                    BLOCK_SCALED else None
                values = check_scale_values(store, t[role], fmt, model_dtype=weight_scale_dtype(q, role, dtype),
                                            elem_fmt=q.weight_fmt)
                if role == "weight_global" or (role == "input_scale" and q.input == "nvfp4"):
                    check_global_values(store, t[role], values, q, weight=role == "weight_global", dtype=dtype)


def weight_scale_dtype(q: LayerQuant, role: str, dtype: str | None) -> str | None:
    """The model dtype a scale's dequantized range is checked against: a weight's one-level scale
    only (it is bounded by the weights it was taken from, in D; activation and KV-cache amax come
    from calibration, which may run wider than D; two-level block scales are left to their format)."""
    return dtype if role == "weight_scale" and q.weight_strategy not in BLOCK_SCALED else None


def _check_global(store: TensorStore, name: str) -> None:
    g = store.info(name)
    if g.dtype != "F32" or g.shape not in ((), (1,)):
        raise CheckpointError(f"{store.where(name)}: {g.dtype} {list(g.shape)}, expected an NVFP4 global "
                              f"scale: F32, shape [] or [1]")


def check_global_values(store: TensorStore, name: str, values: np.ndarray, q: LayerQuant, *, weight: bool,
                        dtype: str | None = None) -> None:
    """An NVFP4 global scale (already positive and finite) must be a normal float32: a denormal
    divisor makes every block scale divided by it overflow. A weight's global must also keep the
    largest dequantized weight (FP4's 6 times E4M3's 448, times the multiplier or over the divisor)
    inside the model ``dtype`` (float32 when not given)."""
    v = float(np.asarray(values, np.float64).reshape(-1)[0])
    if v < 2.0**-126:
        raise CheckpointError(f"{store.where(name)}: NVFP4 global scale {v!r} is a denormal float32 (below "
                              f"2**-126); a global {q.global_scale or 'scale'} must be a normal number")
    if weight:
        top = FORMATS[q.weight_fmt].max * FORMATS[BLOCK_SCALED[q.weight_strategy][2]].max
        largest = top * v if (q.global_scale or "multiplier") == "multiplier" else top / v
        limit = FLOAT_FORMATS[dtype or "float32"].max
        if largest > limit * (1 + OVERFLOW_SLACK):
            raise CheckpointError(f"{store.where(name)}: NVFP4 global weight {q.global_scale} {v!r} makes the largest "
                                  f"dequantized weight {top:g} {'*' if q.global_scale != 'divisor' else '/'} {v!r} = "
                                  f"{largest:.4g}, past {dtype or 'float32'}'s {limit:.4g}; dequantized weights "
                                  f"would be Inf")


def nan_count(codes: np.ndarray, fmt_name: str) -> tuple[int, tuple[int, ...] | None]:
    """How many codes of ``fmt_name`` are NaN, and the index of the first."""
    fmt = FORMATS[fmt_name]
    if not fmt.nan_codes:  # E2M1, E2M3, E3M2: no code is NaN (a 16M-code FP4 weight: 95 ms saved per read)
        return 0, None
    if fmt.specials == "fn" and fmt.signed:  # the common case, e4m3fn: magnitude all ones (fast path)
        if not _any_magnitude(codes, fmt.magnitude_mask):
            return 0, None
        mask = (codes & np.uint8(fmt.magnitude_mask)) == fmt.magnitude_mask
    else:
        table = np.zeros(256, dtype=bool)
        table[list(fmt.nan_codes)] = True
        mask = table[codes]
    n = int(np.count_nonzero(mask))
    return n, (tuple(int(i) for i in np.argwhere(mask)[0]) if n else None)


_NAN_CHUNK = 1 << 18  # codes per piece of the NaN scan: its temporary stays in cache


def _any_magnitude(codes: np.ndarray, mask: int) -> bool:
    """Whether any code's magnitude bits (``code & mask``) are all ones, one cache-sized piece at a
    time: no temporary the size of the weight (a fresh one is a page fault per 4 KiB)."""
    flat = codes.reshape(-1)
    part = np.empty(min(flat.size, _NAN_CHUNK), np.uint8)
    for lo in range(0, flat.size, _NAN_CHUNK):
        piece = part[:min(_NAN_CHUNK, flat.size - lo)]
        np.bitwise_and(flat[lo:lo + piece.size], np.uint8(mask), out=piece)
        if piece.max() == mask:
            return True
    return False


OVERFLOW_SLACK = 2.0**-6  # bf16 scales round by up to 2**-8 relative; a few roundings stay well under this


def check_scale_values(store: TensorStore, name: str, fmt: str | None = None, *, model_dtype: str | None = None,
                       elem_fmt: str = "float8_e4m3fn", allow_zero: bool = False) -> np.ndarray:
    """The scale values of tensor ``name`` as float64 (``fmt``: the codes' format, E4M3 or E8M0
    block scales stored as bytes), each checked to be positive and finite and, given the
    ``model_dtype``, small enough that the largest ``elem_fmt`` value times the scale fits in it (a
    k_proj scale of 3.39e38 made 16,251 weights Inf: absurd but finite). ``OVERFLOW_SLACK`` above
    the dtype's max is allowed: a producer whose amax is the dtype's max rounds amax / 448 up by up
    to half an ulp of the scale's dtype (float16 146.25 * 448 = 65520 rounds to Inf, and is real).
    ``allow_zero``: +0 is accepted too (a format whose producer stores 0 for an all-zero block)."""
    if fmt is not None:
        values = decode(np.asarray(store.get(name, bf16_bits=True)).view(np.uint8), fmt)
    else:
        values = np.asarray(store.float_values(name))
    values = values.astype(np.float64)
    bad = ~np.isfinite(values) | (values < 0) | ((values == 0) & (not allow_zero or np.signbit(values)))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0]) if values.ndim else ()
        v = float(values[idx] if values.ndim else values[()])
        what = "NaN" if np.isnan(v) else "infinite" if np.isinf(v) else "zero" if v == 0 else "negative"
        raise CheckpointError(f"{store.where(name)}: {int(bad.sum())} of {values.size} scale values are not "
                              f"positive finite numbers; first at index {list(idx)}: {v!r} ({what}); "
                              f"a dequantization scale must be > 0 and finite")
    if model_dtype is not None and values.size:
        out, top = FLOAT_FORMATS[model_dtype], FORMATS[elem_fmt].max
        over = values * top > out.max * (1 + OVERFLOW_SLACK)  # exact: float32 scale times an 8-bit float
        if over.any():
            idx = tuple(int(i) for i in np.argwhere(over)[0]) if values.ndim else ()
            v = float(values[idx] if values.ndim else values[()])
            raise CheckpointError(f"{store.where(name)}: {int(over.sum())} of {values.size} scale values overflow "
                                  f"the model dtype {model_dtype}: first at index {list(idx)}: {v!r} times "
                                  f"{elem_fmt}'s largest value {top:g} is {v * top:.4g}, past {model_dtype}'s "
                                  f"{out.max:.4g}; dequantized values would be Inf")
    return values


# --- QuantizationScheme <-> LayerQuant ---------------------------------------------------------

def to_scheme(quant: LayerQuant, recipe: str, scale_dtype: str = "model"):
    """The ``QuantizationScheme`` of a stored layer (the dict-like object users see)."""
    bits = FORMATS[quant.weight_fmt].bits
    fields = {"bits": bits, "data_type": "fp", "weight_format": quant.weight_fmt, "recipe": recipe,
              "weight_granularity": quant.weight_strategy, "scale_dtype": scale_dtype}
    if quant.block is not None:
        fields["block_shape"] = quant.block
    if quant.weight_strategy in BLOCK_SCALED:  # the family fixes grouping and scale dtype
        nv = quant.weight_strategy == "nvfp4"
        fields.update(data_type="nv_fp" if nv else "mx_fp", weight_granularity="tensor_group" if nv else "group",
                      group_size=BLOCK_SCALED[quant.weight_strategy][0],
                      scale_dtype=BLOCK_SCALED[quant.weight_strategy][2])
        if quant.input in ("nvfp4", "mx"):
            fields.update(act_bits=FORMATS[quant.input_fmt].bits, act_format=quant.input_fmt,
                          act_data_type="nv_fp4_with_static_gs" if nv else "mx_fp",
                          act_granularity=fields["weight_granularity"], act_group_size=fields["group_size"],
                          act_dynamic=True)
            return QuantizationScheme(**fields)
    if quant.input is None:
        fields["act_bits"] = 16
    else:
        gran = "tensor" if quant.input in ("static", "dynamic-tensor") else quant.input.removeprefix("dynamic-")
        fields.update(act_bits=8, act_data_type="fp", act_format="float8_e4m3fn", act_granularity=gran,
                      act_dynamic=quant.input != "static")
        if quant.input_group is not None:
            fields["act_group_size"] = quant.input_group
    return QuantizationScheme(**fields)


def from_scheme(scheme, where: str, nvfp4_global: str | None = "divisor") -> LayerQuant:
    """The storage layout a ``QuantizationScheme`` asks for; CheckpointError if no checkpoint
    layout can hold it. ``nvfp4_global``: how the target format stores NVFP4 global scales."""
    s = scheme
    if s.data_type in ("nv_fp", "mx_fp"):
        kind = "nvfp4" if s.data_type == "nv_fp" else "mx"
        if kind == "nvfp4" and nvfp4_global is None:
            raise CheckpointError(f"{where}: NVFP4 has no layout in this format")
        if s.quantizes_activations:
            act_kind = "nvfp4" if s.act_data_type.startswith("nv_fp") else "mx" if s.act_data_type == "mx_fp" else None
            if kind == "mx" and act_kind is None and s.act_dynamic and s.act_granularity == "group":
                # MX weights, FP8 inputs per 1 x group at run time (compressed-tensors 0.20 MXFP4XFP8)
                if s.act_format != "float8_e4m3fn":
                    raise CheckpointError(f"{where}: activation format {s.act_format}; checkpoints declare "
                                          f"float8_e4m3fn inputs")
                return LayerQuant(kind, None, "dynamic-group", s.act_group_size, weight_fmt=s.weight_format)
            if act_kind != kind:
                raise CheckpointError(f"{where}: {kind} weights with {s.act_data_type} activations have no "
                                      f"checkpoint layout; expected {kind} activations"
                                      f"{', dynamic FP8 groups' if kind == 'mx' else ''} or none")
        return LayerQuant(kind, None, kind if s.quantizes_activations else None, weight_fmt=s.weight_format,
                          global_scale=nvfp4_global if kind == "nvfp4" else None,
                          input_fmt=s.act_format if s.quantizes_activations else "float8_e4m3fn")
    if s.data_type != "fp" or s.bits != 8:
        raise CheckpointError(f"{where}: data_type {s.data_type!r} bits {s.bits}; checkpoints hold FP8 "
                              f"('fp', 8 bits) layers")
    if s.weight_granularity not in WEIGHT_STRATEGIES:
        raise CheckpointError(f"{where}: weight granularity {s.weight_granularity!r}; FP8 checkpoints store "
                              f"tensor, channel or block scales")
    if not s.quantizes_activations:
        return LayerQuant(s.weight_granularity, s.block_shape, None, None, s.weight_format)
    if s.act_format != "float8_e4m3fn":
        raise CheckpointError(f"{where}: activation format {s.act_format}; checkpoints declare float8_e4m3fn inputs")
    if not s.act_dynamic:
        if s.act_granularity != "tensor":
            raise CheckpointError(f"{where}: static {s.act_granularity} activation scales cannot be stored; "
                                  f"a checkpoint holds one static input_scale per layer (act_group_size 0)")
        mode, group = "static", None
    else:
        mode = f"dynamic-{s.act_granularity}"
        group = s.act_group_size if s.act_granularity == "group" else None
        if mode not in INPUT_MODES:
            raise CheckpointError(f"{where}: dynamic {s.act_granularity} activations have no checkpoint form")
    return LayerQuant(s.weight_granularity, s.block_shape, mode, group, s.weight_format)
