#!/usr/bin/env bash
# A B A B: the loopback and latency suites at the base commit (A) and at the new one (B).
set -u
A=${A:-/tmp/base}; B=${B:-/tmp/new}; OUT=${OUT:-/tmp/ab/runs}
mkdir -p "$OUT"
for round in 1 2; do
  for side in A B; do
    tree=$A; [ $side = B ] && tree=$B
    echo "== round $round $side ($(git -C $tree log --oneline -1)) $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $tree && PYTHONPATH=$tree/client:$tree/server:$tree/proto:$tree/bench \
      timeout 900 /work/main/.venv/bin/python -m gradsync.cli bench --quick --suites loopback,latency \
      --worlds 2 --reps 3 --train-steps 150 --out $OUT/$side-$round > $OUT/$side-$round.log 2>&1) || echo "rc=$? see $OUT/$side-$round.log"
  done
done
/work/main/.venv/bin/python - "$OUT" <<'PY'
import json, sys, pathlib, statistics
out = pathlib.Path(sys.argv[1])
rows = {}
for side in "AB":
    for r in (1, 2):
        d = json.loads((out / f"{side}-{r}" / "latest.json").read_text())
        for row in d["suites"]["loopback"]:
            key = f"loopback W{row['world_size']} {row['megabytes']:g} MB gradsync ms"
            rows.setdefault(key, {}).setdefault(side, []).append(row["gradsync"]["median_ms"])
        for row in d["suites"]["latency"]:
            for mode in ("flat", "default", "ddp-backend", "ddp"):
                if mode in row:
                    key = f"latency W{row['world_size']} {mode} steps/s"
                    rows.setdefault(key, {}).setdefault(side, []).append(row[mode]["steps_per_s"])
print(f"| measure | A (base) runs | B (new) runs | B/A (median) |\n|---|---|---|---|")
for key, sides in rows.items():
    a, b = sides.get("A", []), sides.get("B", [])
    ratio = statistics.median(b) / statistics.median(a) if a and b else float("nan")
    print(f"| {key} | {', '.join(f'{x:.1f}' for x in a)} | {', '.join(f'{x:.1f}' for x in b)} | {ratio:.2f} |")
PY
