#!/bin/bash
# The default test suite with the per-ISA loops forced to one level (FP8REF_ISA, docs/build.md): plain
# x86-64 by default (what a CPU without AVX2 runs), LEVEL=x86-64-v3 for an AVX2 CPU; the loops that pick
# AVX-512 at run time (hw_avx512.c, exact.c, matmul.c, the VBMI table loop) still do here. Then the
# hardware loops' tests again with FP8REF_NO_AVX512=1 (their portable passes). Nothing is rebuilt: every
# level is in the library `pip install -e .` built. Not part of CI (the suite's time again).
# Run from the checkout root: [LEVEL=x86-64-v3] bash tools/check_baseline.sh [pytest args]
set -e
PY=${PY:-python}
export FP8REF_ISA=${LEVEL:-x86-64} FP8REF_REQUIRE_KERNELS=1
$PY -c "import fp8ref, sys; i = fp8ref.build_info(); print(i); sys.exit(i.get('isa') != '$FP8REF_ISA')"
$PY -m pytest -q -p no:cacheprovider "$@"
FP8REF_NO_AVX512=1 $PY -m pytest -q -p no:cacheprovider tests/hardware/test_fused_c.py tests/hardware/test_fdpa_oracle.py "$@"
