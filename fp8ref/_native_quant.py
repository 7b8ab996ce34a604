"""quantize's C loops (fp8ref/_csrc/quant.c): when they apply, their jobs and operands.

Each function returns None or False where the loops do not apply (not built, switched off, a dtype,
granularity or recipe they do not take); ``fp8ref.quant`` then runs its numpy path, which gives the
same bytes. The loops make the same roundings in the same order as ``recipes.exact_quotient_codes``
and ``recipes.apply_scaled``. Loading, the ABI mirror and the threads are ``_native``'s.
"""

from __future__ import annotations

import ctypes
import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from . import _native
from ._quant_inputs import as_rows
from .codec import _c_encode_params, _c_rne_params
from .errors import ShapeError
from .formats import FloatFormat
from .limits import MAX_DIM, int_in, shown
from .recipes import Recipe, compute_scale
from .scaling import magnitudes_to_f64

_C_KINDS = {"bfloat16": 0, "float16": 1, "float32": 2}
TAB_SLOTS = 0  # quant_job.tab_slots: 0 lets the C loops size each task's table cache; tests try others
_C_MODEL = {"bfloat16": 1, "float16": 2, "float32": 0}


def _c_ok(arr: np.ndarray, dtype: str, granularity: str) -> bool:
    return (dtype in _C_KINDS and arr.ndim >= 1 and arr.size > 0
            and granularity in ("tensor", "channel", "token", "group", "block") and _native.kernels() is not None)


def c_sizes(**sizes: int) -> None:
    """The C boundary: the loops take row counts, row lengths and group lengths as int64/size_t, and
    divide by the group length. Validation keeps them in range; this guards what reaches C anyway."""
    for name, value in sizes.items():
        if not int_in(int(value), 1, MAX_DIM):
            raise ShapeError(f"{name}: {shown(value)} is outside 1..{MAX_DIM}, which the C loops take")


def c_amax(arr: np.ndarray, dtype: str, qa) -> np.ndarray | None:
    """reduce_amax by the C loop for ``qa`` (a QuantArgs): magnitude bits per (row, group of g along
    K), reduced further here for tensor and block; None where the loop does not apply."""
    gran = qa.granularity
    if not _c_ok(arr, dtype, gran) or (gran == "block" and arr.ndim < 2):
        return None
    by_row = as_rows(arr)
    n_rows, k = by_row.shape
    g = qa.group_size if gran == "group" else qa.block_shape[1] if gran == "block" else k
    c_sizes(rows=n_rows, row_length=k, group_size=g)
    ng = -(-k // g)
    wide = dtype == "float32"
    bits = by_row.view(np.uint32 if wide else np.uint16)
    part = np.empty((n_rows, ng), bits.dtype)
    _native.parallel("fp8ref_amax_u32" if wide else "fp8ref_amax_u16",
                     _native.amax_job(bits.ctypes.data, part.ctypes.data, k, g), n_rows, work=bits.size,
                     keep=(bits, part))
    if gran == "tensor":
        part = part.max(keepdims=True).reshape(1)
    elif gran == "block":
        bh, r2 = qa.block_shape[0], arr.shape[-2]
        p = part.reshape(arr.shape[:-2] + (r2, ng))
        p = np.pad(p, [(0, 0)] * (p.ndim - 2) + [(0, -r2 % bh), (0, 0)])  # +0: neutral for the max
        part = p.reshape(p.shape[:-2] + (p.shape[-2] // bh, bh, ng)).max(axis=-2)
    else:
        part = part.reshape(arr.shape[:-1] + (ng,))
    return magnitudes_to_f64(part, np.dtype(np.float32) if wide else dtype)


def _operand_offsets(shape: tuple, qa, sshape: tuple) -> tuple[np.ndarray, int]:
    """(per-row index of the row's first operand in the flattened scale array, elements per operand
    along the row) for the C loops."""
    n_rows, k = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    r = np.arange(n_rows, dtype=np.int64)
    if qa.granularity == "tensor":
        return np.zeros(n_rows, np.int64), k
    if qa.granularity in ("channel", "token"):
        return r, k
    if qa.granularity == "group":
        return r * sshape[-1], qa.group_size
    (bh, bw), r2 = qa.block_shape, shape[-2]
    return ((r // r2) * sshape[-2] + (r % r2) // bh) * sshape[-1], bw


def _c_job(arr, dtype, qa, rec, fmt, shape, rounding, saturate, cast16, neg0, codes, stream=False):
    """The C loops' job for the apply + encode steps (operands still to fill), or None where they
    do not apply (the numpy path then runs). Same roundings, in the same order, as
    exact_quotient_codes / apply_scaled. ``stream``: write the codes around the cache."""
    if not _c_ok(arr, dtype, qa.granularity) or (qa.granularity == "block" and arr.ndim < 2):
        return None
    template = _job_template(dtype, rec, fmt, rounding, saturate, cast16, neg0)
    if template is None:
        return None
    job = _native.quant_job.from_buffer_copy(template)  # built field by field, a cold call's job took ~70 us
    job.src, job.dst, job.K, job.g, job.stream, job.tab_slots = (arr.ctypes.data, codes.ctypes.data, shape[-1],
                                                                 shape[-1], int(stream), TAB_SLOTS)
    job._keep = template._keep  # the job points into them
    return job


@lru_cache(maxsize=256)
def _job_template(dtype, rec, fmt, rounding, saturate, cast16, neg0):
    """_c_job's fields that the recipe, format and modes decide (a job to copy), or None where the loops
    do not take them; called where kernels() found the loops (the parameters exist only with them)."""
    params = _c_encode_params(fmt, saturate, rounding)
    exact = rec.apply_dtype == "exact"
    if params is None or not (rounding == "rne" or exact) or (exact and rec.nonfinite != "error"):
        return None  # the exact loop needs finite x: the recipe rejects NaN/Inf
    model_dtype = "bfloat16" if cast16 else dtype
    rne = _c_rne_params(fmt, saturate) if rounding == "rne" else None
    job = _native.quant_job(None, None, None, None, None, None, ctypes.addressof(params),
                            None if rne is None else ctypes.addressof(rne), 0, 0, 0, 1,
                            _C_KINDS[dtype], int(exact), int(rec.apply_op != "divide"),
                            _C_MODEL[model_dtype] if rec.apply_dtype == "model" else 0, int(cast16 is not None),
                            0.0 if rec.add_zero else -0.0, fmt.max if rec.clamp else np.inf,
                            0x100 if neg0 is None else neg0, 0, 0, 0xFFFFFFFF)
    job._keep = params, rne  # shared, read-only (codec's caches)
    return job


def _c_operands(operand: np.ndarray, rec: Recipe) -> tuple[np.ndarray, np.ndarray]:
    """(float32 operands as the C loops take them, usable mask): the exact loop needs positive finite
    scales, the producer loops multiply by fp32(1/s) for multiply_reciprocal."""
    ops = np.ascontiguousarray(operand, np.float32).reshape(-1)
    if rec.apply_dtype == "exact":
        return ops, np.isfinite(ops) & (ops > 0)
    if rec.apply_op == "multiply_reciprocal":
        with np.errstate(divide="ignore", over="ignore"):
            ops = np.float32(1.0) / ops
    return ops, np.ones(ops.shape, bool)


def c_quantize(arr, dtype, qa, rec, fmt, shape, sshape, operand, rounding, saturate, cast16, neg0,
               codes, stream=False, bound=None) -> bool:
    """The C loop for the apply + encode steps with known operands; False where it does not apply.
    ``bound``: the largest magnitude bits of any bfloat16 input, where known (its amax)."""
    job = _c_job(arr, dtype, qa, rec, fmt, shape, rounding, saturate, cast16, neg0, codes, stream)
    if job is None:
        return False
    if bound is not None:
        job.bound = bound
    ops, usable = _c_operands(operand, rec)
    if not usable.all():
        return False
    s_off, g = _operand_offsets(shape, qa, sshape)
    c_sizes(rows=len(s_off), row_length=shape[-1], group_size=g)
    job.g = g
    job.s, job.s_off = ops.ctypes.data, s_off.ctypes.data
    _native.parallel("fp8ref_quant", job, len(s_off), work=arr.size, keep=(arr, codes, ops, s_off))
    return True


@lru_cache(maxsize=64)
def _operand_table(rec: Recipe, fmt: FloatFormat, dtype: str) -> tuple[np.ndarray, ...]:
    """compute_scale's operand (as _c_operands gives it), whether the codes it gives are final (the
    loop takes it, and the recipe accepts the amax: finite, or NaN/Inf where it does not refuse them),
    the stored scale and the amax (float64), for every 15-bit magnitude of a 16-bit dtype (compute_scale is
    elementwise: looking an amax up here is computing it; after a pass over a large weight, computing
    8,192 scales again took 0.2-0.3 ms, 4% of the pass; the amax too: one lookup, not four numpy
    steps)."""
    mags = np.arange(1 << 15, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns widen to quiet NaN
        amax = magnitudes_to_f64(mags, dtype)
    stored, operand = compute_scale(amax, rec, fmt, dtype)
    ops, usable = _c_operands(operand, rec)
    final = (usable & (np.isfinite(amax) | (rec.nonfinite != "error"))).view(np.uint8)  # the C loop reads bytes
    stored = np.ascontiguousarray(stored, np.float32)
    for table in (ops, final, stored, amax):
        table.setflags(write=False)
    return ops, final, stored, amax


class FusedPlan(NamedTuple):
    """What the fused loop's call decides before it sees x and the codes (fused_plan)."""

    job: ctypes.Structure  # the job, but for src, dst, amax, scale, stream and tab_slots
    bands: int             # the tasks' units
    groups: int            # (band, group)s: one amax and one scale each
    tables: tuple          # _operand_table's (ops, final, stored, amax), which the job points into


@lru_cache(maxsize=256)
def fused_plan(dtype, qa, rec, fmt, shape: tuple, rounding, saturate, cast16, neg0) -> FusedPlan | None:
    """The fused loop's plan for x of ``dtype`` and ``shape`` (a call's arguments as _quantize_scaled
    has them), or None where the loop does not apply; ShapeError where a size is beyond the C loops.
    Called where kernels() found the loops (the job's parameters exist only with them)."""
    if (dtype not in ("bfloat16", "float16") or qa.granularity not in ("channel", "token", "group", "block")
            or not shape or math.prod(shape) == 0 or (qa.granularity == "block" and len(shape) < 2)):
        return None
    template = _job_template(dtype, rec, fmt, rounding, saturate, cast16, neg0)
    if template is None:
        return None
    c_sizes(row_length=shape[-1], **({"block_rows": qa.block_shape[0], "group_size": qa.block_shape[1]}
                                     if qa.granularity == "block" else {"group_size": qa.group_size or shape[-1]}))
    job = _native.quant_job.from_buffer_copy(template)
    job.K = shape[-1]
    if qa.granularity == "block":
        (job.bh, job.g), job.r2 = qa.block_shape, shape[-2]
    else:
        job.g = qa.group_size if qa.granularity == "group" else shape[-1]
        job.r2 = max(1, math.prod(shape[:-1]))
    bands = math.prod(shape[:-1]) // job.r2 * -(-job.r2 // job.bh)
    tables = _operand_table(rec, fmt, dtype)
    table, final, stored, _ = tables
    job.table, job.stored, job.final = table.ctypes.data, stored.ctypes.data, final.ctypes.data
    job._keep = template._keep
    return FusedPlan(job, bands, bands * -(-shape[-1] // job.g), tables)


def run_fused(plan: FusedPlan, src: int, dst: int, scale: int, amax: int | None, work: int, stream: bool,
              keep) -> int:
    """The fused loop's plan run on the input at address ``src`` into the codes at ``dst``, each
    (band, group)'s stored scale (float32) at ``scale`` and its amax bits (uint16) at ``amax`` (None:
    not kept); ``keep``: what owns them. Returns how many (band, group)s are not final."""
    job = _native.quant_job.from_buffer_copy(plan.job)
    job.src, job.dst, job.scale, job.amax, job.stream, job.tab_slots = src, dst, scale, amax, int(stream), TAB_SLOTS
    _native.parallel("fp8ref_quant_fused", job, plan.bands, work=work, keep=(keep, plan))
    return job.not_final


def c_quantize_fused(arr, dtype, qa, rec, fmt, shape, sshape, rounding, saturate, cast16, neg0,
                     codes, stream=False) -> tuple[np.ndarray | None, np.ndarray | None] | None:
    """Dynamic scales of 16-bit input in one pass (amax, operand, codes per cache-sized tile): (None,
    the stored scales: float32 of sshape, compute_scale's) where every code is final (the loop looks
    the scales up and tests them), else (the amax: float64 of sshape, None): an amax of NaN/Inf the
    recipe refuses, or an operand the loop cannot take was used (the caller rejects or quantizes
    again). None: not applicable."""
    if _native.kernels() is None:
        return None
    plan = fused_plan(dtype, qa, rec, fmt, tuple(shape), rounding, saturate, cast16, neg0)
    if plan is None:
        return None
    bits, scale = np.empty(plan.groups, np.uint16), np.empty(plan.groups, np.float32)
    not_final = run_fused(plan, arr.ctypes.data, codes.ctypes.data, scale.ctypes.data, bits.ctypes.data, arr.size,
                          stream, (arr, codes, bits, scale))
    if not not_final:
        return None, scale.reshape(sshape)
    amax_of = plan.tables[-1]
    return amax_of[bits].reshape(sshape), None
