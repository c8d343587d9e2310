"""What the tracker keeps in memory per job: the decoded spec, the report tallies.

In-process, with fakes; no processes.
"""
from __future__ import annotations

import pytest

from fedpipe.proto import tracker_pb2
from fedpipe.spec import PlanView, StageKey, state_name
from fedpipe.tracker.specs import JobSpecs
from fedpipe.tracker.store import MemoryStore
from fedpipe.tracker.tallies import KEPT_CHECKPOINTS, Tallies
from tracker_fakes import join, make_tracker, submission

pytestmark = pytest.mark.timeout(60)
R = tracker_pb2.StageReport


class CountingStore(MemoryStore):
    """A store that counts how often a job's spec is read from it."""

    def __init__(self):
        super().__init__()
        self.spec_reads: dict[str, int] = {}

    def spec(self, job_id):
        self.spec_reads[job_id] = self.spec_reads.get(job_id, 0) + 1
        return super().spec(job_id)


def test_a_jobs_spec_is_decoded_once_while_it_lives_and_again_only_after_its_config_changes():
    store = CountingStore()
    tracker, nodes, clock = make_tracker(store)
    join(tracker, 3)
    job = tracker.jobs.submit(submission(steps=10, stages=2, checkpoint_every=2))
    tracker.feeders.submitted(job)
    for _ in range(3):
        tracker.tick()  # plans, deploys (the resolved config is stored), sweeps the feeders
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    # read once to plan, once more after the planner resolved its "auto" settings
    assert store.spec_reads[job] == 2
    view = PlanView(tracker.jobs.get(job).plan)
    for step in (1, 2):
        for key, a in sorted(view.stages.items()):
            tracker.progress.report(R(job_id=job, replica=key.replica, stage=key.stage,
                                      node_id=a.node_id, status=R.STATUS_STEP, step=step,
                                      loss=1.0, samples=8, seconds=0.1))
            tracker.progress.report(R(job_id=job, replica=key.replica, stage=key.stage,
                                      node_id=a.node_id, status=R.STATUS_CHECKPOINT, step=step))
        tracker.tick()
    lost = view[StageKey(0, 1)]
    tracker.registry.declare_lost(lost.node_id, "left")
    tracker.tick()  # recovers onto the spare: reads the spec for the memory and the loads
    assert state_name(tracker.jobs.get(job).state) == "RUNNING"
    assert tracker.jobs.get(job).recoveries[-1].checkpoint_step == 2
    assert store.spec_reads[job] == 2  # every later read came from memory
    assert tracker.specs.job(job).client_timeout > 0
    tracker.jobs.cancel(job)  # an ended job is forgotten
    tracker.specs.job(job)
    assert store.spec_reads[job] == 3


def test_set_config_replaces_what_is_kept():
    store = MemoryStore()
    specs = JobSpecs(store)
    job = store.add_job(submission(steps=7), "queued", 0.0)
    spec = specs.job(job)
    assert spec.steps == 7 and specs.job(job) is spec
    specs.set_config(job, spec.with_(checkpoint_every=3))
    assert specs.job(job).checkpoint_every == 3
    assert store.spec(job).config.checkpoint_every == 3
    with pytest.raises(KeyError):
        specs.get("nosuchjob")


def test_specs_keep_at_most_their_bound():
    store = MemoryStore()
    specs = JobSpecs(store, kept=2)
    ids = [store.add_job(submission(), "queued", 0.0) for _ in range(3)]
    first = specs.get(ids[0])
    specs.get(ids[1])
    specs.get(ids[2])  # the least recently read goes
    assert specs.get(ids[0]) is not first


def test_tallies_count_each_group_once_and_clear_at_a_new_epoch():
    t = Tallies()
    rep = R(job_id="j", replica=0, stage=1, step=4, loss=0.5)
    assert t.add_step("j", rep, groups=2) is None
    assert t.add_step("j", rep, groups=2) is None  # the same group's report twice
    both = t.add_step("j", R(job_id="j", replica=1, stage=1, step=4, loss=0.25), groups=2)
    assert both is not None and sorted(r.loss for r in both) == [0.25, 0.5]
    assert not t.ack("j", 0, 4, StageKey(0, 0), needed=2)
    assert not t.ack("j", 0, 4, StageKey(0, 0), needed=2)
    assert t.ack("j", 0, 4, StageKey(0, 1), needed=2)
    for step in range(1, KEPT_CHECKPOINTS + 3):
        t.completed("j", step)
    assert t.complete("j") == list(range(3, KEPT_CHECKPOINTS + 3))
    t.new_epoch("j", rewound=5)
    assert t.complete("j") == [3, 4]
    assert t.add_step("j", rep, groups=2) is None  # the half-counted step started afresh
    t.new_epoch("j", restored=9)
    assert t.complete("j") == [9]
    t.forget("j")
    assert t.complete("j") == []
