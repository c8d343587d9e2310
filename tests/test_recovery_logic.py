"""A job's recovery, in-process: :class:`~fedpipe.tracker.recovery.Recovery` built by hand
over a store in memory, fake nodes, a fake clock and fakes of the registry, the drains and
the replica groups; no scheduler, no threads of the test's own, no processes."""
from __future__ import annotations

import time

import pytest

from fedpipe import planner
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import PlanView, StageKey, state_name
from fedpipe.tracker.calibration import Calibration
from fedpipe.tracker.deploy import Deployer
from fedpipe.tracker.jobs import Jobs
from fedpipe.tracker.planning import Planner
from fedpipe.tracker.recovery import Records, Recovery
from fedpipe.tracker.specs import JobSpecs
from fedpipe.tracker.store import MemoryStore
from fedpipe.tracker.tallies import Tallies
from tracker_fakes import VERSIONS, FakeClock, FakeNodes, submission

pytestmark = pytest.mark.timeout(30)
S = tracker_pb2


class FakeMembership:
    """The registry's part: the live nodes, and who was declared lost (and why)."""

    def __init__(self, store: MemoryStore):
        self.store = store
        self.declared: list[tuple[str, str]] = []

    def nodes(self):
        return self.store.nodes()

    def declare_lost(self, node_id: str, why: str) -> bool:
        self.declared.append((node_id, why))
        return self.store.mark_lost(node_id)


class NoDrains:
    def usable(self, nodes):
        return nodes

    def target_plan(self, job_id, plan):
        return None


class NoGroups:
    def drop(self, job_id, lost_nodes, why):
        return False

    def rewind_to(self, job):
        return None


class World:
    """A running job of 2 stages over 3 registered nodes (one spare), and a Recovery."""

    def __init__(self):
        self.clock = FakeClock()
        self.store = MemoryStore()
        self.nodes = FakeNodes(self.clock)
        for i in range(3):
            self.store.add_node(f"id{i}", f"node{i}", f"127.0.0.1:{7000 + i}",
                                node_pb2.Resources(flops=1e12, memory_bytes=2**33,
                                                   device="cpu", cores=1),
                                "boot", VERSIONS, self.clock())
        self.membership = FakeMembership(self.store)
        self.specs, self.tallies, self.records = JobSpecs(self.store), Tallies(), Records()
        self.jobs = Jobs(self.store, self.nodes, self.specs, self.membership.nodes,
                         clock=self.clock, forget=(self.tallies, self.records))
        self.deployer = Deployer(self.store, self.nodes, self.jobs, self.specs,
                                 self.membership.nodes, Calibration(), Planner(0), self.clock)
        self.recovery = Recovery(self.store, self.nodes, self.jobs, self.deployer, self.specs,
                                 self.tallies, self.records, self.membership, NoDrains(),
                                 NoGroups(), self.clock)
        self.job = self.jobs.submit(submission(steps=20, stages=2, checkpoint_every=5))
        # planned over two nodes: the third is the spare a recovery moves to
        two = self.store.nodes()[:2]
        self.deployer.start(self.job, two, [])
        assert self.state() == "RUNNING"
        self.nodes.loads.clear()

    def state(self) -> str:
        return state_name(self.store.job(self.job).state)

    def plan(self) -> PlanView:
        return PlanView(self.store.job(self.job).plan)

    def checkpoint(self, step: int) -> None:
        """Steps up to ``step`` done and ``step`` a complete checkpoint."""
        info = self.store.job(self.job)
        for s in range(info.step + 1, step + 1):
            self.store.record_step(self.job, s, 1.0, 8.0, self.clock())
        fields = S.JobInfo()
        fields.CopyFrom(self.store.job(self.job))
        fields.checkpoint_step = step
        self.store.set_recovery(self.job, fields, self.clock())
        self.tallies.completed(self.job, step)

    def stopped(self, epoch: int) -> list[str]:
        """Addresses told to stop the job's stages before ``epoch`` (on a thread: waited for)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            got = [a for a, r in self.nodes.stops if r.before_epoch == epoch]
            if len(got) == 2:
                return sorted(got)
            time.sleep(0.01)
        return sorted(a for a, r in self.nodes.stops if r.before_epoch == epoch)


def test_a_lost_node_rewinds_the_job_to_its_checkpoint_and_its_stage_moves_to_the_spare():
    w = World()
    w.checkpoint(10)
    w.store.record_step(w.job, 13, 1.0, 8.0, w.clock())
    before = w.plan()
    lost = before[StageKey(0, 1)]
    w.clock.advance(2)
    w.store.mark_lost(lost.node_id)
    w.recovery.nodes_lost({lost.node_id}, "left the swarm")
    info = w.store.job(w.job)
    assert (w.state(), info.epoch, info.resume_step) == ("RECOVERING", 1, 10)
    assert info.reason == f"node(s) {lost.node_name} left the swarm; rewinding to checkpoint " \
                          f"step 10"
    assert w.stopped(1) == sorted(w.plan().addresses())  # the old epoch's stages
    assert w.recovery.old_nodes(w.job) == {"id0", "id1"}
    w.recovery.nodes_lost({lost.node_id}, "left the swarm")  # the same loss twice: one epoch
    assert w.store.job(w.job).epoch == 1

    w.clock.advance(3)
    w.recovery.resume(w.job, w.membership.nodes())
    info = w.store.job(w.job)
    assert w.state() == "RUNNING" and info.epoch == 1
    view = PlanView(info.plan)
    assert view[StageKey(0, 1)].node_name == "node2"  # the spare
    assert view[StageKey(0, 0)].node_id == w.plan()[StageKey(0, 0)].node_id  # kept
    loads = {StageKey(r.replica, r.stage): r for r in w.nodes.loads}
    assert {r.resume_step for r in loads.values()} == {10}
    # the moved stage looks for its snapshot on the live nodes (its buddy, the others),
    # on its lost node last: a restorer that tried it first would wait out its data link's
    # redial (10 s) before the buddy's copy
    places = list(loads[StageKey(0, 1)].snapshot_sources)
    assert places[-1] == lost.address and lost.address not in places[:-1]
    buddy = before.buddy(StageKey(0, 1), 10 // 5)  # checkpoint_every=5
    assert buddy is not None and places[0] == buddy.address
    (rec,) = info.recoveries
    assert (rec.cause, rec.lost, rec.checkpoint_step, rec.steps_recomputed) == \
        ("loss", lost.node_name, 10, 3)
    assert (rec.moved_from, rec.moved_to) == (lost.node_name, "node2")
    assert rec.replan_seconds == pytest.approx(3.0) and rec.detect_seconds == 0.0
    assert w.recovery.old_nodes(w.job) == set()  # the record is done


def test_a_peer_that_does_not_answer_a_ping_is_declared_lost_and_detection_is_timed():
    w = World()
    w.checkpoint(5)
    peer = w.plan()[StageKey(0, 1)]
    w.nodes.dead.add(peer.address)
    reported = w.clock()
    assert w.recovery.suspect(w.store.job(w.job), S.StageReport(peer=peer.address))
    assert w.membership.declared and w.membership.declared[0][0] == peer.node_id
    w.clock.advance(4)  # the registry declares it: the job recovers from the suspicion on
    w.recovery.nodes_lost({peer.node_id}, "stopped answering")
    w.recovery.resume(w.job, w.membership.nodes())
    (rec,) = w.store.job(w.job).recoveries
    assert rec.time == reported + 4 and rec.detect_seconds == pytest.approx(4.0)


def test_a_peer_that_answers_is_not_lost():
    w = World()
    peer = w.plan()[StageKey(0, 0)]
    assert not w.recovery.suspect(w.store.job(w.job), S.StageReport(peer=peer.address))
    assert w.membership.declared == [] and w.state() == "RUNNING"
    assert not w.recovery.suspect(w.store.job(w.job), S.StageReport(peer="10.0.0.9:1"))


def test_an_outbound_only_peer_that_does_not_answer_a_ping_is_left_to_its_lease():
    w = World()
    peer = w.plan()[StageKey(0, 1)]
    w.nodes.dead.add(peer.address)  # its relay is down: a Ping through it fails

    def relayed():  # the registry lists the node as homed at a relay
        nodes = w.store.nodes()
        for n in nodes:
            if n.node_id == peer.node_id:
                n.relay = "10.0.0.5:7071"
        return nodes
    w.membership.nodes = relayed
    assert not w.recovery.suspect(w.store.job(w.job), S.StageReport(peer=peer.address))
    assert w.membership.declared == [] and w.state() == "RUNNING"
    w.membership.nodes = w.store.nodes  # a direct node that does not answer is lost at once
    assert w.recovery.suspect(w.store.job(w.job), S.StageReport(peer=peer.address))
    assert w.membership.declared[0][0] == peer.node_id


def test_no_surviving_snapshot_rewinds_to_the_checkpoint_before_and_resumes_there():
    w = World()
    w.checkpoint(5)
    w.checkpoint(10)
    lost = w.plan()[StageKey(0, 0)]
    w.store.mark_lost(lost.node_id)
    w.recovery.nodes_lost({lost.node_id}, "left the swarm")
    w.nodes.lost_snapshots.add(10)
    w.recovery.resume(w.job, w.membership.nodes())
    info = w.store.job(w.job)
    assert (w.state(), info.epoch, info.resume_step) == ("RECOVERING", 2, 5)
    assert info.reason == "no snapshot of step 10 survives; rewinding to checkpoint step 5"
    w.recovery.resume(w.job, w.membership.nodes())
    info = w.store.job(w.job)
    assert w.state() == "RUNNING" and info.recoveries[-1].checkpoint_step == 5


def test_a_job_that_fits_nowhere_after_the_loss_fails_with_the_figures():
    w = World()
    spec, view = w.specs.get(w.job), w.plan()
    needs = sorted(planner.stage_memory_bytes(spec.profile, a.layer_start, a.layer_end,
                                              spec.config, a.stage, view.depth(0),
                                              view.microbatches(0))
                   for a in view.stages.values())
    for n in w.store.nodes():  # room for either stage, not for both
        w.store.renew_node(n.node_id, node_pb2.Resources(
            flops=1e12, memory_bytes=int(needs[-1] + needs[0] / 2), device="cpu", cores=1),
            VERSIONS, w.clock())
    w.store.mark_lost("id2")  # no spare either
    lost = w.plan()[StageKey(0, 1)]
    w.store.mark_lost(lost.node_id)
    w.recovery.nodes_lost({lost.node_id}, "left the swarm")
    w.recovery.resume(w.job, w.membership.nodes())
    info = w.store.job(w.job)
    assert w.state() == "FAILED"
    assert info.reason.startswith(f"cannot recover from the loss of {lost.node_name}: stage 1 "
                                  f"(replica 0) needs")
    assert "MiB" in info.reason


def test_park_and_a_returning_client_move_through_waiting_in_new_epochs():
    w = World()
    w.checkpoint(5)
    w.recovery.park(w.job, "waiting for the client")
    info = w.store.job(w.job)
    assert (w.state(), info.epoch, info.resume_step) == ("WAITING", 1, 5)
    w.recovery.park(w.job, "waiting for the client")  # only a RUNNING job parks
    assert w.store.job(w.job).epoch == 1
    w.recovery.rewind_for_client(w.job, "the client is back")
    assert (w.state(), w.store.job(w.job).epoch) == ("RECOVERING", 2)
    w.recovery.resume(w.job, w.membership.nodes())
    (rec,) = w.store.job(w.job).recoveries
    assert w.state() == "RUNNING" and rec.cause == "the client's absence"
    assert {n.address for n in w.membership.nodes()} >= w.plan().addresses()


def test_a_job_that_ends_while_recovering_drops_its_record():
    w = World()
    lost = w.plan()[StageKey(0, 1)]
    w.recovery.nodes_lost({lost.node_id}, "left the swarm")
    assert w.recovery.old_nodes(w.job)
    w.jobs.cancel(w.job)
    assert w.recovery.old_nodes(w.job) == set()
    w.recovery.resume(w.job, w.membership.nodes())  # nothing to resume
    assert w.state() == "CANCELLED"


def test_a_swap_of_two_nodes_reads_as_each_stages_move():
    """``moves`` pairs each moved stage's old and new node in stage order: a rebalance that
    swapped two nodes' stages once read "moved n3, nat1 -> n3, nat1", as if nothing moved."""
    from fedpipe.recovery_text import recovery_what
    from fedpipe.tracker.replan import moves

    def plan(*names):
        return node_pb2.Plan(stages=[node_pb2.StageAssignment(stage=s, node_id=n, node_name=n)
                                     for s, n in enumerate(names)])

    assert moves(plan("n3", "nat1", "n5"), plan("nat1", "n3", "n5")) == ("n3, nat1", "nat1, n3")
    rec = tracker_pb2.Recovery(cause="rebalance", moved_from="n3, nat1", moved_to="nat1, n3")
    assert recovery_what(rec) == "moved n3, nat1 -> nat1, n3"
    assert moves(plan("a", "b"), plan("a", "b")) == ("", "")
    assert moves(plan("a"), plan("a", "c")) == ("-", "c")  # a stage new to the plan
