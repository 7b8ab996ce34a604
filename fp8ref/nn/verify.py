"""The engine behind ``fp8ref verify``: re-derive every weight code and weight scale of a checkpoint
from the original weights and the producer's recipe (``fp8ref.quantize`` with the layer's own
scheme, amax from the weight), and compare bytes; the unquantized tensors must equal the
original's bytes. Static input scales come from calibration data, which a checkpoint does not
carry: given the per-layer activation amax (``fp8ref.checkpoint.load_calibration``'s mapping) they
are re-derived with the recipe's scale rule in the model dtype, else reported as not re-derived.
No torch needed."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

from .._arrays import bf16_bits_to_f32, bits_view
from ..checkpoint import base, load_checkpoint
from ..checkpoint.base import original_values as values_from_store
from ..checkpoint.base import original_weight as from_store
from ..checkpoint.calibration_file import amax_values
from ..errors import Fp8RefError, ModelError
from ..executor import run_all
from ..formats import FORMATS
from ..quant import SELF_SCALED, as_args, quantize_bits
from ..recipes import compute_scale
from ..registry import get_recipe, load_recipes
from ..scaling import reduce_amax

# layers verified at once (local executor): one's single-threaded steps (mapping, NaN scan, compare) run
# while the other's quantization runs the C loops on the cores; each holds one layer and its codes
LAYER_THREADS = 2
_SAME_CHUNK = 1 << 16  # 8-byte words compared per piece: the comparison's temporary stays in cache


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return bits_view(a)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two contiguous arrays hold the same bytes: compared 8 at a time (a clean layer, the
    usual case, then needs no mask the size of the weight)."""
    a, b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    if a.size != b.size:
        return False
    n = a.size - a.size % 8
    words_a, words_b = a[:n].view(np.uint64), b[:n].view(np.uint64)
    same = np.empty(min(words_a.size, _SAME_CHUNK), bool)
    for lo in range(0, words_a.size, _SAME_CHUNK):
        piece = same[:min(_SAME_CHUNK, words_a.size - lo)]
        if not np.equal(words_a[lo:lo + piece.size], words_b[lo:lo + piece.size], out=piece).all():
            return False
    return bool(np.array_equal(a[n:], b[n:]))


def _mismatches(mask: np.ndarray) -> tuple[int, list[int] | None]:
    """(count, index of the first True) of a mismatch mask; the index is searched for only when
    there is one (a first-mismatch search over clean masks was 22 % of verify's time at 1B)."""
    n = int(np.count_nonzero(mask))
    if not n:
        return 0, None
    flat = int(np.argmax(mask.reshape(-1)))
    return n, [int(i) for i in np.unravel_index(flat, mask.shape)]


def _as_bits(values: np.ndarray) -> tuple[np.ndarray, str]:
    """(array, dtype name) of an array, an ml_dtypes bfloat16 one as its uint16 bit patterns (viewed:
    ml_dtypes is not imported)."""
    values = np.asarray(values)
    return (values.view(np.uint16), "bfloat16") if values.dtype.name == "bfloat16" else (values, values.dtype.name)


def _derived_scale(q) -> tuple[np.ndarray, str]:
    """``_as_bits`` of a ``quantize_bits`` result's scale (a bfloat16 one comes as uint16 bits)."""
    s = np.asarray(q.scale)
    return (s, "bfloat16") if q.scale_dtype == "bfloat16" and s.dtype == np.uint16 else _as_bits(s)


def _widen(values: np.ndarray, dtype: str) -> np.ndarray:
    """Exact float32 values of bfloat16 bits or float16 values."""
    return bf16_bits_to_f32(np.ascontiguousarray(values)) if dtype == "bfloat16" else values.astype(np.float32)


def _compare_scales(derived: np.ndarray, derived_dtype: str, stored: np.ndarray, stored_dtype: str) -> dict:
    """Mismatch count and first index of two scale arrays (each with its dtype's name: bfloat16 as
    uint16 bits), bit for bit; a bf16/fp16 derived scale is compared widened to a float32 stored one
    (exact: a writer may store it so, fp8ref's export does)."""
    orig_dtype = derived_dtype
    widened = stored_dtype == "float32" and derived_dtype in ("bfloat16", "float16")
    if widened:
        derived, derived_dtype = _widen(derived, derived_dtype), "float32"
    if derived_dtype != stored_dtype or derived.size != stored.size:
        return {"mismatches": int(stored.size), "first": None,
                "note": f"derived {orig_dtype} {list(derived.shape)}, stored {stored_dtype} {list(stored.shape)}"}
    n, first = _mismatches(_bits(derived.reshape(stored.shape)) != _bits(stored))
    out = {"mismatches": n, "first": first}
    if widened:
        out["note"] = f"derived {orig_dtype}, compared widened to the stored float32"
    return out


def _input_scale(layer, amax: float, recipe: str, model_dtype: str) -> str:
    """The recipe's stored scale for activation amax ``amax`` (exact in the model dtype, as the
    export writes it) against the stored input_scale, compared as float32 values (both exact)."""
    derived, _ = compute_scale(np.array([amax], np.float64), get_recipe(recipe), FORMATS[layer.quant.weight_fmt],
                               model_dtype)
    stored = _widen(*layer.read_tensor("input_scale", bf16_bits=True)).reshape(-1)
    same = _bits(np.asarray(derived, np.float32).reshape(-1)) == _bits(stored)
    return "ok" if stored.size == 1 and bool(same.all()) else (
        f"mismatch: stored {float(stored[0])!r}, derived {float(np.asarray(derived).reshape(-1)[0])!r}")


class Scratch:
    """A codes buffer reused by every layer one thread verifies (a fresh one per layer is a page
    fault per 4 KiB of it)."""

    def __init__(self):
        self._buf = np.empty(0, np.uint8)

    def codes(self, shape: tuple) -> np.ndarray:
        n = int(np.prod(shape))
        if self._buf.size < n:
            self._buf = np.empty(n, np.uint8)
        return self._buf[:n].reshape(shape)


def verify_layer(layer, weight: np.ndarray, recipe: str | None = None, input_amax: float | None = None,
                 model_dtype: str = "bfloat16", global_amax: float | None = None, *,
                 scratch: Scratch | None = None, dtype: str | None = None) -> dict:
    """One layer's report: its codes and weight scales re-derived from ``weight`` (the original, [out, in])
    with ``recipe`` (the amax the producer took: max|W| per the scheme's granularity) and compared with
    the stored bytes. ``global_amax``: an NVFP4 layer's tensor amax for its global scale (the max over
    its fused siblings, as the tools share one global across q/k/v and gate/up; None: the layer's own).
    ``scratch``: where the derived codes go. ``dtype``: weight's dtype where ``weight`` holds bit
    patterns ('bfloat16': uint16, as ``original_values`` reads it); None: weight's own."""
    weight, dtype = _as_bits(weight) if dtype is None else (weight, dtype)
    qa = as_args(layer.scheme)
    if tuple(weight.shape) != tuple(layer.shape):
        raise ModelError(f"{layer.name}: original weight {list(weight.shape)}, checkpoint {list(layer.shape)}")
    scheme = layer.scheme
    self_scaled = qa.granularity in SELF_SCALED  # block-scaled (mx, nvfp4) recipes take their block amax from W
    if not base.get(layer.producer).scales_follow_recipe and not self_scaled:
        scheme = scheme.replace(scale_dtype="model")  # the format's fixed scale dtype (hf-fp8: F32) says how it
        # stores, not how the recipe rounds (E4M3 / E8M0 block scales are what they are)
    q = amax = None
    if not self_scaled:
        # quantize finds max|W| itself, with the codes, in one pass over W (given as amax= it costs two
        # passes more); the two calls differ only in an error's message: on an error, the call with amax=
        # runs below and its error (or result) is the answer, as before
        try:
            q = quantize_bits(weight, dtype, scheme, recipe=recipe,
                              out=None if scratch is None else scratch.codes(weight.shape))
        except Fp8RefError:
            amax = reduce_amax(_values(weight, dtype), qa.granularity, group_size=qa.group_size,
                               block_shape=qa.block_shape)
    elif qa.granularity == "nvfp4" and global_amax is not None:
        amax = global_amax  # the fused siblings' tensor amax, the producer's global scale's
    # FP8 codes are read once, from the mapped file; packed FP4 codes are unpacked into a new array anyway
    stored = layer.weight_codes if self_scaled else layer.read_weight_codes(mapped=True)
    try:
        if q is None:
            q = quantize_bits(weight, dtype, scheme, recipe=recipe, amax=amax)
    except Fp8RefError as exc:  # the recipe cannot have produced this layer: every byte unexplained
        n = int(layer.read_tensor("weight_scale", bf16_bits=True)[0].size)
        return {"name": layer.name, "recipe": recipe or layer.scheme["recipe"], "codes": int(stored.size),
                "code_mismatches": int(stored.size), "first_code_mismatch": None, "scales": n,
                "scale_mismatches": n, "first_scale_mismatch": None, "error": str(exc)}
    codes = np.asarray(q.codes)
    n_bad, first_bad = (0, None) if _same_bytes(codes, stored) else _mismatches(codes != stored)
    stored_scale, stored_dtype = layer.read_tensor("weight_scale", bf16_bits=True)
    c = _compare_scales(*_derived_scale(q), stored_scale, stored_dtype)
    out = {"name": layer.name, "recipe": recipe or layer.scheme["recipe"], "codes": int(stored.size),
           "code_mismatches": n_bad, "first_code_mismatch": first_bad,
           "scales": int(stored_scale.size), "scale_mismatches": c["mismatches"],
           "first_scale_mismatch": c["first"], **({"scale_note": c["note"]} if "note" in c else {})}
    if layer.quant.global_scale is not None:  # the NVFP4 global weight scale, bit for bit
        stored_g = np.asarray(layer.weight_global, np.float32).reshape(-1)
        derived_g = np.asarray(q.global_scale, np.float32).reshape(-1)
        same = _bits(stored_g).tobytes() == _bits(derived_g).tobytes()
        out["global_scale"] = "ok" if same else (f"mismatch: stored {float(stored_g[0])!r}, "
                                                 f"derived {float(derived_g[0])!r}")
        out["scale_mismatches"] += not same
    if layer.quant.input == "static":
        if input_amax is None:
            out["input_scale"] = "not re-derived (needs the calibration data)"
        else:
            out["input_scale"] = _input_scale(layer, input_amax, out["recipe"], model_dtype)
            out["scale_mismatches"] += out["input_scale"] != "ok"
    return out


@lru_cache(maxsize=4)
def worker_checkpoint(path: str):
    """A worker's checkpoint, headers only: the driver checked the values, each layer read checks its own."""
    return load_checkpoint(path, check_values=False)


def original_weight(layer, original, *, mapped: bool = False) -> np.ndarray:
    """``fp8ref.checkpoint.base.original_weight`` from a loaded original Checkpoint, as a ModelError."""
    try:
        return from_store(layer, original.store, mapped=mapped)
    except Fp8RefError as exc:
        raise ModelError(str(exc)) from None


def original_values(layer, original) -> tuple[np.ndarray, str]:
    """``fp8ref.checkpoint.base.original_values`` (mapped: bfloat16 as uint16 bits, no ml_dtypes import)
    from a loaded original Checkpoint, as a ModelError."""
    try:
        return values_from_store(layer, original.store, mapped=True)
    except Fp8RefError as exc:
        raise ModelError(str(exc)) from None


def _values(a: np.ndarray, dtype: str) -> np.ndarray:
    """Values to reduce: bfloat16 bits as their exact float32 values, else ``a``."""
    return bf16_bits_to_f32(a) if dtype == "bfloat16" else a


def _verify_task(ckpt_path: str, original_path: str, name: str, recipe, amax, global_amax=None) -> dict:
    """One layer, from the two folders (a task of ``fp8ref.executor``: it may run on another machine)."""
    ckpt, original = worker_checkpoint(ckpt_path), worker_checkpoint(original_path)
    weight, dtype = original_values(ckpt[name], original)
    return verify_layer(ckpt[name], weight, recipe, amax, ckpt.dtype, global_amax, dtype=dtype)


def fused_global_amax(ckpt, original) -> dict[str, float]:
    """Per NVFP4 layer, the largest original-weight amax over its fused siblings (q/k/v, gate/up,
    w1/w3: ``fp8ref.checkpoint.plan.FUSED_SIBLINGS``), the amax its producer's global scale comes from."""
    from ..checkpoint.plan import FUSED_SIBLINGS

    nv = [n for n in ckpt if ckpt[n].quant.weight_strategy == "nvfp4"]
    amax = {n: float(reduce_amax(_values(*original_values(ckpt[n], original)), "tensor")[0]) for n in nv}
    out = {}
    for n in nv:
        parent, leaf = n.rsplit(".", 1) if "." in n else ("", n)
        fused = base.get(ckpt[n].producer).fuses_nvfp4_globals
        group = next((g for g in FUSED_SIBLINGS if leaf in g), (leaf,)) if fused else (leaf,)
        out[n] = max(amax[m] for m in (f"{parent}.{g}" if parent else g for g in group) if m in amax)
    return out


def candidate_recipes(layer) -> list[str]:
    """The recipes verify tries on ``layer`` when none is given or recorded: its format's own
    (the layer scheme's: ``recipe_of``, or what the layer's own description names, torchao's
    ScaleCalculationMode) first, then those of the format's ``known_recipes`` that cover the layer's
    granularity and weight format, else every recipe that does (by name)."""
    fmt = base.get(layer.producer)
    own = layer.scheme["recipe"]
    q, recipes = layer.quant, load_recipes()
    names = [n for n in (recipes if fmt.known_recipes is None else fmt.known_recipes)
             if q.weight_strategy in recipes[n].granularities and q.weight_fmt in recipes[n].formats]
    return [own] + [n for n in names if n != own]


def _clean(result: dict) -> bool:
    return not (result["code_mismatches"] or result["scale_mismatches"] or "error" in result)


def _cost(result: dict) -> int:
    return result["code_mismatches"] + result["scale_mismatches"]


def _choose_recipes(names: list[str], ckpt, run) -> dict[str, dict]:
    """Per layer the result of the first candidate recipe that reproduces it. Layers with the same
    candidates go together: the candidates are probed in order on the first undecided layer, and the
    first that reproduces it runs on all the others; those it does not reproduce go round again. When
    none reproduces the first layer, the closest (fewest mismatches on it) runs on every layer left,
    and the layers it does not reproduce are marked ``recipe_source: closest``."""
    groups: dict[tuple, list[str]] = {}
    for n in names:
        groups.setdefault(tuple(candidate_recipes(ckpt[n])), []).append(n)
    out: dict[str, dict] = {}
    for candidates, group in groups.items():
        while group:
            probes: dict[str, dict] = {}
            for rec in candidates:
                probes[rec] = run([group[0]], rec)[0]
                if _clean(probes[rec]):
                    break
            rec = next((r for r, x in probes.items() if _clean(x)), None)
            last = rec is None
            if last:
                rec = min(candidates, key=lambda r: (_cost(probes[r]), candidates.index(r)))
            for n, r in zip(group, [probes[rec]] + run(group[1:], rec)):
                if _clean(r) or last:
                    out[n] = {**r, "recipe_source": "discovered" if _clean(r) else "closest"}
            group = [n for n in group if n not in out]
    return out


def verify(ckpt, original, *, recipe: str | None = None, calibration=None, progress: bool = False,
           executor: str = "local") -> dict:
    """Per-layer code and scale mismatch counts of ``ckpt`` against ``original`` (both loaded
    Checkpoints); ``ok`` is False on any mismatch. recipe: re-derive every layer with it; None: each
    layer with the recipe its checkpoint records (``fp8ref.checkpoint.base.recorded_recipes``), else
    the first of ``candidate_recipes`` that reproduces its bytes (the report names it; where none
    does, the closest). Original tensors are found by name, through the producer's renaming table.
    calibration: layer name -> activation amax (``fp8ref.checkpoint.load_calibration``), to re-derive
    static input scales too. executor: ``local`` or ``ray`` (one task per layer, same report).
    Every original tensor must be in the checkpoint, quantized or not (``missing``: those it lacks,
    ``missing_layers``: by module); unquantized ones (biases too) equal the original's bytes or its
    cast to their float dtype (``unquantized.cast``)."""
    if calibration is not None:  # numbers (AmaxState values too); scales refused
        calibration = amax_values(calibration, "calibration")
    names = list(ckpt)
    for name in names:  # every original present before any work (a format's own mapping checks when it runs)
        fmt = base.get(ckpt[name].producer)
        if getattr(fmt, "original_weight", None) is None and base.original_name(fmt, f"{name}.weight",
                                                                               original.store) is None:
            original_weight(ckpt[name], original)  # raises, naming the tensor

    def amax(name):
        return None if calibration is None else calibration.get(name)

    threads = LAYER_THREADS if executor == "local" else 1
    fused = fused_global_amax(ckpt, original)
    if executor == "local":  # the loaded checkpoints, not a second load by path
        mine = threading.local()

        def task(_c, _o, name, rec, a, g):
            scratch = mine.__dict__.setdefault("scratch", Scratch())  # one per thread
            weight, dtype = original_values(ckpt[name], original)
            return verify_layer(ckpt[name], weight, rec, a, ckpt.dtype, g, scratch=scratch, dtype=dtype)
    else:
        task = _verify_task

    def run(batch: list[str], rec: str | None) -> list[dict]:
        items = [(str(ckpt.path), str(original.path), n, rec, amax(n), fused.get(n)) for n in batch]
        return run_all(task, items, executor=executor, progress=progress, desc="verify", threads=threads) \
            if items else []

    with ThreadPoolExecutor(1) as side:  # the unquantized and missing tensors meanwhile; their errors come after
        plain = side.submit(_compare_unquantized, ckpt, original)
        recorded = {} if recipe is not None else base.recorded_recipes(ckpt.store)
        results: dict[str, dict] = {}
        fixed = [n for n in names if recipe is not None or n in recorded]
        for n, r in zip(fixed, _run_each(run, fixed, lambda n: recipe or recorded[n])):
            results[n] = {**r, "recipe_source": "given" if recipe is not None else "recorded"}
        results.update(_choose_recipes([n for n in names if n not in results], ckpt, run))
        plain = plain.result()
    layers = [results[n] for n in names]
    bad = [x["name"] for x in layers if x["code_mismatches"] or x["scale_mismatches"]]
    used = sorted({x["recipe"] for x in layers})
    sources = sorted({x["recipe_source"] for x in layers})
    return {"checkpoint": str(ckpt.path), "original": str(original.path), "format": ckpt.format,
            "recipe": used[0] if len(used) == 1 else None, "recipes": {r: sum(x["recipe"] == r for x in layers)
                                                                       for r in used},
            "recipe_source": sources[0] if len(sources) == 1 else "mixed", "layers": layers,
            "mismatched_layers": bad,
            "unquantized": {k: plain[k] for k in ("checked", "mismatched", "why", "cast", "missing_in_original")},
            "missing": plain["absent"], "missing_layers": _by_module(plain["absent"]),
            "ok": not bad and not plain["mismatched"] and not plain["absent"]}


# float dtypes a producer may cast an unquantized tensor between (llama.cpp's convert_hf_to_gguf stores
# norms and other 1-D tensors as F32; any tool loading the model in another torch_dtype writes that dtype)
_FLOATS = ("F64", "F32", "F16", "BF16")


def _plain_verdict(ckpt_store, name: str, orig_store, key: str) -> str | None:
    """How checkpoint tensor ``name`` stands to original tensor ``key``: None (the same dtype, shape and
    bytes), ``"cast A to B"`` (another float dtype whose bytes are exactly the original's cast to it,
    round to nearest even, as torch's ``.to`` and llama.cpp's converter cast), else what differs."""
    a, b = ckpt_store.info(name), orig_store.info(key)
    if a.shape != b.shape:
        return f"shape {list(a.shape)}, the original's {list(b.shape)}"
    if a.dtype == b.dtype:
        same = _same_bytes(ckpt_store.get(name, mapped=True, bf16_bits=True),
                           orig_store.get(key, mapped=True, bf16_bits=True))
        return None if same else "bytes differ"
    if a.dtype in _FLOATS and b.dtype in _FLOATS:  # rare: ml_dtypes (BF16) is imported only here
        mine = np.asarray(ckpt_store.get(name))
        if _same_bytes(mine, np.asarray(orig_store.get(key)).astype(mine.dtype)):
            return f"cast {b.dtype} to {a.dtype}"
        return f"{a.dtype}, not the original's {b.dtype} cast to it"
    return f"dtype {a.dtype}, the original's {b.dtype}"


def _tied_embeddings(*configs) -> bool:
    """Whether a config ties lm_head to the embeddings (transformers then writes no lm_head.weight)."""
    for c in configs:
        for d in (c or {}, (c or {}).get("text_config") or {}):
            if isinstance(d, dict) and d.get("tie_word_embeddings"):
                return True
    return False


def _compare_unquantized(ckpt, original) -> dict:
    """The checkpoint's unquantized tensors (the quantized layers' biases too) against the original's
    (``_plain_verdict``), and the original tensors the checkpoint holds neither quantized nor
    unquantized (names mapped through the producer's renaming; a tied lm_head is not missing)."""
    fmt = base.get(ckpt.format)
    plain = list(ckpt.unquantized) + [ckpt[n].tensors["bias"] for n in ckpt if "bias" in ckpt[n].tensors]
    used = {base.original_key(ckpt[n], original.store) for n in ckpt}
    bad, missing, cast = [], [], {}
    for name in plain:
        key = base.original_name(fmt, name, original.store)
        if key is None:
            missing.append(name)
            continue
        used.add(key)
        verdict = _plain_verdict(ckpt.store, name, original.store, key)
        if verdict is None:
            continue
        if verdict.startswith("cast "):
            cast[name] = verdict
        else:
            bad.append({"name": name, "why": verdict})
    tied = _tied_embeddings(ckpt.config, original.config)
    absent = [n for n in original.store if n not in used and not (tied and n == "lm_head.weight")]
    return {"checked": len(plain) - len(missing), "mismatched": [x["name"] for x in bad], "why": bad,
            "cast": cast, "missing_in_original": missing, "absent": sorted(absent)}


def _by_module(names: list[str]) -> dict[str, list[str]]:
    """Tensor names grouped by their module (``M.weight``, ``M.bias`` -> ``M: [weight, bias]``)."""
    out: dict[str, list[str]] = {}
    for n in names:
        module, _, leaf = n.rpartition(".")
        out.setdefault(module or n, []).append(leaf if module else n)
    return out


def _run_each(run, names: list[str], recipe_of) -> list[dict]:
    """``run`` over ``names``, one batch per recipe, results in ``names``' order."""
    by: dict[str, list[str]] = {}
    for n in names:
        by.setdefault(recipe_of(n), []).append(n)
    done = {n: r for rec, batch in by.items() for n, r in zip(batch, run(batch, rec))}
    return [done[n] for n in names]
