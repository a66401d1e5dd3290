#!/bin/bash
# The runs behind this folder, from a checkout of the tree (git archive of commit bac218d for
# passes 1-3, of 013fb96 for the traced row), as root (network namespaces), on the shared
# 2-core machine. Each pass is one `gradsync bench` of the netns suite with the single layout,
# which adds the hierarchy rows (2 emulated hosts x 2 ranks, links shaped to 200 Mbit/s each
# way); every rank times flat gradsync, the hierarchical wrapper, stock DDP over "gradsync" and
# gloo's all_reduce in rotation (A B C D, reps + 1 times, the first untimed).
export PYTHONPATH=$PWD/client:$PWD/server:$PWD/proto:$PWD/bench
python -m gradsync bench --suites netns --layouts single --worlds 2 \
    --sizes-mb 4,16 --reps 3 --netns-rate-mbit 200 --out pass1      # then again: pass2
python -m gradsync bench --suites netns --layouts single --worlds 2 \
    --sizes-mb 16,64 --reps 3 --netns-rate-mbit 200 --out pass3
# One 16 MB row with the backend's trace on (trace/rank<r>.json, trace/row.json):
GRADSYNC_TRACE='trace/rank{rank}.json' python bench/results/backend/2026-12-06-netns/trace_run.py 16 trace/row.json
