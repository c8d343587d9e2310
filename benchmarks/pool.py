"""Independent benchmark runs, a process each: ``imap(fn, tasks, jobs)``.

A long in-process benchmark (``sparseloco.py``, ``wan_converge.py``) trains many
independent (configuration, seed) runs. On a 2-core machine two at once take less wall
time than one after another (``wan.py --quick``: 23 s against 35 s). The workers are
forked, so what the parent set before (``torch.set_num_threads(1)``, data loaded into module
globals) is theirs too; ``fn`` and each task must pickle (a module-level function, plain
values).
"""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def imap(fn: Callable[[T], R], tasks: Iterable[T], jobs: int) -> Iterator[R]:
    """``fn(task)`` for each task, yielded in the tasks' order as each is done: in this
    process when ``jobs <= 1``, else in ``jobs`` forked worker processes at once. A
    worker's exception is raised here, when its result's turn comes."""
    if jobs <= 1:
        yield from map(fn, tasks)
        return
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        yield from pool.imap(fn, tasks)
