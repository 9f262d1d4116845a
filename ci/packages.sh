#!/usr/bin/env bash
# Debian packages the tests start for real, installed where missing (as root, as CI runs; elsewhere it says what is
# missing and the tests that need it skip, or fail where CI=true): PostgreSQL, the Batch API's shared job store
# (tests/test_batch_postgres.py starts its own server on loopback); Prometheus and promtool, the dashboard's and the
# alert rules' test (tests/test_dashboard.py); Chromium and its driver, the playground's browser test.
set -euo pipefail
missing=()
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing+=(postgresql)
command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "ci/packages.sh: not root; missing Debian packages: ${missing[*]} (their tests will skip)" >&2
    exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
