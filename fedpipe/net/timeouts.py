"""Every deadline and interval fedpipe uses, in seconds, in one place.

Each can be overridden by an environment variable ``FEDPIPE_<NAME>`` (e.g.
``FEDPIPE_CONTROL_RPC=20``), as torchft's ``Manager`` lets ``TORCHFT_*``
variables override its timeouts. Call sites pass these names, never a literal.
"""
from __future__ import annotations

import os


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(f"FEDPIPE_{name}")
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"FEDPIPE_{name} must be a number of seconds, got {value!r}") from None
    if not seconds > 0:
        raise ValueError(f"FEDPIPE_{name} must be > 0 seconds, got {seconds}")
    return seconds


CONTROL_RPC = _seconds("CONTROL_RPC", 10.0)
"""A small control-plane call (register, get a job, cancel, stop a stage, list nodes)."""
HEARTBEAT_RPC = _seconds("HEARTBEAT_RPC", 5.0)
"""One heartbeat call."""
LEAVING_RPC = _seconds("LEAVING_RPC", 2.0)
"""The last heartbeat of a node that shuts down (best effort, it must not hold up the exit)."""
SUBMIT_RPC = _seconds("SUBMIT_RPC", 60.0)
"""Submitting a job (the tracker stores its layers)."""
LOAD_STAGE_RPC = _seconds("LOAD_STAGE_RPC", 120.0)
"""Loading one stage: unpickling its layers and building its optimizer."""
FETCH_STATE_RPC = _seconds("FETCH_STATE_RPC", 300.0)
"""Streaming one stage's weights to a client, or a stage's snapshot to the node restoring it
(over gRPC or a socket link's fetch)."""
PING_RPC = _seconds("PING_RPC", 30.0)
"""A Ping during a link measurement."""
PROBE_SEND_RPC = _seconds("PROBE_SEND_RPC", 120.0)
"""One bandwidth probe (a Send of at most 64 MiB)."""
MEASURE_LINKS_BASE = _seconds("MEASURE_LINKS_BASE", 60.0)
MEASURE_LINKS_PER_PEER = _seconds("MEASURE_LINKS_PER_PEER", 30.0)
"""A MeasureLinks call to a node with ``n`` peers may take ``BASE + n * PER_PEER``."""
FEED_RPC = _seconds("FEED_RPC", 600.0)
"""One Send of a step's inputs or targets from the client: it may wait that long for room in
the first stage's bounded inbox, which a slow pipeline empties one step at a time."""
CLIENT_LINK_RESUME = _seconds("CLIENT_LINK_RESUME", 2.0)
"""A client's socket data-plane link to a node it dials directly (:mod:`fedpipe.client.links`)
that broke is dialed again for this long, then failed: its send then fails UNAVAILABLE, and
the feed waits for the job to recover, as a gRPC Send to a node that died does at once. A
link through an outbound-only node's relay is dialed again as long as the nodes' own links
are (:attr:`fedpipe.net.dataplane.Timeouts.resume`): a relay restarting, or the node
re-homing at the next relay, takes seconds, and the link resumes with nothing lost."""
PEER_PING_RPC = _seconds("PEER_PING_RPC", 1.0)
"""The Ping that confirms a node a peer reported unreachable is gone: a killed node's
port refuses at once; a paused (SIGSTOP) one misses this deadline."""
REGISTER_PING_RPC = _seconds("REGISTER_PING_RPC", 5.0)
"""The Ping by which the tracker checks it can reach a registering node's address."""
THREAD_JOIN = _seconds("THREAD_JOIN", 5.0)
"""Waiting for a background thread to end at shutdown."""
HEALTH_RPC = _seconds("HEALTH_RPC", 2.0)
"""One ``grpc.health.v1.Health/Check`` call (a readiness probe)."""
SERVER_GRACE = _seconds("SERVER_GRACE", 1.0)
"""A stopping server lets calls in flight finish for this long, then cancels them."""
OBSERVE_LEADER = _seconds("OBSERVE_LEADER", 1.0)
"""How often a tracker's CLI looks whether it leads now, to serve its dashboard and
metrics (``--http-port``, ``--metrics-port``) only while it does."""
PROCESS_EXIT = _seconds("PROCESS_EXIT", 5.0)
"""Waiting for a process that was told to stop (SIGTERM) before it is killed."""
WATCH_RESUME = _seconds("WATCH_RESUME", 1.0)
"""Pause before a client watches a job again after losing the tracker."""
KEEPALIVE_TIME = _seconds("KEEPALIVE_TIME", 30.0)
"""A connection idle this long is pinged, so a dead peer is noticed."""
KEEPALIVE_TIMEOUT = _seconds("KEEPALIVE_TIMEOUT", 10.0)
"""A keepalive ping unanswered this long closes the connection."""
RECONNECT_BACKOFF_MIN = _seconds("RECONNECT_BACKOFF_MIN", 0.2)
RECONNECT_BACKOFF_MAX = _seconds("RECONNECT_BACKOFF_MAX", 2.0)
"""A channel redials a lost peer after this much, doubling up to the max: a restarted peer
is found again within 2 s, not after gRPC's default 2 min backoff."""


def measure_links(peers: int) -> float:
    """Deadline of a MeasureLinks call over ``peers`` peers, seconds."""
    return MEASURE_LINKS_BASE + MEASURE_LINKS_PER_PEER * peers
CLIENT_GRACE = _seconds("CLIENT_GRACE", 3.0)
"""A job's feeding client may be gone this long (a dropped connection being redialled)
before the job stops its stages and waits for a client (WAITING)."""
TRACKER_PAUSED = _seconds("TRACKER_PAUSED", 3.0)
"""A tracker whose process stopped running this long (a thread that wakes 4 times a second
saw that gap: SIGSTOPped, starved of CPU; :class:`fedpipe.tracker.pauses.PauseWatch`) gives
every live node a fresh lease and every gone client its grace again, instead of judging
them by a time it did not see."""
TRACKER_SILENT = _seconds("TRACKER_SILENT", 2.0)
"""A feeding client that has heard nothing of its job from the tracker for this long (a
step's event comes at every step) counts it as gone, and feeds on past its kept-batch
bound (:mod:`fedpipe.client.feed`). A job slower than a step per this many seconds may keep
more batches than the bound while a checkpoint is late; never fewer."""
TRACKER_PROBE_RPC = _seconds("TRACKER_PROBE_RPC", 3.0)
"""A client whose job's watch has heard nothing for :data:`TRACKER_SILENT` s asks the tracker
about the job with this deadline: one that hangs past it (a tracker stopped or cut off,
which refuses no connection) is said once, as a refused connection is
(:class:`fedpipe.client.reach.SilenceProbe`)."""
CLIENT_REATTACH = _seconds("CLIENT_REATTACH", 15.0)
"""After a tracker (re)start, the feeding clients of running jobs have this long to watch
their jobs again before the jobs wait for a client."""


LEADER_WAIT = _seconds("LEADER_WAIT", 300.0)
"""What cannot go on without a leading tracker waits for one this long, then fails, saying
so: a replica groups' step commit (the stage fails, and its job once a tracker leads); a
feed waiting for its job's recovery (the client's job fails). Meanwhile a running job's
data plane trains on (:mod:`fedpipe.client.feed`, :mod:`fedpipe.node.reports`), and the
recoveries and drains the tracker owes are done by the next one that leads."""
QUORUM_POLL = _seconds("QUORUM_POLL", 0.5)
"""Elastic replica groups: a ring member that waited this long for a message asks the tracker
whether the step's membership changed (a group dropped) before it waits again."""
QUORUM_COMMIT_WAIT = _seconds("QUORUM_COMMIT_WAIT", 2.0)
"""Elastic replica groups: one ask for a step's commit blocks at the tracker at most this
long (the stage asks again until the step is decided)."""
QUORUM_RPC = QUORUM_COMMIT_WAIT + CONTROL_RPC
"""Deadline of one ReplicaQuorum call: its wait plus a control call's."""
HEAL_SNAPSHOT_WAIT = _seconds("HEAL_SNAPSHOT_WAIT", 60.0)
"""A rebuilt replica group's stage waits this long for the state its donor keeps after the
step before the join (the donor gets there at its own pace)."""
IDLE_STREAM = _seconds("IDLE_STREAM", 30.0)
"""A node's data-plane stream (Send, PutSnapshot, FetchState, FetchSnapshot) that carries
nothing for this long while it belongs to no running job on that node (none named yet, or
its job's stages there have ended) is closed. A running job's streams are never cut for
idling (they idle between DiLoCo outer steps on purpose); keepalive finds dead ones."""
WEIGHTS_WAIT = _seconds("WEIGHTS_WAIT", 600.0)
"""A stage whose initial weights the client streams (PutWeights) waits this long for them,
then fails (the client is gone, or cannot reach the node)."""
PUT_WEIGHTS_RPC = _seconds("PUT_WEIGHTS_RPC", 1800.0)
"""Deadline of one PutWeights call: a stage's weights, streamed by the client (over a socket
link: from its last tensor sent to the node's acknowledgement of the stream's end)."""
REVERSE_DIAL_WAIT = _seconds("REVERSE_DIAL_WAIT", 10.0)
"""A reachable node about to send to an outbound-only peer (one behind NAT, homed at a relay)
waits this long for the data link that peer dials itself when its stage loads (a direct
connection), before it dials the peer's relayed address instead."""
DATA_FIRST_RECORD = _seconds("DATA_FIRST_RECORD", 5.0)
"""A connection accepted on a socket data port has this long, from its accept, for its TLS
handshake and its first record (the preface) in all; then it is refused (GOAWAY
DEADLINE_EXCEEDED, naming this limit) and closed. So a connection that stalls before its
preface, or drips it a byte at a time, holds one of the listener's connection slots
(:mod:`fedpipe.net.dataplane.caps`) for this long at most."""
DATA_SILENT_AFTER_PREFACE = _seconds("DATA_SILENT_AFTER_PREFACE", 600.0)
"""A connection accepted on a socket data port for a link that has carried nothing yet must
send its first record after its preface within this long, else it is closed (no GOAWAY:
a fedpipe dialer's link may redial it, and resumes). So a caller that prefaces and then
falls silent holds a listener's slot (:mod:`fedpipe.net.dataplane.caps`) for this long
at most, not for ever. A link that carried a tensor either way is never cut for idling:
stages idle between DiLoCo outer steps on purpose."""
GOAWAY_LINGER = _seconds("GOAWAY_LINGER", 1.0)
"""A socket data-plane side that refuses a connection (GOAWAY) reads what its peer still
sends for this long at most before it closes, so the close does not reset the connection
before the peer has read the refusal."""
RELAY_HANDSHAKE = _seconds("RELAY_HANDSHAKE", 10.0)
"""A node's homing at a relay: TCP connect, TLS handshake and HELLO until ALLOCATED (both sides)."""
RELAY_FAILOVER = _seconds("RELAY_FAILOVER", 5.0)
"""How long a node that lost its relay keeps trying that relay (to keep its addresses) before
it tries the next one of its ``--relay`` list."""
RELAY_FIRST_BYTE = _seconds("RELAY_FIRST_BYTE", 10.0)
"""A connection to a relayed node's port must send its first byte within this long, else the
relay closes it (every fedpipe dialer speaks first: a TLS ClientHello, an HTTP/2 preface, a
data-plane PREFACE), so idle connections cannot hold the node's stream slots."""
FEED_UNREACHABLE = _seconds("FEED_UNREACHABLE", 10.0)
"""A client feeding a node whose address refuses connections (an outbound-only node whose
relay restarts) tries again this long while the job's epoch holds, before it waits for the
job to recover."""
WEIGHTS_IDLE = _seconds("WEIGHTS_IDLE", 120.0)
"""A stage's initial-weights stream that took no tensor for this long may be taken over by
another stream (its client went mid-stream): :class:`fedpipe.node.initial.Pending`."""
