#!/bin/sh
# Test dependencies that pip cannot install, from Debian's packages:
#   chromium    the dashboard's browser test (tests/test_dashboard.py fails, not skips,
#               without it; FEDPIPE_CHROMIUM may name another browser);
#   iptables    for tests that cut or filter traffic between network namespaces
#               (tests/test_netns.py builds the namespaces with `ip` and `tc`);
#   postgresql  the PostgreSQL server (initdb, postgres) that the Store contract tests
#               run a throwaway cluster of.
# Idempotent: each is installed only when missing, and nothing is done when none is.
# Needs root (or sudo) and apt-get for what is missing.
set -eu

has_chromium() {
    [ -n "${FEDPIPE_CHROMIUM:-}" ] && [ -x "$FEDPIPE_CHROMIUM" ] && return 0
    for b in chromium chromium-browser google-chrome google-chrome-stable; do
        command -v "$b" >/dev/null 2>&1 && return 0
    done
    return 1
}

has_iptables() {
    # /usr/sbin is not on every user's PATH
    command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || [ -x /sbin/iptables ]
}

has_postgresql() {
    # Debian keeps the server's programs off PATH, one directory per major version;
    # FEDPIPE_PG_BIN names another build's bin directory, as tests/pg_server.py reads it
    [ -n "${FEDPIPE_PG_BIN:-}" ] && [ -x "$FEDPIPE_PG_BIN/initdb" ] && return 0
    for f in /usr/lib/postgresql/*/bin/initdb; do
        [ -x "$f" ] && return 0
    done
    return 1
}

missing=""
has_chromium || missing="$missing chromium"
has_iptables || missing="$missing iptables"
has_postgresql || missing="$missing postgresql"
if [ -z "$missing" ]; then
    echo "setup-test-deps: chromium, iptables and postgresql are installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || {
        echo "setup-test-deps: need root or sudo to apt-get install$missing" >&2; exit 1; }
    SUDO="sudo"
fi
command -v apt-get >/dev/null 2>&1 || {
    echo "setup-test-deps: no apt-get; install$missing yourself" >&2; exit 1; }
echo "setup-test-deps: installing$missing"
$SUDO apt-get update -qq
# shellcheck disable=SC2086  # one word per package
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing

has_chromium || { echo "setup-test-deps: chromium did not install" >&2; exit 1; }
has_iptables || { echo "setup-test-deps: iptables did not install" >&2; exit 1; }
has_postgresql || { echo "setup-test-deps: postgresql did not install" >&2; exit 1; }
echo "setup-test-deps: chromium, iptables and postgresql are installed"
