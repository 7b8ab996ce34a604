"""``fp8ref probe --backend NAME``: which accumulation model does a backend's GEMM follow?"""

from __future__ import annotations

import numpy as np

from ..codec import encode
from ..conformance import load_backend
from ..errors import BackendError
from ..hardware.probe import PARAMETERS, matching_models, model_gemm, probe
from .output import add_json, emit_json

OPS = ("scaled_mm",)


def register(sub) -> None:
    p = sub.add_parser("probe", help="infer a GEMM's accumulation model (fraction bits, rounding, block, "
                                     "promotion, order) from crafted inputs")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--backend", help="conformance backend name (built-in, entry point, or module:object)")
    src.add_argument("--model", help="probe one of fp8ref's kernel models instead (e.g. hopper-promoted)")
    p.add_argument("--op", choices=OPS, default="scaled_mm", help="operation to probe (default: scaled_mm)")
    add_json(p, "the result")
    p.set_defaults(handler=cmd_probe)


def backend_gemm(backend, op: str = "scaled_mm"):
    """The probe's ``gemm`` through a backend's scaled_mm (E4M3 codes, scales 1, float32 out)."""
    params = {"format": "float8_e4m3fn", "scales": "tensor", "out_dtype": "float32", "bias": False}
    reason = backend.implements(op, params) if hasattr(backend, "implements") else None
    if reason and "accumulate" not in reason and "scale_order" not in reason:
        raise BackendError(f"probe: {reason}")
    accumulate = next(iter(getattr(backend, "capabilities", {}).get(op, {}).get("accumulate", ("fp32",))))
    order = next(iter(getattr(backend, "capabilities", {}).get(op, {}).get("scale_order", ("epilogue",))))
    one = np.ones((1, 1), np.float32)

    def gemm(A, B):
        a = encode(A.astype(np.float32), "float8_e4m3fn", saturate=False)
        b = encode(B.astype(np.float32), "float8_e4m3fn", saturate=False)
        out = backend.scaled_mm(a, b, one, one, bias=None, fmt="float8_e4m3fn", out_dtype="float32",
                                accumulate=accumulate, scale_order=order)
        return np.asarray(out, dtype=np.float32)

    return gemm


def cmd_probe(args) -> int:
    if args.backend:
        backend = load_backend(args.backend)
        gemm, label = backend_gemm(backend, args.op), f"backend {backend.name}"
    else:
        gemm, label = model_gemm(args.model), f"model {args.model}"
    found = probe(gemm)
    found["matches"] = matching_models(found)
    if emit_json(args.json, {"subject": label, "op": args.op, **found}):
        return 0
    print(f"fp8ref probe: {label} {args.op}")
    for key in PARAMETERS:
        print(f"  {key:14} {found[key]['value']!s:20} {found[key]['evidence']}")
    print(f"  {'matches':14} {', '.join(found['matches']) or 'no preset kernel model'}")
    return 0
