set -u
for round in 1 2 3; do for side in A B; do
  tree=/tmp/base; [ $side = B ] && tree=/tmp/new
  (cd $tree && PYTHONPATH=$tree/client:$tree/server:$tree/proto:$tree/bench timeout 600 /work/main/.venv/bin/python -m gradsync.cli bench --quick --suites latency --worlds 2 --reps 3 --train-steps 150 --out /tmp/ab/lat/$side-$round > /tmp/ab/lat-$side-$round.log 2>&1)
done; done
/work/main/.venv/bin/python - <<'PY'
import json, statistics
for mode in ("flat", "default", "ddp-backend", "ddp"):
    vals = {s: [x for r in (1, 2, 3) for x in json.load(open(f"/tmp/ab/lat/{s}-{r}/latest.json"))["suites"]["latency"][0][mode]["steps_per_s_all"]] for s in "AB"}
    print(mode, "A", [round(v) for v in vals["A"]], "B", [round(v) for v in vals["B"]], "B/A median %.2f" % (statistics.median(vals["B"]) / statistics.median(vals["A"])))
PY
