#!/bin/bash
# A B1 B2, A B1 B2 for each model size: the hierarchical wrapper and stock DDP over "gradsync"
# (default "auto": one host group of 2) per tree, one coordinator per run (two_modes.py).
#   SIZES="1.6:100 32:20" bash ab.sh OUT_DIR TREE_A TREE_B1 TREE_B2   (MODEL_MB:STEPS)
set -u
out=$1; shift
trees=("$@")
names=(A B1 B2)
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for size in ${SIZES:-1.6:100 32:20}; do
  set -- ${size/:/ }
  for pass in 1 2; do
    for i in "${!trees[@]}"; do
      t=${trees[$i]}
      PYTHONPATH=$t/client:$t/server:$t/proto:$t/bench /work/main/.venv/bin/python "$here/two_modes.py" "$1" "$2" \
        "$out/${names[$i]}-$1mb-$pass.json" 2>&1 | tail -1
    done
  done
done
