"""Helpers shared by the adapters: peer availability and input conversion."""

from __future__ import annotations

import importlib
from importlib import metadata

import numpy as np

from ...formats import get_format

INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16")


def missing(module: str, dist: str | None = None) -> str | None:
    """Why ``module`` cannot be imported here, or None when it can."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{dist or module} is not installed ({exc})"
    return None


def dist_version(dist: str) -> str:
    try:
        return f"{dist} {metadata.version(dist)}"
    except metadata.PackageNotFoundError:
        return dist


def clamp_to_max(x: np.ndarray, fmt: str) -> np.ndarray:
    """x clamped to +-max of ``fmt`` (NaN kept): the documented way to get a saturating
    cast out of a library whose plain cast does not saturate. When the input dtype cannot
    hold that max (float16 and e8m0's 2**127), x is widened to float32 first (exactly)."""
    m = get_format(fmt).max
    if x.dtype == np.float16 and m > 65504:
        x = x.astype(np.float32)
    return np.clip(x, x.dtype.type(-m), x.dtype.type(m))
