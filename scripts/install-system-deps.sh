#!/usr/bin/env bash
# Install the system packages the real-component tests need (Debian/Ubuntu, as root):
# redis-server, prometheus (with promtool), iproute2 (ip, tc) and chromium (the headless browser
# that opens the documentation site in tests/system/test_docs.py). Only what is missing is
# installed, quietly. The packaged services are stopped: the tests start their own servers on
# free ports. Used by scripts/test.sh (when root) and .ci/run; run it yourself with
#   sudo bash scripts/install-system-deps.sh
# Exit status: 0 when everything is there afterwards, 1 when it cannot install (not root, no
# apt-get), with the reason on stderr.
set -euo pipefail

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v prometheus >/dev/null || missing+=(prometheus)
{ command -v ip >/dev/null && command -v tc >/dev/null; } || missing+=(iproute2)
# Debian's browser package: /usr/bin/chromium, run headless (no display needed).
command -v chromium >/dev/null || missing+=(chromium)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-system-deps: cannot install ${missing[*]}: needs root and apt-get" >&2
  exit 1
fi
echo "install-system-deps: installing ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
# Tests start their own servers on free ports; the packaged services are not needed.
for service in redis-server prometheus; do
  service "$service" stop >/dev/null 2>&1 || true
done
