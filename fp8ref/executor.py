"""Where independent per-layer or per-batch work runs (teacher-forced ``compare``, ``verify``,
``eval``'s batches, ``inspect --original``): in this process (``local``, the default) or as tasks on a
Ray cluster (``ray``, the optional extra ``fp8ref[ray]``). Results come back in submission order and
are computed by the same functions, so the reports are byte-identical. ``ray``: the cluster at
``RAY_ADDRESS`` (e.g. ``ray://head:10001`` or ``auto``), else a local one started for the run;
workers need fp8ref (and torch, for compare and eval) installed."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

from tqdm import tqdm

from .errors import ModelError

EXECUTORS = ("local", "ray")


def run_all(fn, items, *, executor: str = "local", progress: bool = False, desc: str = "",
            total: int | None = None, threads: int = 1) -> list:
    """``[fn(*item) for item in items]``, locally or as one Ray task per item; ``items`` may be a
    generator (consumed one item at a time locally; ray ships each to the object store as submitted).
    ``threads``: locally, up to that many items at once in threads (for work that releases the GIL,
    such as numpy's and fp8ref's C loops); the results still come in the order of ``items``."""
    if executor not in EXECUTORS:
        raise ModelError(f"executor: {executor!r}; expected one of {', '.join(EXECUTORS)}")
    if executor == "local":
        total = len(items) if total is None and hasattr(items, "__len__") else total
        out = []
        with tqdm(desc=desc, unit="layer", disable=not progress, total=total) as bar, \
                ThreadPoolExecutor(threads) if threads > 1 else nullcontext() as pool:
            for result in pool.map(lambda item: fn(*item), items) if pool else (fn(*item) for item in items):
                out.append(result)
                bar.update()
        return out
    try:
        import ray
    except ImportError:
        raise ModelError("--executor ray needs ray, which is not installed: pip install 'fp8ref[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    task = ray.remote(num_cpus=1)(fn)
    refs = [task.remote(*item) for item in items]  # the object store holds (or spills) the inputs
    out = []
    for ref in tqdm(refs, desc=desc, unit="layer", disable=not progress):
        out.append(ray.get(ref))
    return out
