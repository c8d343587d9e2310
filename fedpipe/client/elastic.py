"""The client's part in elastic replica groups: which groups it feeds each step.

A job with ``min_replicas`` > 0 and several replica groups goes on when a
group is dropped (:mod:`fedpipe.tracker.replicas`). The client then shards
each later batch over the live groups only, in proportion to their planned
shares; the batch size it sends (``Envelope.batch_size``) stays the whole
batch, so each group's losses are still scaled by its share of it and the
shards' gradients sum to the batch-mean gradient. (The steps it fed before
it learnt of the loss lack the dropped group's shard; the all-reduce takes
the mean over the samples the live groups had, see
:mod:`fedpipe.runtime.elastic`.)

When the tracker has rebuilt a dropped group on spare nodes
(``JobInfo.replica_ready``), the client picks the step it joins at: the one
after the step it feeds next, which no live group has received yet. ``JoinReplica`` says
whether that is still possible (the step before must not be committed: the
donor keeps its state after it); if not, the client tries again at its next
step.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from .. import net
from ..net import timeouts
from ..proto import tracker_pb2 as S
from .reach import TrackerReach

log = logging.getLogger("fedpipe.client")

LOST_POLL = 0.1
"""Seconds between looks at the job while a group the feed could not reach is being dropped."""


class ElasticTracker(Protocol):
    """The tracker calls an elastic feed makes (a ``TrackerStub``, or a fake)."""

    def GetJob(self, request: S.GetJobRequest, timeout: float | None = None) -> S.JobInfo: ...

    def JoinReplica(self, request: S.JoinReplicaRequest, timeout: float | None = None
                    ) -> S.JoinReplicaReply: ...


class ElasticFeed:
    """Which replica groups the client feeds, step by step (module docstring).

    Args:
        stub: the tracker's stub.
        job_id: the job.
        info: the job as the feed started its epoch (with its replica fields).
        reach: says once that the tracker is unreachable and once that it is back
            (the client's; default: this feed's own).
    """

    def __init__(self, stub: ElasticTracker, job_id: str, info: S.JobInfo,
                 reach: TrackerReach | None = None):
        self.stub, self.job_id, self.info = stub, job_id, info
        self.reach = reach if reach is not None else TrackerReach()

    @staticmethod
    def applies(info: S.JobInfo) -> bool:
        """Whether the job's groups are elastic (the tracker fills its replica fields)."""
        return len(info.replica_members) > 0

    def _get(self) -> S.JobInfo:
        # while no tracker leads (a takeover, a restart) ask again: an unreachable tracker
        # is no node's trouble, and the feed must not wait for a recovery that never comes
        # (each step's membership is the leader's word: an elastic job waits for one)
        info = net.retry(lambda: self.stub.GetJob(S.GetJobRequest(job_id=self.job_id),
                                                  timeout=timeouts.CONTROL_RPC),
                         f"asking the tracker about job {self.job_id}",
                         max_delay=timeouts.RECONNECT_BACKOFF_MAX, on_retry=self.reach.lost)
        self.reach.reached()
        return info

    def members(self, step: int) -> tuple[list[int], S.JobInfo]:
        """The groups to feed at ``step`` and the job's info they come from; rebuilt groups
        are asked to join at ``step + 1`` (the live groups may be done with ``step - 1``
        already, waiting for this feed; the donor must still be told at its end of
        ``step``)."""
        info = self._get()
        for replica in info.replica_ready:
            reply = self.stub.JoinReplica(S.JoinReplicaRequest(job_id=self.job_id,
                                                               replica=replica, step=step + 1),
                                          timeout=timeouts.LOAD_STAGE_RPC)  # loads it
            if reply.accepted:
                log.info("job %s: %s", self.job_id, reply.reason)
                info = reply.job
            else:
                log.debug("job %s: replica group %d cannot join at step %d: %s", self.job_id,
                          replica, step, reply.reason)
        if info.epoch != self.info.epoch:
            return [], info  # a rewind: the caller's epoch is over
        self.info = info
        return sorted(m.replica for m in info.replica_members if m.since <= step), info

    def dropped(self, replica: int, epoch: int, halted: Callable[[], bool]) -> bool:
        """After a feed to group ``replica`` failed: wait until the tracker drops it (True),
        or the job leaves RUNNING or its epoch (False: it rewinds or ends)."""
        while not halted():
            info = self._get()
            if info.state != S.JOB_STATE_RUNNING or info.epoch != epoch:
                return False
            if replica not in {m.replica for m in info.replica_members}:
                return True
            time.sleep(LOST_POLL)
        return False
