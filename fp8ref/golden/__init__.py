"""Golden suites and folders: generate once, verify anywhere.

``load_suite(path_or_name)`` reads a suite YAML; ``generate(suite, dir)`` writes inputs and
expected outputs as safetensors with a MANIFEST.json; ``verify(dir)`` re-derives them;
``check(dir, outputs_file)`` judges a backend's outputs written by any language.
"""

from .folder import check, generate, open_golden, verify
from .judge import CaseResult
from .suite import Suite, load_suite, parse_suite

DEFAULT_SUITES = ("formats", "fp8-static-w8a8")
#: suites ``fp8ref conform`` adds to the defaults for a backend that declares their capability:
#: name -> (operation, case parameter, values any one of which the backend must declare)
CAPABILITY_SUITES = {"block-scaled": ("scaled_mm", "scales", ("block16", "block32"))}


def capability_suites(backend) -> tuple[list[str], list[str]]:
    """(the capability suites ``backend`` declares, a line per one it does not: why it is skipped).
    A backend without a ``capabilities`` mapping is given every one (its ``implements`` decides)."""
    caps = getattr(backend, "capabilities", None)
    run, skipped = [], []
    for name, (op, param, wanted) in CAPABILITY_SUITES.items():
        declared = None if caps is None else caps.get(op)
        if caps is None or (declared is not None and (param not in declared
                                                      or any(v in declared[param] for v in wanted))):
            run.append(name)
        else:
            skipped.append(f"suite {name} skipped: backend {backend.name!r} declares no {op} with "
                           f"{param} {' or '.join(wanted)}")
    return run, skipped


__all__ = ["CAPABILITY_SUITES", "DEFAULT_SUITES", "CaseResult", "Suite", "capability_suites", "check", "generate",
           "load_suite", "open_golden", "parse_suite", "verify"]
