"""Deliberately broken codecs for the meta-test: each wraps fp8ref's own (correct) encode
and breaks one rule, so any mismatch the harness reports is that rule's fault."""

import numpy as np

from fp8ref import codec, matmul, quant
from fp8ref.conformance import Backend
from fp8ref.formats import get_format
from fp8ref.golden import degenerate
from fp8ref.scaling import reduce_amax
from fp8ref.scheme import PRESETS

CAPS = {"encode": {"format": ("float8_e4m3fn",), "rounding": ("rne",), "saturate": (True, False),
                   "dtype": ("float32",)}}


class _Broken(Backend):
    capabilities = CAPS

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        return self.breaks(x, codec.encode(x, fmt, rounding=rounding, saturate=saturate))


class RoundHalfUp(_Broken):
    """Ties go toward +inf instead of to even."""

    name = "round-half-up"

    def breaks(self, x, codes):
        x64 = x.astype(np.float64)
        lo = codec.decode(codec.encode(x, "float8_e4m3fn", rounding="rdown"), "float8_e4m3fn").astype(np.float64)
        hi_codes = codec.encode(x, "float8_e4m3fn", rounding="rup")
        hi = codec.decode(hi_codes, "float8_e4m3fn").astype(np.float64)
        tie = np.isfinite(x64) & (lo != x64) & (2 * x64 == lo + hi)
        return np.where(tie, hi_codes, codes)


class OffByOneExponent(_Broken):
    """Normal results come out with their exponent field one too large."""

    name = "off-by-one-exponent"

    def breaks(self, x, codes):
        field = (codes & 0x7F) >> 3
        normal = (field >= 1) & (field < 14)
        return np.where(normal, codes + 8, codes).astype(np.uint8)


class FlushSubnormals(_Broken):
    """Subnormal results are flushed to a zero of the same sign."""

    name = "flush-subnormals"

    def breaks(self, x, codes):
        sub = ((codes & 0x78) == 0) & ((codes & 0x07) != 0)
        return np.where(sub, codes & 0x80, codes).astype(np.uint8)


class Raises(_Broken):
    """Fails on any input containing a negative zero."""

    name = "raises"

    def breaks(self, x, codes):
        if np.any((x == 0) & np.signbit(x)):
            raise RuntimeError("kernel launch failed")
        return codes


class ExitsInEncode(_Broken):
    """Correct on its first call; on its second its own code calls sys.exit(9) (a kernel wrapper
    that "handles" a failure by exiting). Four cases: rne/rtz x saturate."""

    name = "exits-in-encode"
    capabilities = {"encode": {**CAPS["encode"], "rounding": ("rne", "rtz")}}

    def __init__(self):
        self.calls = 0

    def breaks(self, x, codes):
        self.calls += 1
        if self.calls == 2:
            self.stop()
        return codes

    def stop(self):
        raise SystemExit(9)


class InterruptsInEncode(ExitsInEncode):
    """As ExitsInEncode, but raises KeyboardInterrupt itself (no Ctrl-C was pressed)."""

    name = "interrupts-in-encode"

    def stop(self):
        raise KeyboardInterrupt("cancelled by the kernel's watchdog")


class CtrlCInEncode(ExitsInEncode):
    """The user presses Ctrl-C while the backend computes: a real SIGINT reaches the process."""

    name = "ctrl-c-in-encode"

    def stop(self):
        import signal

        signal.raise_signal(signal.SIGINT)


class Nothing(Backend):
    name = "nothing"
    capabilities = {}


instance = RoundHalfUp()  # for the 'module:object' form


# --- backends whose own code fails while being loaded or asked what they implement: each must
# end as one BackendError line naming the backend, never a traceback or an exit of fp8ref.
class RaisesAtConstruction(Backend):
    name = "raises-at-construction"

    def __init__(self):
        raise RuntimeError("no device found")


class ExitsAtConstruction(Backend):
    name = "exits-at-construction"

    def __init__(self):
        raise SystemExit(3)


class RaisesInImplements(_Broken):
    name = "raises-in-implements"

    def implements(self, op, params):
        raise KeyError(op)


def exits_factory():
    import sys

    sys.exit("bye")


# --- scaled_mm: each computes torch's CPU model (scales into the operands, an fp32 sum) in its
# own way and breaks one thing; all declare an unspecified order, so they are judged by the
# fp32-order bound against fp8ref's exact result (docs/conformance.md).
MM_CAPS = {"scaled_mm": {"format": ("float8_e4m3fn",), "scales": ("tensor", "row"),
                         "out_dtype": ("float32", "bfloat16"), "accumulate": ("fp32",),
                         "scale_order": ("operands",), "bias": (False, True)}}


def _out(acc32, bias, out_dtype):
    """fp32 result (M, N) plus the bias in fp32, then RNE to out_dtype (as torch does)."""
    import ml_dtypes

    y = acc32 if bias is None else (acc32 + bias.astype(np.float32)).astype(np.float32)
    return y.astype(ml_dtypes.bfloat16) if out_dtype == "bfloat16" else y.astype(np.float32)


class _MM(Backend):
    capabilities = MM_CAPS
    accumulation_order = {"scaled_mm": "unspecified"}
    acc_dtype = np.float32

    def operands(self, a, b, scale_a, scale_b, fmt):
        a32 = codec.decode(a, fmt) * np.asarray(scale_a, np.float32).reshape(-1, 1)
        b32 = codec.decode(b, fmt) * np.asarray(scale_b, np.float32).reshape(1, -1)
        return a32.astype(np.float32), b32.astype(np.float32)

    def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order):
        a32, b32 = self.operands(a, b, scale_a, scale_b, fmt)
        K = a.shape[1]
        acc = np.zeros((a.shape[0], b.shape[1]), self.acc_dtype)
        for k in reversed(range(K)):  # an order fp8ref's sequential model does not use
            prod = (a32[:, k, None] * b32[None, k, :]).astype(self.acc_dtype)
            acc = (acc + prod).astype(self.acc_dtype)
        return _out(acc.astype(np.float32), bias, out_dtype)


class ReverseOrderMM(_MM):
    """Correct: fp32 operands, fp32 sum over k in reverse order (a legitimate order)."""

    name = "mm-reverse-order"


class WrongScaleB(_MM):
    """scale_b is applied after rounding to bfloat16 (a scale stored in the wrong dtype)."""

    name = "mm-wrong-scale-b"

    def operands(self, a, b, scale_a, scale_b, fmt):
        import ml_dtypes

        sb = np.asarray(scale_b, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        return super().operands(a, b, scale_a, sb, fmt)


class TransposedB(_MM):
    """b's (K, N) buffer is read as if it were stored (N, K): a row/column-major mix-up."""

    name = "mm-transposed-b"

    def operands(self, a, b, scale_a, scale_b, fmt):
        K, N = b.shape
        return super().operands(a, np.ascontiguousarray(b).reshape(N, K).T, scale_a, scale_b, fmt)


class Fp16AccumulationMM(_MM):
    """Products and running sum rounded to float16 (an fp16 accumulator)."""

    name = "mm-fp16-accumulation"
    acc_dtype = np.float16


class NanMM(_MM):
    """Correct but for a NaN in element [0, 0] (an uninitialised accumulator tile)."""

    name = "mm-nan"

    def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order):
        out = super().scaled_mm(a, b, scale_a, scale_b, bias=bias, fmt=fmt, out_dtype=out_dtype,
                                accumulate=accumulate, scale_order=scale_order)
        out = np.array(out)
        out[0, 0] = np.nan
        return out


# --- block-scaled scaled_mm (scales: block128): fp8ref's own exact/fp32 models with 1x128 / 128x128
# scale blocks, correct in BlockMM and broken in one way each in the others; declared orders, so
# they are judged bit for bit.
BLOCK_CAPS = {"scaled_mm": {"format": ("float8_e4m3fn",), "scales": ("block128",), "accumulate": ("exact", "fp32")}}


class BlockMM(Backend):
    """Correct: fp8ref.scaled_mm with the 128-element blocks the case declares."""

    name = "mm-block"
    capabilities = BLOCK_CAPS

    def scales(self, scale_a, scale_b):
        return scale_a, scale_b

    def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order):
        from fp8ref import scaled_mm

        sa, sb = self.scales(np.asarray(scale_a, np.float32), np.asarray(scale_b, np.float32))
        return scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype, accumulate=accumulate, fmt_a=fmt,
                         fmt_b=fmt, scale_order=scale_order, block_k=128, block_n=128)


class IgnoresBlockScales(BlockMM):
    """Uses the first K-block's scales for every K-block (a per-row/per-column kernel fed block scales)."""

    name = "mm-block-ignores-k-blocks"

    def scales(self, scale_a, scale_b):
        return (np.repeat(scale_a[:, :1], scale_a.shape[1], axis=1),
                np.repeat(scale_b[:1, :], scale_b.shape[0], axis=0))


class SwapsBlockScales(BlockMM):
    """Reads b's (KB, NB) block scales as if stored (NB, KB) (the checkpoint's weight_scale layout)."""

    name = "mm-block-swapped-scale-b"

    def scales(self, scale_a, scale_b):
        kb, nb = scale_b.shape
        return scale_a, np.ascontiguousarray(scale_b).reshape(nb, kb).T


# --- degenerate inputs (the shipped 'degenerate' suite): each is fp8ref's own reference with one
# fault that a crafted pattern exists to expose; docs/golden.md names the case that catches each.


class _ExactMM(Backend):
    """fp8ref's exact scaled_mm, declared bit for bit (FP8 outputs with scale_result too)."""

    capabilities = {"scaled_mm": {"scales": ("tensor", "row"), "accumulate": ("exact",)}}

    def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order,
                  scale_result=None):
        sr = None if scale_result is None else np.float32(np.asarray(scale_result).reshape(-1)[0])
        return matmul.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, fmt_a=fmt, fmt_b=fmt,
                                **({} if sr is None else {"scale_result": self.result_scale(sr)}))

    def result_scale(self, sr):
        return sr


class SwapScalesMM(_ExactMM):
    """scale_a and scale_b exchanged (a kernel binding its scale pointers the wrong way round): row
    scales of a square product land on the columns."""

    name = "mm-swap-scales"

    def scaled_mm(self, a, b, scale_a, scale_b, **kw):
        sa, sb = np.asarray(scale_a, np.float32), np.asarray(scale_b, np.float32)
        return super().scaled_mm(a, b, sb.reshape(sa.shape) if sb.size == sa.size else sa,
                                 sa.reshape(sb.shape) if sa.size == sb.size else sb, **kw)


class IgnoresScaleResultMM(_ExactMM):
    """An FP8 output encoded without the division by scale_result (torch's CPU _scaled_mm drops it
    for float outputs; a kernel that drops it for FP8 ones)."""

    name = "mm-ignores-scale-result"

    def result_scale(self, sr):
        return np.float32(1.0)


class _Quant(Backend):
    """fp8ref's quantize, declared for every case."""

    capabilities = {"quantize": {}}

    def quantize(self, x, *, scheme, recipe, role, amax=None):
        q = quant.quantize(x, PRESETS[scheme], recipe=recipe, role=role, amax=amax)
        out = {"codes": np.array(q.codes), "scale": np.array(q.scale)}
        return self.breaks(x, quant.as_args(PRESETS[scheme], role=role), q, out)


class ZeroBlockNaN(_Quant):
    """An all-zero block computes 0/0: NaN scale and NaN codes (the E4M3 NaN where there is one)."""

    name = "quant-zero-block-nan"

    def breaks(self, x, qa, q, out):
        if out["scale"].size == 1:  # per tensor (or a recipe that makes it so)
            zero = ~np.any(np.asarray(x, np.float32) != 0, keepdims=True).reshape(1, 1)
            ids = np.zeros(np.shape(x), np.int64)
        else:
            ids = degenerate.block_ids(np.shape(x), qa)
            zero = np.bincount(ids.reshape(-1), weights=(np.asarray(x, np.float32) != 0).reshape(-1),
                               minlength=out["scale"].size) == 0
        zero = np.asarray(zero).reshape(-1)
        if not zero.any():
            return out
        scale = np.array(out["scale"]).reshape(-1).astype(out["scale"].dtype)
        scale[zero] = np.nan
        codes = np.array(out["codes"])
        fmt = get_format(qa.format)
        if fmt.has_nan:
            codes[zero[ids]] = min(fmt.nan_codes)
        return {"codes": codes, "scale": scale.reshape(out["scale"].shape)}


class KTailPreviousScale(_Quant):
    """The partial last block along K gets the previous block's scale (a ceil/floor mix-up in
    the scale index)."""

    name = "quant-k-tail"

    def breaks(self, x, qa, q, out):
        if not degenerate.has_k_tail(np.shape(x), qa) or out["scale"].shape[-1] < 2:
            return out
        scale = np.array(out["scale"])
        scale[..., -1] = scale[..., -2]
        return {"codes": out["codes"], "scale": scale}


class SubstitutesBlockAmax(_Quant):
    """NVFP4: a zero block's amax (not its quotient) replaced by 1.0, the block scale
    448 * 1.0 / A cast to E4M3 without saturation: NaN (0x7F) once 448 / A >= 464."""

    name = "quant-substitutes-block-amax"

    def breaks(self, x, qa, q, out):
        if qa.granularity != "nvfp4":
            return out
        from fp8ref import codec

        amax_b = reduce_amax(np.asarray(x, np.float32), "nvfp4")
        A = float(amax_b.max())
        if not A > 0:
            return out
        sub = codec.decode(codec.encode(np.float32(448.0 / A), "float8_e4m3fn", saturate=False), "float8_e4m3fn")
        scale = np.array(out["scale"])
        scale[amax_b == 0] = sub
        return {"codes": out["codes"], "scale": scale}


class KTailLinear(Backend):
    """fp8ref's linear, but the partial last 128-block along K is scaled by the previous K-block's
    weight scale (the block-scale index of the tail rounded down)."""

    name = "linear-k-tail"
    capabilities = {"linear": {"accumulate": ("exact",)}}

    def linear(self, x, weight, weight_scale, *, input_scale, dynamic, accumulate):
        ws = np.asarray(weight_scale, np.float32)
        if ws.ndim == 2 and ws.shape[1] >= 2 and np.shape(x)[-1] % 128:
            ws = ws.copy()
            ws[:, -1] = ws[:, -2]
        return matmul.linear(x, weight, ws, input_scale=input_scale, dynamic=dynamic, accumulate=accumulate)


class FlipsLastCode(Backend):
    """quantize (recipe fp8ref, FP8_STATIC weights) whose last code is one code off: the repro of a
    quantize mismatch must rerun it (and print the codes, not the scale, at a 2-D index)."""

    name = "flips_last_code"
    capabilities = {"quantize": {"scheme": ("FP8_STATIC",), "recipe": ("fp8ref",), "role": ("weight",)}}

    def quantize(self, x, *, scheme, recipe, role, amax=None):
        q = quant.quantize(x, PRESETS[scheme], recipe=recipe, amax=amax, role=role)
        codes = np.array(q.codes)
        codes.reshape(-1)[-1] ^= 1
        return {"codes": codes, "scale": q.scale}


# --- block-scaled GEMMs (the block-scaled suite): the naive backend with one rule broken ---
from fp8ref.conformance.adapters.naive_block_backend import NaiveBlockBackend  # noqa: E402


class BlockIgnoresAlpha(NaiveBlockBackend):
    """NVFP4: the global scales' alpha is never applied."""

    name = "block-ignores-alpha"

    def scaled_mm(self, a, b, scale_a, scale_b, *, alpha=None, **kw):
        return super().scaled_mm(a, b, scale_a, scale_b, **kw)


class BlockScaleShifted(NaiveBlockBackend):
    """b's block scales are applied one K block late (the last block takes the first's)."""

    name = "block-scale-shifted"

    def scaled_mm(self, a, b, scale_a, scale_b, **kw):
        return super().scaled_mm(a, b, scale_a, np.roll(scale_b, 1, axis=0), **kw)
