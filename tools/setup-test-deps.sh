#!/bin/sh
# Test dependencies that pip cannot install: Debian's chromium, for the dashboard's
# browser test (tests/test_dashboard.py fails, it does not skip, without it).
# Idempotent: does nothing when a chromium is already on PATH. Needs root (or sudo) for apt.
set -eu
for b in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$b" >/dev/null 2>&1; then
        echo "setup-test-deps: $b found at $(command -v "$b")"
        exit 0
    fi
done
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "setup-test-deps: need root or sudo to apt-get install chromium" >&2; exit 1; }
    SUDO="sudo"
fi
command -v apt-get >/dev/null 2>&1 || { echo "setup-test-deps: no apt-get; install chromium yourself (or set FEDPIPE_CHROMIUM)" >&2; exit 1; }
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium
command -v chromium >/dev/null 2>&1 || { echo "setup-test-deps: chromium did not install" >&2; exit 1; }
echo "setup-test-deps: chromium installed at $(command -v chromium)"
