"""The guard of tests/conftest.py: a test that starts a process without the ``processes``
mark fails before the process starts, whichever door it takes; a marked one runs."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedpipe.proc import child_env

pytestmark = [pytest.mark.timeout(180), pytest.mark.processes]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

TESTS = '''
import multiprocessing
import os
import subprocess
import sys

import pytest

from fedpipe.testing import LocalSwarm

OUT = os.environ["GUARD_OUT"]


def touch(name):
    open(os.path.join(OUT, name), "w").close()


def test_unmarked_subprocess():
    subprocess.run([sys.executable, "-c", f"open({OUT!r} + '/subprocess', 'w')"])


def test_unmarked_multiprocessing():
    p = multiprocessing.get_context("spawn").Process(target=touch, args=("spawn",))
    p.start()
    p.join()


def test_unmarked_fork():
    pid = os.fork()
    if pid == 0:
        touch("fork")
        os._exit(0)
    os.waitpid(pid, 0)


def test_unmarked_system():
    os.system(f"touch {OUT}/system")


def test_unmarked_swarm():
    with LocalSwarm(n_nodes=0):
        touch("swarm")


@pytest.fixture(scope="module")
def started():
    subprocess.run([sys.executable, "-c", f"open({OUT!r} + '/fixture', 'w')"])


def test_unmarked_module_fixture(started):
    pass


def test_in_process():
    touch("in-process")


@pytest.mark.processes
def test_marked_subprocess():
    subprocess.run([sys.executable, "-c", f"open({OUT!r} + '/marked', 'w')"], check=True)
'''


def test_an_unmarked_test_that_starts_a_process_fails_before_it_starts(tmp_path):
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    shutil.copy(HERE / "conftest.py", suite / "conftest.py")
    (suite / "test_doors.py").write_text(TESTS)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
         "-o", "markers=processes: starts processes", "-o", "addopts=", str(suite)],
        capture_output=True, text=True, timeout=150, cwd=tmp_path,
        env={**child_env(), "GUARD_OUT": str(out), "PYTHONPATH": str(ROOT)})
    report = run.stdout + run.stderr
    assert "5 failed, 2 passed, 1 error" in report, report  # the fixture: an error
    for name in ("subprocess", "multiprocessing", "fork", "system", "swarm",
                 "module_fixture"):
        assert f"test_unmarked_{name}" in report, report
    assert "is not marked @pytest.mark.processes" in report, report
    assert sorted(p.name for p in out.iterdir()) == ["in-process", "marked"], report
