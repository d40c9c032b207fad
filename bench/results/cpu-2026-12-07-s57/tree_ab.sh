#!/bin/sh
# Alternate tree_ab.py over two trees, $3 rounds: tree_ab.sh BASE_DIR NEW_DIR ROUNDS (a tree dir
# holds a metrale/ package; run from /tmp).
for r in $(seq "$3"); do
  for tree in "$1" "$2"; do
    PYTHONPATH="$tree" python /work/main/bench/results/cpu-2026-12-07-s57/tree_ab.py 2>/dev/null | tail -1
  done
done
