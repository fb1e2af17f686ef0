#!/usr/bin/env bash
# System packages the test suite needs beyond pip's: the Prometheus server, which
# tests/integration/test_metrics_and_routing.py starts to scrape /metrics. Installed with
# apt when `prometheus` is not on PATH (as root, or through sudo); otherwise nothing to do.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: the tests need a 'prometheus' binary on PATH and apt-get is not available;" \
       "install the Prometheus server (https://prometheus.io/download/) and rerun" >&2
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "error: the tests need 'prometheus'; installing it takes root: apt-get install prometheus" >&2
  exit 1
fi
echo "installing prometheus (apt-get) for the metrics integration test" >&2
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus >/dev/null 2>&1 || {
  echo "error: apt-get installed prometheus but no 'prometheus' binary is on PATH" >&2
  exit 1
}
