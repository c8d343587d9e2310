"""A headless chromium, for the dashboard's browser test and its screenshots.

Debian's ``chromium`` package (``tools/setup-test-deps.sh`` installs it). Each
run gets a profile directory of its own, so runs can overlap.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER_SECONDS = 120.0
"""How long one headless run may take, seconds (start-up on a loaded 2-core machine is slow)."""


class BrowserMissing(RuntimeError):
    """No chromium on this machine; the message says how to install one."""


def find_chromium() -> str:
    """The path of a chromium binary: ``$FEDPIPE_CHROMIUM``, else the first of
    :data:`CANDIDATES` on ``PATH``.

    Raises:
        BrowserMissing: none found.
    """
    named = os.environ.get("FEDPIPE_CHROMIUM")
    if named:
        if not shutil.which(named):
            raise BrowserMissing(f"FEDPIPE_CHROMIUM={named!r} is not an executable")
        return shutil.which(named)
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    raise BrowserMissing("no chromium found (tried " + ", ".join(CANDIDATES) + "); run "
                         "tools/setup-test-deps.sh, or apt-get install chromium")


def _run(url: str, args: list[str], budget_ms: int, timeout: float) -> str:
    """Load ``url`` headless with ``args``, letting the page run ``budget_ms`` of
    virtual time (its fetches and timers) first; return stdout.

    Raises:
        BrowserMissing: no chromium.
        RuntimeError: chromium failed (the message quotes its stderr's tail).
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds.
    """
    binary = find_chromium()
    with tempfile.TemporaryDirectory(prefix="fedpipe-chromium-") as profile:
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
               f"--virtual-time-budget={budget_ms}", *args, url]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(f"chromium exited with code {out.returncode}: {out.stderr[-2000:]}")
    return out.stdout


def dump_dom(url: str, *, budget_ms: int = 5000, timeout: float = BROWSER_SECONDS) -> str:
    """The page's DOM as HTML after its scripts ran (``--dump-dom``)."""
    return _run(url, ["--dump-dom"], budget_ms, timeout)


def screenshot(url: str, path: str | Path, *, size: tuple[int, int] = (1280, 1600),
               budget_ms: int = 5000, timeout: float = BROWSER_SECONDS) -> Path:
    """Save a PNG of the page at ``size`` (width, height in pixels) to ``path``.

    Raises:
        RuntimeError: chromium wrote no file.
    """
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    _run(url, [f"--screenshot={path}", f"--window-size={size[0]},{size[1]}"], budget_ms,
         timeout)
    if not path.exists() or path.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot to {path}")
    return path
