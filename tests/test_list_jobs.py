"""``ListJobs`` and ``fedpipe status``'s jobs table, in-process: a client lists its own
jobs, the operator (and a caller without TLS) every job, newest first, without plans.
Who may call it at all is the policy table's (tests/test_security.py's EXPECTED)."""
from __future__ import annotations

import io

import grpc
import pytest
from rich.console import Console

from client_fakes import FakeRpcError
from fedpipe.observe import status
from fedpipe.observe.source import GrpcSource
from fedpipe.proto import tracker_pb2 as S
from fedpipe.security import Role
from fedpipe.security.certs import Identity
from fedpipe.security.interceptor import _ATTR
from fedpipe.tracker.service import TrackerService
from tracker_fakes import Context, join, make_tracker, submission

pytestmark = pytest.mark.timeout(60)


def caller(role: Role, name: str) -> Context:
    """A servicer context whose caller presented ``role`` ``name``'s certificate."""
    ctx = Context()
    setattr(ctx, _ATTR, Identity(role, name, 1))
    return ctx


@pytest.fixture
def svc():
    tracker, _, _ = make_tracker()
    join(tracker, 2)
    svc = TrackerService(tracker)
    for owner in ("alice", "bob", "alice"):
        svc.admission.submit(submission(), owner, owner)
    tracker.tick()  # planned: the listed jobs leave their plans out
    yield svc


def test_a_client_lists_its_own_jobs_and_the_operator_every_job_newest_first(svc):
    every = svc.ListJobs(S.ListJobsRequest(), Context()).jobs  # no TLS: every job
    assert [j.owner for j in every] == ["alice", "bob", "alice"]
    assert [j.created for j in every] == sorted((j.created for j in every), reverse=True)
    assert all(j.plan.stages == [] and j.steps == 3 for j in every)
    assert all(svc.tracker.jobs.get(j.job_id).plan.stages for j in every)  # GetJob has it
    alice = svc.ListJobs(S.ListJobsRequest(), caller(Role.CLIENT, "alice")).jobs
    assert [j.job_id for j in alice] == [every[0].job_id, every[2].job_id]
    assert svc.ListJobs(S.ListJobsRequest(), caller(Role.CLIENT, "carol")).jobs == []
    admin = svc.ListJobs(S.ListJobsRequest(), caller(Role.ADMIN, "op")).jobs
    assert [j.job_id for j in admin] == [j.job_id for j in every]
    assert [j.job_id for j in svc.ListJobs(S.ListJobsRequest(limit=1), Context()).jobs] == \
        [every[0].job_id]
    with pytest.raises(AssertionError, match=r"aborted INVALID_ARGUMENT: limit must be "
                                             r"1\.\.1000, got 5000"):
        svc.ListJobs(S.ListJobsRequest(limit=5000), Context())


class Stub:
    """The tracker calls ``fedpipe status`` makes, answered by ``svc`` as ``ctx``'s caller,
    or refused with ``refusal``."""

    def __init__(self, svc: TrackerService, ctx: Context, refusal: grpc.RpcError | None = None):
        self.svc, self.ctx, self.refusal = svc, ctx, refusal

    def ListNodes(self, request, timeout=None):
        return self.svc.ListNodes(request, self.ctx)

    def ListJobs(self, request, timeout=None):
        if self.refusal is not None:
            raise self.refusal
        return self.svc.ListJobs(request, self.ctx)


def test_status_of_the_swarm_shows_the_jobs_its_caller_may_see(svc):
    # was: no jobs at all, so a job's id for `fedpipe status JOB` was nowhere to be found
    def shown(stub: Stub) -> str:
        out = io.StringIO()
        status.run_status(GrpcSource(stub), console=Console(file=out, width=200,
                                                            color_system=None))
        return out.getvalue()

    every = svc.ListJobs(S.ListJobsRequest(), Context()).jobs
    text = shown(Stub(svc, caller(Role.CLIENT, "bob")))
    assert "jobs, newest first" in text and every[1].job_id in text
    assert every[0].job_id not in text and every[2].job_id not in text  # alice's
    assert "PLANNING" in text or "DEPLOYING" in text or "RUNNING" in text, text
    assert "0/3" in text
    # a node's certificate may not list jobs (PERMISSION_DENIED): the swarm, no table
    denied = FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "a node may not call ListJobs")
    text = shown(Stub(svc, Context(), denied))
    assert "node(s) alive" in text and "jobs" not in text
    assert "no jobs" in shown(Stub(svc, caller(Role.CLIENT, "carol")))


class Vanishing:
    """The tracker's store, but the job ``gone`` was dropped (retention) between the
    listing of ids and its reading."""

    def __init__(self, store, gone: str):
        self.store, self.gone = store, gone

    def __getattr__(self, name):
        return getattr(self.store, name)

    def job(self, job_id: str):
        if job_id == self.gone:
            raise KeyError(job_id)
        return self.store.job(job_id)


def test_the_dashboards_job_list_is_list_jobs_and_a_job_dropped_meanwhile_is_left_out(svc):
    from fedpipe.tracker.http import Dashboard  # one walk of the jobs: observe.newest_jobs

    every = [j.job_id for j in svc.ListJobs(S.ListJobsRequest(), Context()).jobs]
    store = svc.tracker.jobs.store
    assert [j["id"] for j in Dashboard(store).jobs()["jobs"]] == every
    assert [j["id"] for j in Dashboard(store).jobs(limit=2)["jobs"]] == every[:2]
    # the newest dropped: the limit is still filled from older jobs
    dropped = Dashboard(Vanishing(store, every[0])).jobs(limit=2)["jobs"]
    assert [j["id"] for j in dropped] == every[1:]
    svc.tracker.jobs.store = Vanishing(store, every[0])
    assert [j.job_id for j in svc.ListJobs(S.ListJobsRequest(limit=2), Context()).jobs] == \
        every[1:]
