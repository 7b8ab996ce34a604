"""scaled_mm operands: FP8 codes, float32 dequantization scales and their layouts, checked."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .._arrays import code_input, float64_values
from ..codec import decode
from ..errors import FormatError, ShapeError
from ..formats import FloatFormat, get_format
from ..recipes import check_scale

DEFAULT_FORMAT = "float8_e4m3fn"
#: the block of the block-scaled layout backends share (scales per 1 x 128 group of a and per 128 x 128
#: block of b: torch's ScalingType.BlockWise1x128 / BlockWise128x128, cuBLASLt's, DeepSeek-V3's, HF
#: fine-grained FP8's ``weight_block_size: [128, 128]``); the golden scaled_mm's ``scales: block128``
SCALE_BLOCK = 128


def _shape_text(shape) -> str:
    return str(tuple(int(d) for d in shape))


class DecodedCodes:
    """FP8 codes (2-D) that keep what the exact model derives from them between calls: their
    float64 values (times a fixed scale, with its block norms, for K-blocked scales), decoded on
    first use and reused (``Fp8RefLinear``'s weight). Give it where scaled_mm takes b, or
    ``linear`` takes the weight; ``.T`` is the transposed view sharing the cache.

    Memory: 8 bytes per code (float64) per kept form, held as long as the record lives; only the
    latest form of each kind is kept. The codes are copied (read-only): changing the caller's
    array later cannot make the kept values stale. ``keep=False``: the record holds the codes
    (1 byte each) and every call derives what it needs again, in a reused workspace; a few-row call
    (M <= 8) with K-blocked scales keeps the (KB, N) block norms of b (8 bytes per block of codes)."""

    def __init__(self, codes, fmt=None, *, keep: bool = True, _cache=None, _transposed=False, _notes=None):
        if _cache is None:
            codes, fmt = _operand(codes, fmt, "codes")
            codes = codes.copy()
            codes.setflags(write=False)
        self.codes, self.fmt = codes, fmt
        self.keep = keep
        self._cache = {} if _cache is None else _cache
        self._notes = {} if _notes is None else _notes
        self._transposed = _transposed

    @property
    def T(self) -> DecodedCodes:
        return DecodedCodes(self.codes.T, self.fmt, keep=self.keep, _cache=self._cache,
                            _transposed=not self._transposed, _notes=self._notes)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def nbytes_kept(self) -> int:
        """Bytes held by the kept forms."""
        return sum(a.nbytes for _, v in self._cache.values() for a in _arrays_in(v))

    def noted(self, key, make):
        """make() once per key, held with the codes and not counted as a kept form: the small
        things the codes come with (a layer's scales and bias, read from its checkpoint once)."""
        if key not in self._notes:
            self._notes[key] = make()
        return self._notes[key]

    def cached(self, key: tuple, make):
        """make() once per key (per orientation: the kind is key[0] and the transposition); a new
        key replaces the kind's old form."""
        kind = (key[0], self._transposed)
        held = self._cache.get(kind)
        if held is None or held[0] != key:
            self._cache[kind] = held = (key, make())
        return held[1]


def _arrays_in(v):
    return [x for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, np.ndarray)]


def _operand(x, fmt, what: str) -> tuple[np.ndarray, FloatFormat]:
    """2-D numpy uint8 codes and their format, from codes or a torch float8 tensor."""
    x, named, _ = code_input(x, what)
    if named is not None:
        if fmt is not None and get_format(fmt).name != named:
            raise FormatError(f"{what}: tensor dtype is {named} but fmt says {get_format(fmt).name}")
        fmt = named
    fmt = get_format(DEFAULT_FORMAT if fmt is None else fmt)
    if fmt.decode_dtype != "float32":
        raise FormatError(f"{what}: format {fmt.name} has values outside float32; scaled_mm needs a format "
                          "whose values float32 holds exactly")
    if x.ndim != 2:
        raise ShapeError(f"{what}: expected a 2-D matrix, got shape {_shape_text(x.shape)}")
    return x, fmt


@lru_cache(maxsize=32)
def _code_values(fmt: FloatFormat) -> np.ndarray:
    """float64 value of each code of ``fmt`` (read-only)."""
    values = decode(np.arange(fmt.n_codes, dtype=np.uint8), fmt).astype(np.float64)
    values.setflags(write=False)
    return values


def _scale(x, what: str) -> np.ndarray:
    """float64 copy of float32 dequantization scales, checked positive and finite."""
    s = float64_values(x, what, ("float32",))
    check_scale(s, what)
    return s


def _canonical_scales(sa: np.ndarray, sb: np.ndarray, M: int, K: int, N: int, block_k: int,
                      block_n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Scales as (M, KB) and (KB, N) arrays plus the K-block length (K when KB == 1).

    scale_a: (), (1,), (1, 1) per tensor; (M, 1) per row; (M, ceil(K/block_k)) per 1 x block_k group.
    scale_b: (), (1,), (1, 1) per tensor; (1, N) per column; (ceil(K/block_k), ceil(N/block_n)) blocks.
    """
    kb = -(-K // block_k) if K else 1
    nb = -(-N // block_n) if N else 1
    exp_a = {(): "per tensor", (1,): "per tensor", (1, 1): "per tensor", (M, 1): "per row",
             (M, kb): f"1x{block_k} groups"}
    exp_b = {(): "per tensor", (1,): "per tensor", (1, 1): "per tensor", (1, N): "per column",
             (kb, nb): f"{block_k}x{block_n} blocks"}
    for s, exp, what in ((sa, exp_a, "scale_a"), (sb, exp_b, "scale_b")):
        if tuple(s.shape) not in exp:
            listing = ", ".join(f"{_shape_text(k)} ({v})" for k, v in exp.items())
            raise ShapeError(f"{what}: got shape {_shape_text(s.shape)}, expected one of {listing} "
                             f"for a {M}x{K} @ {K}x{N} product")
    a_groups = kb > 1 and sa.shape == (M, kb)
    b_blocks = sb.shape == (kb, nb) and sb.size > 1 and sb.shape != (1, N)
    kb_used = kb if (a_groups or (b_blocks and kb > 1)) else 1
    full_a = np.broadcast_to(sa if a_groups else sa.reshape(-1, 1), (M, kb_used))
    if b_blocks:
        full_b = np.broadcast_to(np.repeat(sb, block_n, axis=1)[:, :N], (kb_used, N))
    else:
        full_b = np.broadcast_to(sb.reshape(1, -1), (kb_used, N))
    return full_a, full_b, (block_k if kb_used > 1 else max(K, 1))


def _check_codes(codes: np.ndarray, fmt: FloatFormat, what: str) -> bool:
    """Reject codes past 2**bits (FormatError); True when a NaN or Inf code occurs."""
    if fmt.bits < 8 and codes.size and int(codes.max()) >= fmt.n_codes:
        bad = int(codes[codes >= fmt.n_codes].reshape(-1)[0])
        raise FormatError(f"{what}: {fmt.name} has {fmt.bits}-bit codes (< {fmt.n_codes:#x}), got {bad:#04x}")
    if fmt.specials == "fnuz":  # the one NaN sits at the negative-zero code
        return bool((codes == fmt.sign_mask).any())
    if fmt.specials == "p3109":  # NaN at the negative-zero code, +-Inf at the top magnitude
        return bool(((codes == fmt.sign_mask) | ((codes & fmt.magnitude_mask) > fmt.max_code_magnitude)).any())
    if fmt.specials in ("ieee", "fn"):  # Inf/NaN are the magnitudes above the largest finite one
        return bool(((codes & fmt.magnitude_mask) > fmt.max_code_magnitude).any())
    return False
