"""A job outlives its client, and its swarm: real processes on 127.0.0.1.

A client killed with ``kill -9`` leaves its job WAITING ("waiting for the
client") until another process resumes it; a closed client detaches; a job
nobody comes back to fails at its ``client_timeout``; ``Job.save`` and
``submit(resume_from=)`` continue a job bit for bit, their snapshots over the
client's socket data plane (over gRPC with ``sockets=False``); ``checkpoint_dir``
survives losing every node and the tracker. Each exactness check compares
against the same job run undisturbed on the same swarm (synchronous schedule,
no compression): the weights must be equal, not close.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fedpipe
from fedpipe.client import checkpoints
from fedpipe.client.job import Job
from fedpipe.examples import digits
from fedpipe.testing import LocalSwarm

pytestmark = [pytest.mark.timeout(240), pytest.mark.processes]
ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY = 10, 2
ADAMW = fedpipe.optimizer(torch.optim.AdamW, lr=3e-3)
SCHEDULE = fedpipe.lr_scheduler(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
LOSS = nn.functional.cross_entropy


def make_model() -> nn.Sequential:
    """Two layers for two stages: the only split there is, on any nodes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 10)))


def batches(n: int = STEPS) -> list:
    x, y, _, _ = digits.load()
    gen = digits.batches(x, y, 16)
    return [next(gen) for _ in range(n)]


def submit(client, data, steps=STEPS, stages=2, **kw):
    return client.submit(make_model(), LOSS, ADAMW, data, steps=steps, microbatches=2,
                         stages=stages, replicas=1, schedule="gpipe", compression="none",
                         lr_scheduler=SCHEDULE, checkpoint_every=EVERY, **kw)


def saved_after(client, data, steps: int, path) -> Path:
    """Run the job's first ``steps`` steps, save it to ``path`` (Job.save); the folder."""
    first = submit(client, data[:steps], steps=steps)
    first.wait(timeout=180, progress=False)
    folder = Path(first.save(path))
    first.release()
    return folder


class Gate:
    """Data that gives ``open_for`` batches, then waits (the job stalls there) until
    :meth:`release` (then it runs out)."""

    def __init__(self, data: list, open_for: int):
        self.data, self.open_for, self.released = data, open_for, threading.Event()

    def __iter__(self):
        yield from self.data[:self.open_for]
        self.released.wait(120)

    def release(self) -> None:
        self.released.set()


@pytest.fixture(scope="module")
def swarm():
    with LocalSwarm(n_nodes=2) as s:
        yield s


@pytest.fixture(scope="module")
def undisturbed(swarm):
    """The weights of the job run from start to end with nothing in the way."""
    with swarm.client() as client:
        job = submit(client, batches())
        job.wait(timeout=180, progress=False)
        weights = job.state_dict()
        job.release()
    return weights


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"tensors differ: {different}"


def wait_for(what, predicate, timeout=120.0, poll=0.1):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)
    return value


CLIENT_SCRIPT = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, {tests!r})
    import test_resume as t
    import fedpipe
    client = fedpipe.Client({tracker!r})
    job = t.submit(client, t.Gate(t.batches(), {open_for}))
    print(job.id, flush=True)
    threading.Event().wait()  # fed until the gate; killed by the test
""")


def test_a_client_killed_with_kill_9_is_resumed_from_another_process_with_exact_weights(
        swarm, undisturbed, tmp_path):
    script = CLIENT_SCRIPT.format(tests=str(ROOT / "tests"), tracker=swarm.tracker, open_for=5)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        job_id = proc.stdout.readline().strip()
        assert job_id, "the client process printed no job id"
        with swarm.client() as client:
            job = client.job(job_id)
            wait_for("5 steps", lambda: job.status().step >= 5)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            killed = time.monotonic()
            status = wait_for("WAITING", lambda: (s := job.status()).state == "WAITING" and s)
            assert time.monotonic() - killed < 15  # found by the stream's end, not a lease
            assert status.reason.startswith("waiting for the client"), status.reason
            assert status.checkpoint_step == 4
            keep = tmp_path / "checkpoints"  # the resuming client keeps them from now on
            job.resume(batches(), checkpoint_dir=keep)
            status = job.wait(timeout=180, progress=False)
            assert status.step == STEPS
            assert_equal(job.state_dict(), undisturbed)
            assert checkpoints.latest(keep).name == f"step-{STEPS:08d}"  # the final state
            assert any(r.lost == "the client" for r in status.recoveries)
            job.release()
    finally:
        proc.kill()
        proc.wait(10)


def test_a_closed_client_detaches_and_a_job_nobody_resumes_fails_at_its_client_timeout(swarm):
    client = swarm.client()
    gate = Gate(batches(), 3)
    job = submit(client, gate, client_timeout=10.0)
    wait_for("3 steps", lambda: job.status().step >= 3)
    closed = time.monotonic()
    client.close()
    gate.release()
    assert time.monotonic() - closed < 10
    with swarm.client() as other:
        watcher = other.job(job.id)
        status = wait_for("WAITING", lambda: (s := watcher.status()).state != "RUNNING" and s)
        assert status.state == "WAITING", status  # detached, not cancelled
        assert status.reason.startswith("waiting for the client")
        status = wait_for("the timeout", lambda: (s := watcher.status()).state != "WAITING"
                          and s, timeout=30)
        assert status.state == "FAILED", status
        assert status.reason.startswith("the client did not come back within its "
                                        "client_timeout of 10 s"), status.reason
        assert time.monotonic() - closed >= 10
    job._join_feed(10)
    assert "waits for a client" in str(job.feed_error)  # the feed ended without cancelling


SOCKET_SNAPSHOTS = re.compile(r"serving FetchSnapshot to \S+#\w+ over the socket data plane"
                              r"|snapshot of job \S+ stage \d+ \(replica 0\) that \S+#\w+ put "
                              r"over the socket data plane")
"""A node's log line for a client's snapshot (a save's fetch, a restore's put) over its
socket data plane (:mod:`fedpipe.node.dataplane`)."""


def socket_snapshots(swarm, since: dict) -> list[str]:
    """The nodes' lines of :data:`SOCKET_SNAPSHOTS` past ``since`` (each node's log length
    then, by node: :func:`log_marks`)."""
    return [m.group(0) for p in swarm.nodes
            for m in SOCKET_SNAPSHOTS.finditer(swarm.log(p)[since.get(p, 0):])]


def log_marks(swarm) -> dict:
    return {p: len(swarm.log(p)) for p in swarm.nodes}


def test_save_then_resume_from_continues_bit_for_bit(swarm, undisturbed, tmp_path):
    """Over the client's socket data plane: a save's fetch and a restore's put of each
    stage's snapshot (the nodes' logs say so)."""
    data = batches()
    since = log_marks(swarm)
    with swarm.client() as client:
        folder = saved_after(client, data, 6, tmp_path / "ck")
        saved = checkpoints.read(folder)
        assert saved.step == 6 and (folder / "model.safetensors.index.json").is_file()
        names = {n for snap in saved.snapshots.values() for n in snap.tensors}
        assert any(n.startswith("optimizer/state/") for n in names)  # AdamW's moments
        assert {"module", "optimizer", "lr_scheduler"} <= {
            part for snap in saved.snapshots.values() for part in snap.skeleton}
        second = submit(client, data, resume_from=folder)  # the data from its start
        status = second.wait(timeout=180, progress=False)
        assert status.step == STEPS
        assert_equal(second.state_dict(), undisturbed)
        second.release()
    lines = socket_snapshots(swarm, since)
    assert sum("FetchSnapshot" in line for line in lines) == 2, lines  # a stage each
    assert sum("put over" in line for line in lines) == 2, lines


def test_a_checkpoint_saved_in_two_stages_resumes_in_one_exactly(swarm, undisturbed, tmp_path):
    """resume_from with another split: the one stage is assembled from the two saved
    stages' layers (weights, AdamW moments, LR schedule), and ends as the 2-stage job.
    A client without a socket plane: its save and restore go over gRPC."""
    data = batches()
    since = log_marks(swarm)
    with swarm.client(sockets=False) as client:
        folder = saved_after(client, data, 4, tmp_path / "ck")
        assert checkpoints.read(folder).depth == 2
        second = submit(client, data, resume_from=folder, stages=1)
        status = second.wait(timeout=180, progress=False)
        assert status.step == STEPS and len(status.plan.stages) == 1
        assert_equal(second.state_dict(), undisturbed)
        second.release()
    assert socket_snapshots(swarm, since) == []


def test_a_checkpoint_dir_the_job_outruns_keeps_its_newest_and_names_each_one_skipped(
        swarm, tmp_path, monkeypatch, caplog):
    """A client that pulls slower than the job takes checkpoints: the nodes drop the
    snapshots of its first checkpoint (they keep a stage's newest) between its two stages'
    pulls. The client keeps the newest instead, says which it did not keep, and leaves no
    ``.tmp-*`` folder behind."""
    keep = tmp_path / "checkpoints"
    real = Job._pull

    def overtaken(self, info, step):  # a slow client: stage 1 is asked for when 2 later
        stages = real(self, info, step)  # checkpoints completed (their nodes moved on)
        yield next(stages)
        if step == EVERY:
            wait_for("2 later checkpoints",
                     lambda: self.status().checkpoint_step >= step + 3 * EVERY)
        yield from stages

    monkeypatch.setattr(Job, "_pull", overtaken)
    with swarm.client() as client, caplog.at_level(logging.INFO, logger="fedpipe.client"):
        job = submit(client, batches(), checkpoint_dir=keep)
        job.wait(timeout=180, progress=False)
        job.release()
    said = [r.getMessage() for r in caplog.records if r.name == "fedpipe.client"]
    kept = {int(m) for line in said for m in re.findall(r"checkpoint of step (\d+) kept", line)}
    skipped = {int(m) for line in said
               for steps in re.findall(r"checkpoints? of steps? ([\d, ]+?) (?:not kept|in )", line)
               for m in re.findall(r"\d+", steps)}
    assert kept | skipped == set(range(EVERY, STEPS + 1, EVERY)), said
    assert EVERY in skipped and not kept & skipped
    assert sorted(p.name for p in keep.iterdir() if p.name.startswith(".")) == []
    folders = sorted(p.name for p in keep.iterdir())
    assert folders[-1] == f"step-{STEPS:08d}" and len(folders) <= checkpoints.KEEP
    assert set(folders) <= {f"step-{s:08d}" for s in kept}


def test_a_checkpoint_dir_outlives_every_node_and_the_tracker(swarm, undisturbed, tmp_path):
    """Runs last in this module: it kills the swarm's nodes and starts new ones."""
    keep = tmp_path / "checkpoints"
    client = swarm.client()
    gate = Gate(batches(), 7)
    job = submit(client, gate, checkpoint_dir=keep)
    wait_for("the checkpoint of step 6 on disk",
             lambda: (p := checkpoints.latest(keep)) is not None and p.name == "step-00000006")
    for i in range(len(swarm.nodes)):
        swarm.kill(i)
    swarm.restart_tracker(kill=True)
    client.close()
    gate.release()
    with swarm.client() as fresh:
        fresh.job(job.id).cancel("its nodes are gone; resumed from the client's checkpoint")
        new = {f"node{len(swarm.nodes)}", f"node{len(swarm.nodes) + 1}"}
        for _ in range(2):
            swarm.add_node()
        wait_for("the new nodes alone", lambda: {n.name for n in fresh.nodes()} == new,
                 timeout=60)
        swarm.wait_for_nodes(2)
        resumed = submit(fresh, batches(), resume_from=keep)
        status = resumed.wait(timeout=180, progress=False)
        assert status.step == STEPS
        assert_equal(resumed.state_dict(), undisturbed)
        resumed.release()
