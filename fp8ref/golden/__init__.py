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


__all__ = ["CAPABILITY_SUITES", "DEFAULT_SUITES", "CaseResult", "Suite", "check", "generate", "load_suite",
           "open_golden", "parse_suite", "verify"]
