"""Shared fixtures, and the guard that keeps the fast tests fast.

Two speeds of tests: those marked ``processes`` start other processes (a
LocalSwarm, a ``fedpipe`` command, a browser, a network namespace) and take
seconds to minutes each; the rest run in this process and ``make test-fast``
(``pytest -m "not processes"``) runs them in under a minute. The guard below
fails any test that starts a process without the mark, while it is set up, run
or torn down (a session fixture such as :func:`swarm` counts for the first test
that asks for it), and it fails it *before* the process starts.
"""
from __future__ import annotations

import functools
import gc
import multiprocessing.process
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

PROCESSES = "processes"
"""The marker of a test that starts processes (registered in pyproject.toml)."""

_HELPERS = frozenset({"fc-list", "uname"})
"""Programs a library runs for a moment, once, not a test's own processes: matplotlib
asks fc-list for the system's fonts when it builds its font cache, and
``platform.processor()`` (a node's description of its CPU) asks ``uname -p``."""

_current: list[pytest.Item] = []  # the test being set up, run or torn down
_WHOLE_MODULE = re.compile(r"^pytestmark = .*\bpytest\.mark\.processes\b", re.MULTILINE)
"""A module all of whose tests start processes (its ``pytestmark`` line says so)."""


class UnmarkedProcess(AssertionError):
    """A test without ``@pytest.mark.processes`` tried to start a process."""


def _check(what: str, argv: object = None) -> None:
    """Raise :class:`UnmarkedProcess` if the current test may not start ``what``.

    Outside a test (collection, plugins) anything goes: the guard is about tests.
    """
    if not _current or _current[-1].get_closest_marker(PROCESSES) is not None:
        return
    program = _program(argv)
    if program in _HELPERS:
        return
    raise UnmarkedProcess(
        f"{_current[-1].nodeid} starts a process ({what}"
        f"{' ' + program if program else ''}) but is not marked "
        f"@pytest.mark.{PROCESSES}: mark it (or its module: pytestmark), so that "
        f"`make test-fast` leaves it out")


def _program(argv: object) -> str:
    """The program's file name in ``argv`` (a list, or a shell command line); "" if none."""
    if isinstance(argv, (list, tuple)):
        first = argv[0] if argv else ""
    elif isinstance(argv, (str, bytes, os.PathLike)):
        first = (os.fspath(argv).split() or [""])[0]
    else:
        return ""
    name = os.path.basename(os.fspath(first))
    return name.decode(errors="replace") if isinstance(name, bytes) else name


def _guarded(fn, what: str, argv_at: int | None = None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        argv = args[argv_at] if argv_at is not None and len(args) > argv_at else kwargs.get("args")
        _check(what, argv)
        return fn(*args, **kwargs)
    wrapper.__fedpipe_guard__ = fn  # type: ignore[attr-defined]
    return wrapper


# Every door to a new process in the standard library: subprocess (also run, check_output,
# os.popen, asyncio's subprocesses, LocalSwarm), multiprocessing (any start method), and
# the os calls underneath.
_DOORS = [(subprocess.Popen, "__init__", "subprocess.Popen", 1),
          (multiprocessing.process.BaseProcess, "start", "multiprocessing", None),
          (os, "fork", "os.fork", None),
          (os, "forkpty", "os.forkpty", None),
          (os, "system", "os.system", 0),
          (os, "posix_spawn", "os.posix_spawn", 1),
          (os, "posix_spawnp", "os.posix_spawnp", 1)]


def pytest_configure(config: pytest.Config) -> None:
    for owner, name, what, argv_at in _DOORS:
        fn = getattr(owner, name, None)
        if fn is not None and not hasattr(fn, "__fedpipe_guard__"):
            setattr(owner, name, _guarded(fn, what, argv_at))


def pytest_unconfigure(config: pytest.Config) -> None:
    for owner, name, _, _ in _DOORS:
        fn = getattr(owner, name, None)
        if fn is not None and hasattr(fn, "__fedpipe_guard__"):
            setattr(owner, name, fn.__fedpipe_guard__)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m "not processes"`` (``make test-fast``), do not even import a module whose
    tests are all marked: every test of it would be deselected, and importing the 18 such
    modules costs seconds of the fast run."""
    if (collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and config.option.markexpr.split() == ["not", PROCESSES]
            and _WHOLE_MODULE.search(collection_path.read_text(errors="replace"))):
        return True
    return None


def _freeze_heap(item: pytest.Item) -> None:
    """Move what is alive before ``item``'s module starts (imported modules, torch's and
    transformers' registries, session fixtures) out of the garbage collector's reach.

    Why: the suite imports torch, transformers, hypothesis and matplotlib into one
    process, so every full collection walks millions of objects that will live as long
    as the process; ``StageRegistry`` runs one on each release (to free a stage's
    cycles at once), and at about 0.3 s each these were a tenth of the fast run's CPU.
    Garbage is collected first, so no cycle is frozen with the heap; what a test
    creates stays collectable, so what tests check of the collector still holds.
    Once per module (a test that calls ``gc.unfreeze`` loses it for the rest of its
    module only). Not ``gc.get_freeze_count()`` per test: it walks the whole frozen list.
    """
    module = item.nodeid.split("::", 1)[0]
    if _frozen_for[0] != module:
        gc.collect()
        gc.freeze()
        _frozen_for[0] = module


_frozen_for = [""]  # the test module the heap was last frozen before


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _freeze_heap(item)
    _current.append(item)
    try:
        return (yield)
    finally:
        _current.pop()


@pytest.fixture(scope="module")
def ca_dir(tmp_path_factory) -> Path:
    """A CA directory with node node0's certificate and clients alice's and bob's."""
    from fedpipe.security import certs

    d = tmp_path_factory.mktemp("tls")
    certs.make_ca(d)
    certs.issue(d, certs.Role.NODE, "node0")
    certs.issue(d, certs.Role.CLIENT, "alice")
    certs.issue(d, certs.Role.CLIENT, "bob")
    return d


@pytest.fixture(scope="module")
def node_ca(tmp_path_factory) -> Path:
    """A CA directory with nodes a's, b's and c's certificates (two data planes and a third)."""
    from fedpipe.security import certs

    d = tmp_path_factory.mktemp("tls")
    certs.make_ca(d)
    for name in ("a", "b", "c"):
        certs.issue(d, certs.Role.NODE, name)
    return d


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> Path:
    """Another CA's directory, with a node certificate named a as :func:`node_ca`'s is."""
    from fedpipe.security import certs

    d = tmp_path_factory.mktemp("other")
    certs.make_ca(d)
    certs.issue(d, certs.Role.NODE, "a")
    return d


@pytest.fixture(scope="session")
def swarm():
    """A tracker and 3 nodes, shared by the tests that do not disturb them."""
    from fedpipe.testing import LocalSwarm

    with LocalSwarm(n_nodes=3) as s:
        yield s
