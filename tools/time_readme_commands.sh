#!/usr/bin/env bash
# Time the README's two commands as a new user meets them: N fresh clones of REPO (default: this
# checkout's HEAD), each in a fresh venv, one after another; prints each run's wall times and the
# suite's summary line. Run it on an idle machine (the README's figures came from it).
#   tools/time_readme_commands.sh [N] [REPO] [WORKDIR]
set -u
N=${1:-3}
REPO=${2:-$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)}
WORK=${3:-$(mktemp -d)}
export CI=1  # pytest prints as on CI
echo "cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores; work in $WORK"
for i in $(seq 1 "$N"); do
  clone=$WORK/clone$i venv=$WORK/venv$i
  rm -rf "$clone" "$venv"
  git clone -q "$REPO" "$clone" && python -m venv "$venv" || exit 1
  cmd1=$(sed -n 4p "$clone/README.md") cmd2=$(sed -n 5p "$clone/README.md")
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  t0=$(date +%s.%N)
  (cd "$clone" && source "$venv/bin/activate" && bash -c "$cmd1") >"$WORK/cmd1_$i.log" 2>&1
  rc1=$? t1=$(date +%s.%N)
  (cd "$clone" && source "$venv/bin/activate" && bash -c "$cmd2") >"$WORK/cmd2_$i.log" 2>&1
  rc2=$? t2=$(date +%s.%N)
  printf 'run %d (load %s): command 1 rc=%d %.1f s; command 2 rc=%d %.1f s; %s\n' "$i" "$load" \
    $rc1 "$(echo "$t1 - $t0" | bc)" $rc2 "$(echo "$t2 - $t1" | bc)" "$(tail -1 "$WORK/cmd2_$i.log")"
done
