"""Cases and the Operation base class.

A case is the unit of golden files and conformance runs: one operation with fixed
parameters (format, mode, ...) applied to a batch of inputs. Its name is stable and names
its tensors (``<case>/<input or output>``) in the golden safetensors files.

An Operation is one row of the operations table (``fp8ref.golden.ops.OPERATIONS``): its suite
fields, its case parameters, its outputs and its backend method, plus how it expands into
cases, generates their inputs, computes the expected outputs with fp8ref's core and calls a
backend. Suites, folders, the judge, the conformance runner and its reports read the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class OpEntry:
    """One validated ``operations`` item of a suite: the operation name and its typed fields."""

    op: str
    fields: Mapping[str, object]
    index: int


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    params: Mapping[str, object]  # JSON-able; with the inputs, all the reference needs
    inputs: Mapping[str, np.ndarray] = field(repr=False)
    n_special: int = 0  # leading elements from the special-value table (the rest are random)


class Operation:
    """Base of the operations; subclasses fill in the class attributes and methods."""

    name: str
    fields: dict  # YAML field -> (checker, default); default None means required
    params: tuple[str, ...]  # case parameters, in the order reports print them; what capabilities may name
    outputs: tuple[str, ...]
    signature: str  # the backend method, numpy in and numpy out (docs and error messages)

    def expand(self, entry: OpEntry, level: int) -> list[tuple[str, dict]]:
        """(case name, params) for every combination the entry declares at ``level``, in a fixed order."""
        raise NotImplementedError

    def make_case(self, name: str, params: dict, entry: OpEntry, suite, level: int) -> Case:
        raise NotImplementedError

    def reference(self, params: Mapping, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def call(self, backend, params: Mapping, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def output_format(self, params: Mapping, output: str) -> str | None:
        """Name of the format whose codes ``output`` holds, or None for float outputs."""
        return None

    def element_inputs(self, params: Mapping, inputs: Mapping[str, np.ndarray], index: tuple) -> dict:
        """The inputs that produced output element ``index`` (for mismatch lines and repros)."""
        return {}

    def operands(self, params: Mapping, inputs: Mapping[str, np.ndarray], index: tuple) -> dict:
        """Every input value output element ``index`` depends on (a repro's whole input: for a
        GEMM the row of a, the column of b and their scales); by default ``element_inputs``."""
        return self.element_inputs(params, inputs, index)


def shape_name(shape) -> str:
    return "x".join(map(str, shape))
