#!/bin/sh
# Test dependencies that pip cannot install, from Debian:
# - chromium, for the dashboard's browser test (tests/test_dashboard.py);
# - postgresql (the server: initdb, pg_ctl), for the PostgreSQL store's tests, which
#   start a scratch server of their own (tests/pg_server.py).
# The tests fail, they do not skip, without them.
# Idempotent: installs only what is missing. Needs root (or sudo) for apt.
set -eu

have_chromium() {
    for b in chromium chromium-browser google-chrome google-chrome-stable; do
        if command -v "$b" >/dev/null 2>&1; then
            echo "setup-test-deps: $b found at $(command -v "$b")"
            return 0
        fi
    done
    return 1
}

have_postgres() {
    # the newest /usr/lib/postgresql/<version>/bin/initdb, as tests/pg_server.py looks
    for f in /usr/lib/postgresql/*/bin/initdb; do
        if [ -x "$f" ]; then
            echo "setup-test-deps: PostgreSQL's initdb found at $f"
            return 0
        fi
    done
    if [ -n "${FEDPIPE_PG_BIN:-}" ] && [ -x "$FEDPIPE_PG_BIN/initdb" ]; then
        echo "setup-test-deps: PostgreSQL's initdb found at $FEDPIPE_PG_BIN/initdb"
        return 0
    fi
    return 1
}

missing=""
have_chromium || missing="$missing chromium"
have_postgres || missing="$missing postgresql"
[ -z "$missing" ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "setup-test-deps: need root or sudo to apt-get install$missing" >&2; exit 1; }
    SUDO="sudo"
fi
command -v apt-get >/dev/null 2>&1 || { echo "setup-test-deps: no apt-get; install$missing yourself (or set FEDPIPE_CHROMIUM / FEDPIPE_PG_BIN)" >&2; exit 1; }
$SUDO apt-get update -qq
# shellcheck disable=SC2086 # one word per package
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
have_chromium || { echo "setup-test-deps: chromium did not install" >&2; exit 1; }
have_postgres || { echo "setup-test-deps: postgresql did not install (no initdb)" >&2; exit 1; }
echo "setup-test-deps: installed$missing"
