"""A job's states as the tracker reports them (``fedpipe.v1.JobState``) and the groups
of them the client, tracker and dashboard ask about."""
from __future__ import annotations

from ..proto import tracker_pb2


JobState = tracker_pb2.JobState
TERMINAL = frozenset({tracker_pb2.JOB_STATE_SUCCEEDED, tracker_pb2.JOB_STATE_FAILED,
                      tracker_pb2.JOB_STATE_CANCELLED})
"""States a job never leaves."""
ACTIVE = frozenset({tracker_pb2.JOB_STATE_PLANNING, tracker_pb2.JOB_STATE_DEPLOYING,
                    tracker_pb2.JOB_STATE_RUNNING, tracker_pb2.JOB_STATE_RECOVERING})
"""States in which a job holds (or is about to hold) stages on nodes."""
WAITING = tracker_pb2.JOB_STATE_WAITING
"""The job's client is gone: its stages are stopped (their snapshots kept) and it waits up to
its ``client_timeout`` for a client to resume it from its last complete checkpoint."""
CLIENT_TIMEOUT = 600.0
"""Default seconds a job waits for its client to come back (:attr:`JobSpec.client_timeout`)."""
NODE_LEFT = "left the swarm"
"""``NodeInfo.lost_reason`` of a node that stopped on purpose (it said it was leaving)."""
NODE_DRAINED = "left the swarm after its drain"
"""``NodeInfo.lost_reason`` of a node that left once drained (``fedpipe drain``, SIGTERM)."""


def state_name(state: int) -> str:
    """"RUNNING" for JOB_STATE_RUNNING, and so on."""
    name: str = tracker_pb2.JobState.Name(state)
    return name.removeprefix("JOB_STATE_")
