#!/bin/bash
# Incremental build of the C loops for development (pip install / setup.py rebuild every file:
# minutes): setup.py's code-generation flags (-O3 -std=gnu11 -ffp-contract=off, Python's -fwrapv
# -DNDEBUG; no -g or warnings), into build/dev/, linked in place. Run from the checkout root.
# Recompiles only the .c files newer than their object (all when _kernels.h changed), in parallel;
# a compile error stops it before the link. EXTRA_CFLAGS: more flags (tools/check_baseline.sh).
set -e
PY=${PY:-python}
INC=$($PY -c "import sysconfig;print(sysconfig.get_paths()['include'])")
SO=fp8ref/_kernels$($PY -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
mkdir -p build/dev
FLAGS="-pthread -fPIC -O3 -std=gnu11 -ffp-contract=off -DNDEBUG -fwrapv -Wno-psabi -I$INC $EXTRA_CFLAGS"
pids=()
for c in fp8ref/_kernels*.c; do
  o=build/dev/$(basename ${c%.c}).o
  if [ ! -f $o ] || [ $c -nt $o ] || [ fp8ref/_kernels.h -nt $o ]; then
    gcc $FLAGS -c "$c" -o "$o" & pids+=($!)
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
gcc -pthread -shared build/dev/*.o -lm -o $SO
echo "built $SO"
