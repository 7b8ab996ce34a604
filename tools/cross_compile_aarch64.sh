#!/bin/bash
# Proves the C loops compile and link for aarch64 (Linux): every fp8ref/_csrc/*.c with Debian's cross
# compiler (apt-get install gcc-aarch64-linux-gnu), as setup.py builds them off x86-64: the per-ISA files
# once, generic (-DFP8REF_ISA=generic), the same flags, warnings shown; then one shared object (duplicate
# or missing fp8ref symbols fail the link; Python's own stay undefined, as in any extension module).
# Nothing runs: this machine cannot execute aarch64 code. Run from the checkout root; exit 0 = compiled.
set -euo pipefail
CC=${CC:-aarch64-linux-gnu-gcc}
PY=${PY:-python}
command -v "$CC" >/dev/null || { echo "cross_compile_aarch64: $CC not found (apt-get install gcc-aarch64-linux-gnu)"; exit 2; }
INC=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])") # LP64 on both: the same pyconfig.h sizes
FLAGS=$($PY -c "import ast, sys; t = ast.parse(open('setup.py').read()); print(' '.join(next(ast.literal_eval(n.value) for n in t.body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'CFLAGS')))")
PER_ISA=$($PY -c "import ast; t = ast.parse(open('setup.py').read()); print(' '.join(next(ast.literal_eval(n.value) for n in t.body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'PER_ISA')))")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "$($CC --version | head -1); flags: $FLAGS"
for c in fp8ref/_csrc/*.c; do
  name=$(basename "$c" .c)
  isa=""
  [[ " $PER_ISA " == *" $name.c "* ]] && isa="-DFP8REF_ISA=generic"
  start=$(date +%s.%N)
  $CC -fPIC -Wall -DNDEBUG -fwrapv $FLAGS $isa -I"$INC" -c "$c" -o "$out/$name.o"
  printf '%-14s %6.1f s %s\n' "$name.c" "$(echo "$(date +%s.%N) - $start" | bc)" "$isa"
done
$CC -shared "$out"/*.o -lm -o "$out/_kernels.so"
file "$out/_kernels.so" | sed "s#$out/##"
missing=$(aarch64-linux-gnu-nm -u "$out/_kernels.so" | awk '{print $2}' | grep '^fp8ref_' || true)
[ -z "$missing" ] || { echo "undefined fp8ref symbols: $missing"; exit 1; }
for t in fp8ref_quant fp8ref_hw_fused fp8ref_encode_f32; do
  aarch64-linux-gnu-nm -D "$out/_kernels.so" | grep -q " T ${t}_generic$" || { echo "missing ${t}_generic"; exit 1; }
done
echo "cross_compile_aarch64: every C source compiled and linked for aarch64"
