"""Elastic replica groups in-process: the tracker's quorum (ReplicaSet) and the
quorum-driven all-reduce (ElasticGradientSync), with threads and queues."""
from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
from torch import nn

from fedpipe.net import timeouts
from fedpipe.proto import tracker_pb2
from fedpipe.runtime.allreduce import StageSpan
from fedpipe.runtime.elastic import ElasticGradientSync, GroupDropped
from fedpipe.spec import DiLoCo, JobSpec, JobSpecError, PlanView, StageKey
from fedpipe.tracker.replicas import ReplicaError, ReplicaSet

pytestmark = pytest.mark.timeout(60)

K = StageKey


def two_stage_groups(n):
    return {g: frozenset({K(g, 0), K(g, 1)}) for g in range(n)}


# -- ReplicaSet ---------------------------------------------------------------

def test_a_step_commits_once_every_stage_of_every_member_reduced_it():
    rs = ReplicaSet(two_stage_groups(2), min_replicas=1)
    for key in (K(0, 0), K(0, 1), K(1, 0)):
        q = rs.ask(key, 0, 0, reduced=True)
        assert not q.committed and q.members == (0, 1)
    q = rs.ask(K(1, 1), 0, 0, reduced=True)
    assert q.committed and q.members == (0, 1) and q.version == 0
    # a late asker of a committed step learns the same decision, whatever it knows
    assert rs.ask(K(0, 0), 0, 7, reduced=False).committed


def test_a_drop_before_the_commit_makes_every_survivor_sum_again_over_the_survivors():
    rs = ReplicaSet(two_stage_groups(3), min_replicas=2)
    for key in (K(0, 0), K(0, 1), K(1, 0), K(1, 1)):
        assert not rs.ask(key, 5, 0, reduced=True).committed
    assert rs.drop([2]) == 1
    answers = [rs.ask(key, 5, 0, reduced=True) for key in (K(0, 0), K(0, 1), K(1, 0), K(1, 1))]
    assert all(not a.committed and a.version == 1 and a.members == (0, 1) for a in answers)
    assert not rs.committed(5)  # the old version's reports no longer count
    for key in (K(0, 0), K(0, 1), K(1, 0)):
        rs.ask(key, 5, 1, reduced=True)
    assert rs.ask(K(1, 1), 5, 1, reduced=True).committed
    assert rs.ask(K(2, 0), 6, 0, reduced=False).dropped


def test_below_min_replicas_the_drop_is_refused_so_the_job_rewinds():
    rs = ReplicaSet(two_stage_groups(2), min_replicas=2)
    assert not rs.enough([1])
    with pytest.raises(ReplicaError, match="fewer than min_replicas 2"):
        rs.drop([1])
    assert rs.live == (0, 1) and rs.version == 0


def test_a_join_takes_part_from_its_step_and_tells_the_donor_at_the_step_before():
    rs = ReplicaSet(two_stage_groups(2), min_replicas=1)
    rs.drop([1])
    with pytest.raises(ReplicaError, match="join at step 5 or later"):
        rs.join(1, 3, donor=0, committed_floor=3)
    v = rs.join(1, 5, donor=0, committed_floor=3)
    assert rs.members(4) == (0,) and rs.members(5) == (0, 1)
    rs.ask(K(0, 0), 4, v, reduced=True)
    q = rs.ask(K(0, 1), 4, v, reduced=True)
    assert q.committed and q.members == (0,) and q.donate_to == (1,)
    assert rs.ask(K(1, 0), 4, v, reduced=False).dropped  # not a member yet: it does not sync
    with pytest.raises(ReplicaError, match="is live"):
        rs.join(1, 9, donor=0, committed_floor=4)


def test_a_joining_group_whose_donor_is_lost_drops_with_it():
    rs = ReplicaSet(two_stage_groups(3), min_replicas=1)
    rs.drop([2])
    rs.join(2, 4, donor=1, committed_floor=0)
    rs.drop([1])
    assert rs.live == (0,)


def test_a_commit_names_the_next_steps_members_only_while_the_membership_holds():
    rs = ReplicaSet(two_stage_groups(3), min_replicas=1)
    for key in (K(0, 0), K(0, 1), K(1, 0), K(1, 1), K(2, 0)):
        assert rs.ask(key, 9, 0, reduced=True, next_step=19).next_members == ()  # not committed
    q = rs.ask(K(2, 1), 9, 0, reduced=True, next_step=19)
    assert q.committed and q.next_members == (0, 1, 2)
    assert rs.ask(K(0, 0), 9, 0, reduced=False).next_members == ()  # not asked for
    rs.drop([2])  # a later membership: the stage must ask (and may need the new plan)
    assert rs.ask(K(0, 0), 9, 0, reduced=False, next_step=19).next_members == ()
    v = rs.join(2, 15, donor=0, committed_floor=9)
    for key in (K(0, 0), K(0, 1), K(1, 0), K(1, 1)):
        q = rs.ask(key, 12, v, reduced=True, next_step=16)
    assert q.committed and q.members == (0, 1) and q.next_members == (0, 1, 2)  # 2 joins at 15
    assert rs.ask(K(0, 0), 12, v, reduced=False, next_step=13).next_members == (0, 1)
    assert rs.ask(K(0, 0), 12, v, reduced=False, next_step=12).next_members == ()  # not later


def test_a_waiting_ask_wakes_when_the_last_stage_reports():
    rs = ReplicaSet({0: frozenset({K(0, 0)}), 1: frozenset({K(1, 0)})}, min_replicas=1)
    got = {}
    t = threading.Thread(target=lambda: got.update(q=rs.ask(K(0, 0), 0, 0, True, wait=10)))
    t.start()
    time.sleep(0.1)
    rs.ask(K(1, 0), 0, 0, reduced=True)
    t.join(5)
    assert got["q"].committed


def test_min_replicas_is_validated_and_travels():
    spec = JobSpec(steps=1, optimizer=b"o", loss_fn=b"l", microbatches=2, batch_size=2,
                   replicas=2, min_replicas=1).validate()
    assert JobSpec.from_proto(spec.to_proto()).min_replicas == 1 and spec.elastic
    with pytest.raises(JobSpecError, match="min_replicas: 3 is more than the 2"):
        spec.with_(min_replicas=3).validate()
    with pytest.raises(JobSpecError, match="min_replicas: must be >= 0"):
        spec.with_(min_replicas=-1).validate()
    assert not JobSpec(steps=1).elastic


# -- ElasticGradientSync over threads ------------------------------------------

class Wire:
    """Queues between stages, keyed by (receiver, kind, step, tag)."""

    def __init__(self):
        self.boxes: dict = {}
        self.cond = threading.Condition()
        self.dead: set[int] = set()
        self.waited: set[tuple[int, int]] = set()  # (replica, step) of each recv begun

    def transport(self, me):
        wire = self

        class T:
            def send_to(self, peer, kind, step, tag, tensor, batch_size=1, codec="raw"):
                if me.replica in wire.dead:
                    return  # a dead group's messages never arrive
                with wire.cond:
                    wire.boxes[(peer, kind, step, tag)] = tensor.clone()
                    wire.cond.notify_all()

            def recv(self, kind, step, tag, timeout=None):
                with wire.cond:
                    wire.waited.add((me.replica, step))
                    wire.cond.notify_all()
                    if not wire.cond.wait_for(lambda: (me, kind, step, tag) in wire.boxes,
                                              timeout=timeout):
                        raise TimeoutError
                    return wire.boxes.pop((me, kind, step, tag)), 1

            def send(self, *a):
                raise AssertionError("no pipeline here")

        return T()


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def batches(steps, size=12):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 4, generator=g, dtype=torch.float64),
             torch.randn(size, 1, generator=g, dtype=torch.float64)) for _ in range(steps)]


def run_groups(data, groups, rs, *, kill=None, lr=0.1):
    """Train one single-stage replica per group with elastic all-reduce; group
    ``kill = (g, step)`` stops sending at that step, and the test's "tracker" drops it.
    Returns each group's model and sync."""
    wire = Wire()
    spans = [StageSpan(K(g, 0), 0, 3) for g in groups]
    models = {g: model() for g in groups}
    syncs, errors = {}, {}

    def replica(g):
        m = models[g]
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        holder = {}
        syncs[g] = sync = ElasticGradientSync(
            m, K(g, 0), spans, wire.transport(K(g, 0)),
            functools.partial(rs.ask, K(g, 0)),
            lambda: holder["n"])
        try:
            for step, (x, y) in enumerate(data):
                members = rs.members(step)
                shares = torch.tensor_split(torch.arange(x.shape[0]), len(members))
                idx = shares[members.index(g)]
                loss = nn.functional.mse_loss(m(x[idx]), y[idx]) * (len(idx) / x.shape[0])
                loss.backward()
                holder["n"] = (len(idx), x.shape[0])
                if kill == (g, step):
                    wire.dead.add(g)
                    return
                sync(step)
                opt.step()
                opt.zero_grad()
        except GroupDropped as e:
            errors[g] = e

    threads = [threading.Thread(target=replica, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    if kill is not None:
        # the survivors wait in the ring for the dead group's share of the step meanwhile
        # (they have begun it, so it cannot complete) before the "tracker" drops the group
        with wire.cond:
            assert wire.cond.wait_for(lambda: all((g, kill[1]) in wire.waited for g in groups
                                                  if g != kill[0]), 30)
        time.sleep(0.1)
        rs.drop([kill[0]])
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return models, syncs, errors


def reference(data, lost_at=None, lost=None, n_groups=3, lr=0.1):
    """Single-process SGD on the mean loss over the samples the live groups trained on."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    for step, (x, y) in enumerate(data):
        if lost_at is not None and step == lost_at:
            keep = torch.cat([p for g, p in enumerate(torch.tensor_split(
                torch.arange(x.shape[0]), n_groups)) if g != lost])
            x, y = x[keep], y[keep]
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return m


def test_undisturbed_elastic_allreduce_is_full_batch_sgd_and_groups_agree_bit_for_bit(
        monkeypatch):
    monkeypatch.setattr(timeouts, "QUORUM_POLL", 60.0)  # no look while a ring message is late
    data = batches(4)
    rs = ReplicaSet({g: frozenset({K(g, 0)}) for g in range(3)}, min_replicas=2)
    asks = []
    real = rs.ask

    def ask(key, step, version, reduced, wait=0.0, next_step=0):
        asks.append((key.replica, step, reduced))
        return real(key, step, version, reduced, wait, next_step)

    rs.ask = ask  # counts the round trips; the set answers
    models, syncs, _ = run_groups(data, range(3), rs)
    # one round trip per step (its commit), the members of each later step named by the
    # commit of the step before
    for g in range(3):
        first = {}
        for replica, step, reduced in asks:
            if replica == g:
                first.setdefault(step, reduced)
        assert first == {0: False, 1: True, 2: True, 3: True}
    ref = reference(data)
    for g in range(3):
        for p, q in zip(models[g].parameters(), models[0].parameters()):
            assert torch.equal(p, q)
        for p, q in zip(models[g].parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
        assert syncs[g].retries == 0


def test_a_group_lost_mid_step_drops_out_and_survivors_average_over_their_own_samples():
    data = batches(5)
    rs = ReplicaSet({g: frozenset({K(g, 0)}) for g in range(3)}, min_replicas=2)
    models, syncs, _ = run_groups(data, range(3), rs, kill=(2, 2))
    # step 2 is the mean over groups 0 and 1's shards; steps 3, 4 are re-sharded over them
    ref = reference(data[:3], lost_at=2, lost=2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data[3:]:
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    for p, q in zip(models[0].parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert syncs[0].retries >= 1 and syncs[0].quorum.members == (0, 1)
    assert rs.version == 1


def test_a_stage_of_a_dropped_group_is_told_to_stop():
    data = batches(3)
    rs = ReplicaSet({g: frozenset({K(g, 0)}) for g in range(3)}, min_replicas=1)
    rs.drop([2])
    models, _, errors = run_groups(data, range(2), rs)
    sync = ElasticGradientSync(models[0], K(2, 0), [StageSpan(K(g, 0), 0, 3) for g in range(3)],
                               Wire().transport(K(2, 0)),
                               functools.partial(rs.ask, K(2, 0)), lambda: (4, 12))
    with pytest.raises(GroupDropped, match="replica group 2 was dropped"):
        sync(3)
    assert not errors


@pytest.mark.parametrize("config", [DiLoCo(inner_steps=2, outer_lr=0.7, outer_momentum=0.9),
                                    DiLoCo.sparseloco(inner_steps=2)], ids=["dense", "sparseloco"])
def test_elastic_diloco_outer_steps_go_on_over_the_survivors_who_agree_bit_for_bit(config):
    from fedpipe.runtime.elastic import ElasticOuterSync

    data, groups, H = batches(8), range(3), config.inner_steps
    rs = ReplicaSet({g: frozenset({K(g, 0)}) for g in groups}, min_replicas=2)
    wire = Wire()
    spans = [StageSpan(K(g, 0), 0, 3) for g in groups]
    models = {g: model() for g in groups}
    syncs = {}

    def replica(g):
        m = models[g]
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        holder = {}
        syncs[g] = sync = ElasticOuterSync(
            m, K(g, 0), spans, config, [1, 1, 1], wire.transport(K(g, 0)),
            functools.partial(rs.ask, K(g, 0)),
            lambda: holder["n"], last_step=len(data) - 1)
        for step, (x, y) in enumerate(data):
            members = rs.members(step)
            idx = torch.tensor_split(torch.arange(x.shape[0]), len(members))[members.index(g)]
            (nn.functional.mse_loss(m(x[idx]), y[idx]) * (len(idx) / x.shape[0])).backward()
            holder["n"] = (len(idx), x.shape[0])
            sync.rescale_gradients(step)
            opt.step()
            opt.zero_grad()
            if g == 2 and step == 4:  # dies before the outer step after step 5
                wire.dead.add(g)
                return
            sync(step)

    threads = [threading.Thread(target=replica, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    time.sleep(1.5)
    rs.drop([2])
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    assert syncs[0].quorum.members == (0, 1) and syncs[0].outer_step == len(data) // H
    assert syncs[0].retries >= 1  # it waited for group 2, then averaged without it
    assert not torch.equal(next(models[0].parameters()), next(models[2].parameters()))


# -- the tracker's side, in-process over fake nodes ----------------------------

def elastic_job(min_replicas):
    from test_jobs import report
    from tracker_fakes import join, make_tracker, submission

    tracker, nodes, clock = make_tracker(lease=10.0)
    join(tracker, 3)
    job = tracker.jobs.submit(submission(steps=20, stages=1, replicas=2, checkpoint_every=5,
                                         replica_sync="allreduce", min_replicas=min_replicas))
    tracker.tick()
    info = tracker.jobs.get(job)
    assert info.state == tracker_pb2.JOB_STATE_RUNNING, info.reason
    for step in range(1, 4):
        for g in (0, 1):
            report(tracker, job, K(g, 0), tracker_pb2.StageReport.STATUS_STEP, step=step,
                   loss=0.5, samples=4, seconds=0.1)
    return tracker, nodes, clock, job


def test_the_tracker_drops_a_lost_group_heals_it_on_the_spare_and_joins_it_where_asked():
    from test_jobs import lose

    tracker, nodes, clock, job = elastic_job(min_replicas=1)
    plan = PlanView(tracker.jobs.get(job).plan)
    lost = plan[K(1, 0)].node_id
    lose(tracker, clock, lost)
    info = tracker.replicas.annotate(tracker.jobs.get(job))
    assert info.state == tracker_pb2.JOB_STATE_RUNNING and info.epoch == 0, info.reason
    assert [m.replica for m in info.replica_members] == [0] and info.replica_version == 1
    assert any(r.replicas == [1] for _, r in nodes.stops)  # only group 1's stages stopped
    # a survivor's quorum: group 0 alone; the dropped group's stage is told to stop
    ask = tracker_pb2.ReplicaQuorumRequest(job_id=job, epoch=0, replica=0, stage=0,
                                           node_id=plan[K(0, 0)].node_id, step=3, version=0)
    reply = tracker.replicas.ask(ask)
    assert list(reply.members) == [0] and reply.version == 1 and reply.plan.stages
    assert {a.replica for a in reply.plan.stages} == {0}  # the live groups' stages only
    tracker.tick()  # the scheduler heals: the spare node takes group 1
    info = tracker.replicas.annotate(tracker.jobs.get(job))
    assert list(info.replica_ready) == [1]
    nodes.loads.clear()
    joined = tracker.replicas.join(job, 1, 8)
    assert joined.accepted, joined.reason
    (load,) = nodes.loads
    assert (load.replica, load.resume_step) == (1, 8) and load.snapshot_wait_seconds > 0
    assert load.snapshot_sources == [plan[K(0, 0)].address]  # the donor
    new = PlanView(tracker.jobs.get(job).plan)
    assert new[K(1, 0)].node_id not in {lost, plan[K(0, 0)].node_id}
    # before the load, the donor was told the plan that names the joining node (under
    # TLS it serves its state only to nodes it knows are assigned)
    ((donor, told, loads_before),) = nodes.assigns
    assert (donor, loads_before) == (plan[K(0, 0)].address, 0)
    assert sorted(told.node_names) == sorted(a.node_name for a in new.stages.values())
    info = tracker.replicas.annotate(tracker.jobs.get(job))
    assert info.epoch == 0 and {(m.replica, m.since) for m in info.replica_members} == \
        {(0, 0), (1, 8)}


def test_the_tracker_rewinds_a_job_left_below_min_replicas():
    from test_jobs import lose

    tracker, nodes, clock, job = elastic_job(min_replicas=2)
    lose(tracker, clock, PlanView(tracker.jobs.get(job).plan)[K(1, 0)].node_id)
    info = tracker.jobs.get(job)
    assert info.state == tracker_pb2.JOB_STATE_RECOVERING and info.epoch == 1, info.reason
