#!/usr/bin/env bash
# Build the gradsync image and run it for real: (1) a coordinator container and two worker
# containers that reach it by address over a user network, sharing the token volume,
# (2) docker-compose.yml and (3) docker-compose.yml + docker-compose.sharded.yml, each to the
# workers' exit 0, with checks (averaged parameters equal across workers, Redis holds the
# checkpoint keys, Prometheus has samples from every target, the coordinator's health check
# passes and fails once it drains, SIGTERM drains within the grace period). It removes every
# container, network, volume and process it made; the images stay, as the build cache.
#
#   bash scripts/container-check.sh [run] [compose] [sharded]     (default: all three)
#
# Engine: $CONTAINER_ENGINE, else docker when its daemon answers, else podman; with neither,
# as root on Debian it installs podman and runc (apt). Exit status 77: no engine, none
# installable (the system test skips on it).
#
# Why the podman path looks the way it does (measured, ../shared/CONTAINERS.md in the project):
# - No registry here: base images that cannot be pulled are stand-ins built from Debian
#   (mmdebstrap for python:3.11-slim, Debian's redis-server and prometheus for redis:7 and
#   prom/prometheus), made only when a pull fails. Grafana has no stand-in: a compose profile
#   override leaves it out.
# - crun refuses this host's hybrid cgroups and root lacks CAP_SYS_RESOURCE: podman runs with
#   its own containers.conf (runc, ulimits at the hard limits this shell has).
# - pip in the build gets the host's CA bundle, a pip.conf and the local wheel directory as
#   build-time mounts (never in a layer); `--format docker` keeps the HEALTHCHECK.
# - podman 4.3 runs healthchecks from systemd timers and there is no systemd: a loop runs
#   `podman healthcheck run`, and Debian's docker-compose (which honours service_healthy)
#   talks to `podman system service`.
#
# Environment: GRADSYNC_CONTAINER_STATE (default /var/tmp/gradsync-containers: podman's config
# and the socket), GRADSYNC_WHEELS (a directory with the torch wheel; default: pip's
# find-links when download.pytorch.org is unreachable), GRADSYNC_CONTAINER_WORKER_TIMEOUT_S
# (per scenario, default 600).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${GRADSYNC_CONTAINER_STATE:-/var/tmp/gradsync-containers}
WORKER_TIMEOUT_S=${GRADSYNC_CONTAINER_WORKER_TIMEOUT_S:-600}
SCENARIOS=("$@")
[ ${#SCENARIOS[@]} -gt 0 ] || SCENARIOS=(run compose sharded)
P=gscheck # prefix of every name this script gives
IMAGE=gradsync:local
COORD_IMAGE=gradsync:coordinator
T0=$(date +%s)
SUMMARY=()
TMP=""
BACKGROUND_PIDS=()
COMPOSE_PROJECTS=()

say() { printf '[container-check %4ss] %s\n' "$(($(date +%s) - T0))" "$*" >&2; }
fail() {
  say "FAIL: $*"
  exit 1
}
# timed NAME CMD...: run CMD, record how long it took under NAME in the summary. Never call
# it where a failure is tested (`timed ... || ...`): bash then ignores `set -e` inside CMD.
timed() {
  local name=$1 start
  shift
  start=$(date +%s)
  "$@"
  SUMMARY+=("$name: $(($(date +%s) - start)) s")
}

# --- engine -------------------------------------------------------------------------------------

is_root_debian() { [ "$(id -u)" = 0 ] && [ -r /etc/debian_version ] && command -v apt-get >/dev/null; }

apt_install() {
  say "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >"$TMP/apt.log" 2>&1 || {
    DEBIAN_FRONTEND=noninteractive apt-get update -q >>"$TMP/apt.log" 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >>"$TMP/apt.log" 2>&1
  } || {
    tail -20 "$TMP/apt.log" >&2
    fail "apt-get install $*"
  }
}

choose_engine() {
  if [ -n "${CONTAINER_ENGINE:-}" ]; then
    ENGINE=$CONTAINER_ENGINE
  elif command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; then
    ENGINE=docker # a docker client without a daemon (this machine has one) does not count
  elif command -v podman >/dev/null; then
    ENGINE=podman
  elif is_root_debian; then
    apt_install podman
    ENGINE=podman
  else
    say "no container engine (docker with a running daemon, or podman), and not root on Debian"
    exit 77
  fi
  if [ "$ENGINE" = podman ]; then
    configure_podman
  fi
  say "engine: $ENGINE ($($ENGINE --version))"
}

configure_podman() {
  if ! command -v runc >/dev/null; then
    is_root_debian || fail "podman here needs runc (crun refuses hybrid cgroups)"
    apt_install --no-install-recommends runc
  fi
  if [ -z "${CONTAINERS_CONF:-}" ]; then
    # CONTAINERS_CONF replaces every containers.conf: repeat upstream's two settings.
    local nofile nproc pid_max
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    pid_max=$(cat /proc/sys/kernel/pid_max)
    [ "$nofile" != unlimited ] || nofile=1048576
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc=$pid_max; fi
    cat >"$STATE/containers.conf" <<EOF
# Written by scripts/container-check.sh.
[containers]
default_capabilities = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "NET_BIND_SERVICE",
  "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"]
default_sysctls = ["net.ipv4.ping_group_range=0 0"]
# Without CAP_SYS_RESOURCE the runtime cannot raise a limit above the hard one it inherits.
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
# crun refuses a hybrid cgroup layout (cgroup2 with hugetlb beside v1 controllers); runc works.
runtime = "runc"
EOF
    export CONTAINERS_CONF=$STATE/containers.conf
  fi
}

# --- images -------------------------------------------------------------------------------------

image_exists() { $ENGINE image inspect "$1" >/dev/null 2>&1; }

build() { # build ARGS...: $ENGINE build, keeping the HEALTHCHECK under podman
  if [ "$ENGINE" = podman ]; then
    nice -n 10 podman build --format docker "$@"
  else
    nice -n 10 docker build "$@"
  fi
}

# ensure_base NAME MAKER: use NAME when present or pullable, else run MAKER to make a stand-in.
ensure_base() {
  local name=$1 maker=$2
  if image_exists "$name"; then
    return 0
  fi
  say "pulling $name"
  if timeout 120 "$ENGINE" pull -q "$name" >"$TMP/pull.log" 2>&1; then
    return 0
  fi
  say "cannot pull $name ($(tail -1 "$TMP/pull.log")): making a stand-in"
  timed "stand-in $name" "$maker" "$name"
}

standin_python() { # mmdebstrap bookworm, imported as python:3.11-slim
  # mmdebstrap, not debootstrap: it installs the packages in one apt run (18 s here against
  # debootstrap's several minutes, which made it the longest step of a fresh machine's run).
  is_root_debian || fail "a python:3.11-slim stand-in needs root on Debian (mmdebstrap)"
  command -v mmdebstrap >/dev/null || apt_install --no-install-recommends mmdebstrap
  local tarball=$TMP/rootfs.tar
  nice -n 10 mmdebstrap --variant=minbase --include=python3,python3-venv,passwd,ca-certificates \
    --customize-hook='ln -sf /usr/bin/python3 "$1/usr/local/bin/python"' \
    bookworm "$tarball" http://deb.debian.org/debian >"$TMP/mmdebstrap.log" 2>&1 || {
    tail -20 "$TMP/mmdebstrap.log" >&2
    fail "mmdebstrap"
  }
  # The Dockerfile runs `python` (the hook's link); mmdebstrap leaves no .debs or apt lists.
  $ENGINE import --change 'CMD ["python3"]' "$tarball" "$1" >/dev/null
  rm -f "$tarball"
}

standin_redis() { build_logged "$TMP/standin.log" -t "$1" "$ROOT/scripts/container-standins/redis"; }
standin_prometheus() {
  build_logged "$TMP/standin.log" -t "$1" "$ROOT/scripts/container-standins/prometheus"
}

build_images() {
  local args=() wheels=${GRADSYNC_WHEELS:-}
  if [ "$ENGINE" = podman ] && ! timeout 10 "$PY" -c \
    'import urllib.request; urllib.request.urlopen("https://download.pytorch.org/whl/cpu/", timeout=8)' \
    >/dev/null 2>&1; then
    # pytorch.org unreachable: torch from a local wheel directory, everything else from PyPI.
    if [ -z "$wheels" ]; then
      wheels=$("$PY" -m pip config list 2>/dev/null | sed -n "s/^global.find-links='\([^' ]*\).*/\1/p" | head -1)
    fi
    ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 ||
      fail "download.pytorch.org is unreachable and no torch-2.13.0+cpu wheel in GRADSYNC_WHEELS ('$wheels')"
    args+=(--build-arg TORCH_INDEX_URL=https://pypi.org/simple -v "$wheels:/wheels:ro")
    printf '[global]\nfind-links = /wheels\n' >"$TMP/pip.conf"
  else
    printf '[global]\n' >"$TMP/pip.conf"
  fi
  if [ "$ENGINE" = podman ]; then
    local ca=/etc/ssl/certs/ca-certificates.crt
    if [ -r "$ca" ]; then # the host's bundle (a TLS-intercepting proxy's CA), for pip only
      args+=(-v "$ca:$ca:ro")
      printf 'cert = %s\n' "$ca" >>"$TMP/pip.conf"
    fi
    args+=(-v "$TMP/pip.conf:/etc/pip.conf:ro")
  fi
  say "building $IMAGE and $COORD_IMAGE (the layers of earlier builds are the cache)"
  timed "build $IMAGE" build_logged "$TMP/build.log" "${args[@]}" -t "$IMAGE" "$ROOT"
  timed "build $COORD_IMAGE" build_logged "$TMP/build-coordinator.log" "${args[@]}" \
    --target coordinator -t "$COORD_IMAGE" "$ROOT"
  SUMMARY+=("image $IMAGE: $(image_size "$IMAGE")" "image $COORD_IMAGE: $(image_size "$COORD_IMAGE")")
}

build_logged() { # build_logged LOG ARGS...: build, showing the log's end when it fails
  local log=$1
  shift
  build "$@" >"$log" 2>&1 || {
    tail -30 "$log" >&2
    fail "build $*"
  }
}

image_size() { $ENGINE image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

# --- checks shared by the scenarios -------------------------------------------------------------

# healthy NAME: the coordinator container's own health check (podman runs it on demand; under
# docker the same probe command, since the daemon's schedule would take interval x retries).
healthy() {
  if [ "$ENGINE" = podman ]; then
    podman healthcheck run "$1" >/dev/null 2>&1
  else
    docker exec "$1" python -m gradsync.healthcheck 127.0.0.1:50051 >/dev/null 2>&1
  fi
}

wait_healthy() { # wait_healthy NAME TIMEOUT_S
  local deadline=$(($(date +%s) + $2))
  until healthy "$1"; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "$1 not healthy after $2 s"
    sleep 1
  done
}

# wait_exit_0 CONTAINER...: every container exits 0 within WORKER_TIMEOUT_S.
wait_exit_0() {
  local c code
  for c in "$@"; do
    code=$(timeout "$WORKER_TIMEOUT_S" "$ENGINE" wait "$c") || fail "$c still running after ${WORKER_TIMEOUT_S} s"
    if [ "$code" != 0 ]; then
      $ENGINE logs --tail 30 "$c" >&2 || true
      fail "$c exited $code"
    fi
  done
}

# drain_check NAME GRACE_S kill|stop: SIGTERM must end in exit 0 (a drain, not a SIGKILL)
# within the grace (+ 5 s, like compose's stop_grace_period). `kill` sends SIGTERM itself and
# probes the health check meanwhile (the engine still runs checks in a container it did not
# stop): UNHEALTHY_AT is how many seconds after SIGTERM it first failed (empty: never).
# `stop`, for a container whose restart policy would bring it back after a plain SIGTERM.
drain_check() {
  local name=$1 grace=$2 mode=$3 label=${4:-$1} start code
  UNHEALTHY_AT=""
  start=$(date +%s)
  if [ "$mode" = stop ]; then
    timeout $((grace + 30)) "$ENGINE" stop -t $((grace + 5)) "$name" >/dev/null 2>&1 ||
      fail "$ENGINE stop $name failed"
  else
    $ENGINE kill --signal TERM "$name" >/dev/null
    while [ "$($ENGINE inspect --format '{{.State.Running}}' "$name")" = true ]; do
      if [ -z "$UNHEALTHY_AT" ] && ! healthy "$name"; then
        UNHEALTHY_AT=$(($(date +%s) - start))
      fi
      [ $(($(date +%s) - start)) -le $((grace + 5)) ] ||
        fail "$name still running $((grace + 5)) s after SIGTERM"
      sleep 0.5
    done
  fi
  code=$($ENGINE inspect --format '{{.State.ExitCode}}' "$name")
  [ "$code" = 0 ] || fail "$name exited $code after SIGTERM (killed, not drained)"
  SUMMARY+=("  $label: SIGTERM ($mode) -> exit 0 after $(($(date +%s) - start)) s (grace $grace s)")
  [ "$mode" = stop ] || SUMMARY+=("  $label: health check failing after ${UNHEALTHY_AT:-(never)} s")
}

# Every target Prometheus knows (shown by /api/v1/targets) has at least one sample of up == 1.
PROM_CHECK='
import json, sys, urllib.parse, urllib.request
base = "http://prometheus:9090/api/v1/"
def get(path):
    with urllib.request.urlopen(base + path, timeout=10) as answer:
        return json.load(answer)["data"]
targets = {(t["labels"]["job"], t["labels"]["instance"]) for t in get("targets")["activeTargets"]}
seen = get("query?" + urllib.parse.urlencode({"query": "max_over_time(up[1h]) == 1"}))["result"]
up = {(s["metric"]["job"], s["metric"]["instance"]) for s in seen}
print(f"{len(targets)} targets, {len(targets & up)} with samples: {sorted(targets)}")
sys.exit(0 if len(targets) == int(sys.argv[1]) and targets <= up else 1)
'

# --- scenario 1: containers joined by address ---------------------------------------------------

scenario_run() {
  local net=$P-net vol=$P-token out=$P-out coord=$P-coord r
  $ENGINE network create "$net" >/dev/null
  $ENGINE volume create "$vol" >/dev/null
  $ENGINE volume create "$out" >/dev/null
  $ENGINE run --rm -v "$vol:/var/lib/gradsync" "$IMAGE" token /var/lib/gradsync/token --keep
  # Protected mode: no token, every interface -> exit 2.
  r=0
  $ENGINE run --rm --name $P-notoken "$COORD_IMAGE" >/dev/null 2>&1 || r=$?
  [ $r = 2 ] || fail "a coordinator without a token exited $r, not 2"
  local secret=(-v "$vol:/var/lib/gradsync:ro" -e GRADSYNC_TOKEN_FILE=/var/lib/gradsync/token)
  # The torch-less coordinator image.
  $ENGINE run -d --name "$coord" --network "$net" "${secret[@]}" "$COORD_IMAGE" \
    serve --world-size 2 --host 0.0.0.0 --port 50051 --metrics-port 9100 --shutdown-grace-s 10 >/dev/null
  wait_healthy "$coord" 60
  for r in 0 1; do
    # The params volume is mounted over the home folder, which the image gives the user.
    $ENGINE run -d --name "$P-w$r" --network "$net" "${secret[@]}" -v "$out:/home/gradsync" \
      --no-healthcheck "$IMAGE" worker --coordinator "$coord:50051" --rank $r --world-size 2 \
      --epochs 3 --no-progress --save '/home/gradsync/params-{rank}.npz' >/dev/null
  done
  wait_exit_0 "$P-w0" "$P-w1"
  # grep without -q: -q stops reading at the first match, and the engine's SIGPIPE would then
  # fail the pipeline (pipefail) even though the line was there.
  $ENGINE logs "$coord" 2>&1 | grep "job 'default' finished after" >/dev/null || fail "the coordinator logged no finished job"
  py_in none 'import sys, numpy as np
a, b = (np.load(f"/home/gradsync/params-{r}.npz") for r in (0, 1))
assert sorted(a.files) == sorted(b.files) and a.files, (a.files, b.files)
diff = [k for k in a.files if not np.array_equal(a[k], b[k])]
print(f"{len(a.files)} parameter tensors, equal on both ranks: {not diff}")
sys.exit(1 if diff else 0)' -v "$out:/home/gradsync" || fail "the two workers' parameters differ"
  # A job still assembling holds a stream open: SIGTERM must wait for it, reporting not serving.
  $ENGINE run -d --name $P-hold --network "$net" "${secret[@]}" --no-healthcheck "$IMAGE" \
    worker --coordinator "$coord:50051" --job-id drain --rank 0 --world-size 2 --no-progress >/dev/null
  local deadline=$(($(date +%s) + 90))
  until $ENGINE logs "$coord" 2>&1 | grep "job 'drain': rank 0 joined" >/dev/null; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "the holding worker never joined"
    sleep 1
  done
  healthy "$coord" || fail "$coord unhealthy before SIGTERM"
  # Frozen, the holding worker cannot answer the drain: its stream stays open for the whole
  # grace, so the probe, a process started in the container each time, has that long to see
  # the coordinator not serving (a worker that leaves at once ended the drain in 1-2 s).
  $ENGINE pause $P-hold >/dev/null
  drain_check "$coord" 10 kill
  [ -n "$UNHEALTHY_AT" ] || fail "the health check never failed while $coord drained"
  remove_run_scenario
}

remove_run_scenario() { # one name at a time: podman stops at the first missing name
  local name
  for name in $P-coord $P-w0 $P-w1 $P-hold $P-notoken; do $ENGINE rm -f "$name" >/dev/null 2>&1 || true; done
  $ENGINE network rm $P-net >/dev/null 2>&1 || true
  for name in $P-token $P-out; do $ENGINE volume rm "$name" >/dev/null 2>&1 || true; done
}

# py_in NETWORK CODE [-v MOUNT]... ARGS...: python CODE ARGS in a throwaway gradsync container.
py_in() {
  local network=$1 code=$2
  shift 2
  local mounts=()
  while [ $# -gt 0 ] && [ "$1" = -v ]; do
    mounts+=(-v "$2")
    shift 2
  done
  $ENGINE run --rm --network "$network" "${mounts[@]}" --entrypoint python "$IMAGE" -c "$code" "$@"
}

# --- scenarios 2 and 3: compose -----------------------------------------------------------------

start_compose_tool() {
  if [ "$ENGINE" = docker ]; then
    if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
    return 0
  fi
  command -v docker-compose >/dev/null || {
    is_root_debian || fail "podman here needs docker-compose (Debian's, against podman's socket)"
    apt_install --no-install-recommends docker-compose
  }
  local sock=$TMP/podman.sock
  podman system service --time=0 "unix://$sock" >"$TMP/podman-service.log" 2>&1 &
  BACKGROUND_PIDS+=($!)
  local deadline=$(($(date +%s) + 30))
  until [ -S "$sock" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "podman system service made no socket"
    sleep 0.5
  done
  # No systemd: run the compose containers' healthchecks, so service_healthy can happen.
  (while :; do
    for c in $(podman ps --filter label=com.docker.compose.project --format '{{.ID}}'); do
      podman healthcheck run "$c" >/dev/null 2>&1 || true
    done
    sleep 2
  done) &
  BACKGROUND_PIDS+=($!)
  export DOCKER_HOST=unix://$sock
  COMPOSE=(docker-compose)
}

service_id() { # service_id PROJECT SERVICE: the (one) container of SERVICE
  $ENGINE ps -a -q --filter "label=com.docker.compose.project=$1" \
    --filter "label=com.docker.compose.service=$2" | head -1
}

# scenario_compose PROJECT TARGETS FILE...: up, workers exit 0, Redis and Prometheus, drain.
scenario_compose() {
  local project=$1 targets=$2 files=() f w ids=() coord redis
  shift 2
  for f in "$@"; do files+=(-f "$ROOT/$f"); done
  files+=(-f "$TMP/no-grafana.yml")
  COMPOSE_PROJECTS+=("$project ${files[*]}")
  (cd "$ROOT" && timeout 300 "${COMPOSE[@]}" -p "$project" "${files[@]}" up -d --no-build) \
    >"$TMP/$project-up.log" 2>&1 || {
    tail -30 "$TMP/$project-up.log" >&2
    fail "$project: compose up"
  }
  for w in worker-0 worker-1 worker-2; do ids+=("$(service_id "$project" "$w")"); done
  if [ ${#ids[@]} != 3 ] || [ -z "${ids[2]}" ]; then fail "$project: not three workers"; fi
  wait_exit_0 "${ids[@]}"
  coord=$(service_id "$project" coordinator)
  redis=$(service_id "$project" redis)
  healthy "$coord" || fail "$project: coordinator unhealthy after the run"
  if [ "$targets" = 6 ]; then
    $ENGINE logs "$coord" 2>&1 | grep "all shards registered" >/dev/null || fail "$project: the shards never registered"
  fi
  $ENGINE exec "$redis" redis-cli --scan --pattern 'gradsync:ckpt:*' >"$TMP/$project-keys"
  grep -qx 'gradsync:ckpt:default:latest' "$TMP/$project-keys" ||
    fail "$project: no checkpoint in Redis ($(tr '\n' ' ' <"$TMP/$project-keys"))"
  SUMMARY+=("  $project: Redis keys $(sort "$TMP/$project-keys" | tr '\n' ' ')")
  local scraped
  scraped=$(py_in "${project}_default" "$PROM_CHECK" "$targets") ||
    fail "$project: Prometheus lacks samples of some target: $scraped"
  SUMMARY+=("  $project: Prometheus: $scraped")
  drain_check "$coord" 10 stop "$project coordinator"
  (cd "$ROOT" && timeout 120 "${COMPOSE[@]}" -p "$project" "${files[@]}" down -v) >"$TMP/$project-down.log" 2>&1
  COMPOSE_PROJECTS=("${COMPOSE_PROJECTS[@]:0:${#COMPOSE_PROJECTS[@]}-1}")
}

# --- cleanup ------------------------------------------------------------------------------------

cleanup() {
  local status=$? entry pid
  set +e
  if [ -n "${ENGINE:-}" ]; then
    for entry in "${COMPOSE_PROJECTS[@]}"; do
      # shellcheck disable=SC2086 # entry is "project -f file ...", paths without spaces
      (cd "$ROOT" && timeout 120 "${COMPOSE[@]}" -p $entry down -v) >/dev/null 2>&1
    done
    remove_run_scenario
  fi
  for pid in "${BACKGROUND_PIDS[@]}"; do
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  [ -z "$TMP" ] || rm -rf "$TMP"
  say "summary:"
  for entry in "${SUMMARY[@]}"; do printf '  %s\n' "$entry" >&2; done
  say "$([ $status = 0 ] && echo ok || echo "failed ($status)")"
  exit $status
}

main() {
  mkdir -p "$STATE"
  TMP=$(mktemp -d "$STATE/run.XXXXXX")
  trap cleanup EXIT
  PY=${PYTHON:-python3}
  printf 'services:\n  grafana:\n    profiles: ["grafana"]\n' >"$TMP/no-grafana.yml"
  choose_engine
  remove_run_scenario # leftovers of an interrupted run
  ensure_base docker.io/library/python:3.11-slim standin_python
  build_images
  local s
  case " ${SCENARIOS[*]} " in
    *" compose "* | *" sharded "*)
      ensure_base docker.io/library/redis:7 standin_redis
      ensure_base docker.io/prom/prometheus:v2.53.0 standin_prometheus
      ;;
  esac
  for s in "${SCENARIOS[@]}"; do
    case $s in
      run) timed "scenario run (coordinator + 2 workers by address)" scenario_run ;;
      compose)
        [ -n "${COMPOSE:-}" ] || start_compose_tool
        timed "scenario compose (docker-compose.yml)" scenario_compose ${P}c 4 docker-compose.yml
        ;;
      sharded)
        [ -n "${COMPOSE:-}" ] || start_compose_tool
        timed "scenario sharded (+ docker-compose.sharded.yml)" scenario_compose ${P}s 6 \
          docker-compose.yml docker-compose.sharded.yml
        ;;
      *) fail "unknown scenario $s (run, compose, sharded)" ;;
    esac
  done
}

main
