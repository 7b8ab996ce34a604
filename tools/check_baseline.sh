#!/bin/bash
# The C loops built for plain x86-64 alone (-DFP8REF_BASELINE: no target clones, so the "default"
# clone, the one a CPU without AVX2 runs, is what every call runs; the loops that pick AVX-512 at run
# time still do), in a scratch copy of the checkout, and the default test suite on that build; then
# the hardware loops' tests again with FP8REF_NO_AVX512=1 (their portable passes). Not part of CI:
# about 4 minutes here (the build 30 s, the suite 3 min). Run from the checkout root: bash tools/check_baseline.sh [pytest args]
set -e
PY=${PY:-python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$tmp" # the working tree, not build outputs
rm -f "$tmp"/fp8ref/_kernels*.so
cd "$tmp"
EXTRA_CFLAGS=-DFP8REF_BASELINE PY=$PY bash tools/build_kernels.sh
export PYTHONPATH=$tmp FP8REF_REQUIRE_KERNELS=1
$PY -c "import fp8ref; assert fp8ref.__file__.startswith('$tmp'), fp8ref.__file__"
$PY -m pytest -q -p no:cacheprovider "$@"
FP8REF_NO_AVX512=1 $PY -m pytest -q -p no:cacheprovider tests/hardware/test_fused_c.py tests/hardware/test_fdpa_oracle.py "$@"
