"""The control plane runs without torch: a real ``fedpipe tracker`` process maps no
libtorch, and production code imports nothing from :mod:`fedpipe.testing`."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from fedpipe.proc import TRACKER_SERVICE, child_env, free_port, wait_serving

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
TORCH_LIBS = ("libtorch", "torch/_C")
"""What a process that imported torch maps: its native libraries."""


def torch_mapped(pid: int | str) -> list[str]:
    """The lines of ``/proc/PID/maps`` that map a file of torch's native code."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if any(t in line for t in TORCH_LIBS)})


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
@pytest.mark.parametrize("observed", [False, True], ids=["bare", "dashboard-and-metrics"])
def test_a_running_tracker_has_not_loaded_torch(tmp_path, observed):
    assert torch_mapped("self"), "this test process imported torch: the check must see it"
    port = free_port()
    extra = ["--http-port", str(free_port()), "--metrics-port", str(free_port())] \
        if observed else []
    with open(tmp_path / "tracker.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedpipe", "tracker", "--host", "127.0.0.1",
             "--port", str(port), "--db", str(tmp_path / "tracker.db"), *extra],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env())
    try:
        def alive() -> None:
            if proc.poll() is not None:
                raise RuntimeError((tmp_path / "tracker.log").read_text())
        wait_serving(f"127.0.0.1:{port}", TRACKER_SERVICE, 60, alive)
        assert torch_mapped(proc.pid) == [], (tmp_path / "tracker.log").read_text()
    finally:
        proc.terminate()
        proc.wait(30)


def test_production_code_imports_nothing_from_fedpipe_testing():
    package = ROOT / "fedpipe"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] in ("testing", "proto"):
            continue
        text = path.read_text()
        if "testing" not in text:  # no import of it can hide in this file: skip the parse
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [f"{'.' * node.level}{node.module or ''}"] + \
                    [f"{'.' * node.level}{node.module + '.' if node.module else ''}{a.name}"
                     for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(_is_testing(n, rel) for n in names):
                offenders.append(f"fedpipe/{rel}:{node.lineno}")
    assert offenders == []


def _is_testing(name: str, rel: Path) -> bool:
    """Whether import ``name`` (absolute or relative), written in ``fedpipe/rel``, is of
    fedpipe.testing."""
    if not name.startswith("."):
        return name == "fedpipe.testing" or name.startswith("fedpipe.testing.")
    level = len(name) - len(name.lstrip("."))
    base = list(("fedpipe", *rel.parts[:-1]))[:len(rel.parts) - level + 1]
    full = ".".join([*base, name.lstrip(".")]) if name.lstrip(".") else ".".join(base)
    return full == "fedpipe.testing" or full.startswith("fedpipe.testing.")
