"""The feed: what a client sends each step, replay from a checkpoint cut, back-pressure,
and re-sharding over the live replica groups.

Each step the client draws one batch, shards it over the plan's replica groups in
proportion to their planned shares, and sends each group's inputs to its first
stage and its targets to its last (one tensor each, all its microbatches;
``fedpipe.v1.Envelope.microbatches``).

Replay. The feed keeps each batch it sent since the second-newest complete
checkpoint (:class:`KeptBatches`), so when a lost node makes the job rewind to its
last complete checkpoint (or the one before, if no snapshot of the last
survived) the same batches are sent again, in the same order, and a synchronous
job ends as if nothing happened. The bound: :data:`FEED_KEEP_CHECKPOINTS` *
``checkpoint_every`` batches (the interval being taken, and the two complete ones
a rewind may go back to). At the bound the feed pauses until the next checkpoint
completes; it never drops a batch it may need.

Without a tracker. The feed learns of complete checkpoints from its watch's events
(:meth:`~.watch.JobWatch.known`), so between checkpoints it asks the tracker nothing,
and the job's data plane trains on while no tracker leads (a restart, a failover).
While the tracker is silent (no word of the job for
:data:`~fedpipe.net.timeouts.TRACKER_SILENT` s, or the watch's stream is down), no
checkpoint can be known complete, so the feed keeps every batch since the last one it
knows of, past the bound, up to
:data:`FEED_OUTAGE_KEEP_BYTES`: a node lost meanwhile rewinds the job to that
checkpoint once a tracker leads again, and those batches are fed again.

Back-pressure. A node refuses a send with RESOURCE_EXHAUSTED while its data-plane
slots or its mailbox are full; the feed waits and sends again, a bounded number of
times (:data:`FEED_BUSY_ATTEMPTS`).

Elastic replica groups (``min_replicas`` > 0, :mod:`.elastic`): each step is
sharded over the live groups only, and a group the feed cannot reach is dropped
by the tracker while the others go on.

The job's state comes from the feeder's watch (:mod:`.watch`); the feed's calls
on the tracker and the nodes go through :class:`FeedTracker` and
:class:`NodeLink`, so a test drives it in-process with fakes.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import grpc
import torch

from .. import net
from ..net import dataplane, timeouts
from ..net.trackers import unsent
from ..proto import node_pb2, tracker_pb2 as S
from ..runtime import checkpoint
from ..spec import PlanView, StageKey
from ..wire import frames, rpc
from . import checkpoints, links
from .elastic import ElasticFeed, ElasticTracker
from .watch import Halted, JobWatch
from .weights import WeightStreamer, weight_frames

log = logging.getLogger("fedpipe.client")

Batch = tuple[torch.Tensor, torch.Tensor]

FEED_KEEP_CHECKPOINTS = 3
"""The feed keeps the batches of at most this many checkpoint intervals (module docstring)."""
NODE_TROUBLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                          grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED,
                          grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Feed errors that mean a node is gone or its stage moved on, not that the data is bad:
the feed waits for the job to recover (or end) instead of giving up."""
FEED_REDIAL = 0.5
"""Seconds between feeds to a node whose address refused the connection (see
:data:`~fedpipe.net.timeouts.FEED_UNREACHABLE`)."""
FEED_OUTAGE_KEEP_BYTES = 1 << 30
"""While the tracker is silent the feed keeps at most this many bytes of batches (inputs
and targets) past the bound (module docstring), then waits for the tracker."""
RECOVERY_POLL = 0.05
"""Seconds between looks at a job whose feed paused (recovery, or the kept-batch bound),
while the watch's stream is down (it wakes the feed on each event otherwise)."""
AFTER_FEED_POLL = 0.25
"""Seconds between looks at a job the feed has given every step to (it may still rewind),
while the watch's stream is down."""
FEED_BUSY_ATTEMPTS = 30
FEED_BUSY_MAX_DELAY = 4.0
"""A feed call refused with RESOURCE_EXHAUSTED (the node is busy: its data-plane
slots or its mailbox are full) is tried again up to this many times in all, backing
off from 0.2 s to this many seconds apart (about 100 s in all), before the job fails."""


class FeedTracker(ElasticTracker, Protocol):
    """The tracker calls the feed makes besides the watch's (a ``TrackerStub``, or a fake):
    RestoreJob, and an elastic job's GetJob and JoinReplica."""

    def RestoreJob(self, request: S.RestoreJobRequest, timeout: float | None = None
                   ) -> S.JobInfo: ...


class NodeLink(Protocol):
    """The feed's calls on its job's nodes, one try each (the feed retries)."""

    def send(self, node: node_pb2.StageAssignment, envelope: node_pb2.Envelope,
             tensor: torch.Tensor) -> None:
        """Send one tensor with its envelope to the node that runs the stage ``node``.

        Raises:
            grpc.RpcError: RESOURCE_EXHAUSTED (the node is busy), or any other refusal.
        """

    def put_snapshot(self, node: node_pb2.StageAssignment, envelope: node_pb2.Envelope,
                     snapshot: checkpoint.Snapshot) -> None:
        """Put a stage's snapshot on the node that runs the stage ``node``; return once it
        kept it.

        Raises:
            grpc.RpcError: the node refused it (PutSnapshot's checks), or is unreachable.
        """


class NodeStubs(Protocol):
    """Where the client keeps one stub per node (:meth:`fedpipe.Client.node`) and its
    socket data plane (:meth:`fedpipe.Client.data_plane`)."""

    def node(self, address: str) -> rpc.NodeStub: ...

    def data_plane(self) -> dataplane.DataPlane | None: ...


class ChannelNodes:
    """:class:`NodeLink` (and :class:`~.weights.WeightLink`) over the client's links to the
    nodes: a tensor (a snapshot, a stage's initial weights) over the socket data plane to
    a node that offers a data port (:mod:`.links`), over gRPC's ``Send``
    (``PutSnapshot``, ``PutWeights``) to one that does not (or when the client has no
    socket plane)."""

    def __init__(self, stubs: NodeStubs):
        self.stubs = stubs

    def send(self, node: node_pb2.StageAssignment, envelope: node_pb2.Envelope,
             tensor: torch.Tensor) -> None:
        plane = self.stubs.data_plane() if node.data_address else None
        if plane is not None:
            links.send(plane, node, envelope, tensor)
            return
        rpc.send(self.stubs.node(node.address), frames.encode_frames(tensor, envelope=envelope),
                 timeout=timeouts.FEED_RPC)

    def put_snapshot(self, node: node_pb2.StageAssignment, envelope: node_pb2.Envelope,
                     snapshot: checkpoint.Snapshot) -> None:
        plane = self.stubs.data_plane() if node.data_address else None
        if plane is not None:
            links.put_snapshot(plane, node, envelope, snapshot)
            return
        self.stubs.node(node.address).PutSnapshot(checkpoint.to_frames(snapshot, envelope),
                                                  timeout=timeouts.FETCH_STATE_RPC)

    def put_weights(self, node: node_pb2.StageAssignment, envelope: node_pb2.Envelope,
                    tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A stage's initial weights (``("LAYER.KEY", tensor)``, read as they are sent) to
        the node that runs it; return once the stage has them (a :class:`WeightLink`).

        Raises:
            grpc.RpcError: the node refused them (``PutWeights``' checks), or is
                unreachable.
        """
        plane = self.stubs.data_plane() if node.data_address else None
        if plane is not None:
            links.put_weights(plane, node, envelope, tensors)
            return
        self.stubs.node(node.address).PutWeights(weight_frames(envelope, tensors),
                                                 timeout=timeouts.PUT_WEIGHTS_RPC)


@dataclass(frozen=True)
class GroupFeed:
    """Where and how one replica group takes its share of each batch.

    Attributes:
        first: the group's first stage (takes the inputs).
        last: its last stage (takes the targets).
        microbatches: microbatches per step in this group.
        share: the group's planned share of each batch, in samples (relative).
    """

    first: node_pb2.StageAssignment
    last: node_pb2.StageAssignment
    microbatches: int
    share: int

    @classmethod
    def of(cls, view: PlanView) -> list["GroupFeed"]:
        """One per replica group of ``view``, in group order."""
        return [cls(chain[0], chain[-1], view.microbatches(r), view.share(r))
                for r, chain in zip(view.replicas, view.chains())]


def shard(x: torch.Tensor, y: torch.Tensor, shares: list[int]) -> list[Batch]:
    """Split a batch along dim 0 in proportion to ``shares``."""
    n, total = x.shape[0], sum(shares)
    cuts, acc = [], 0
    for s in shares[:-1]:
        acc += s
        cuts.append(round(n * acc / total))
    return list(zip(torch.tensor_split(x, cuts), torch.tensor_split(y, cuts)))


def cycle(data: Iterable[Batch]) -> Iterator[Batch]:
    """Batches of ``data``, starting over when it runs out (if it can be iterated again).

    Each pass calls ``iter(data)`` once, as ``for epoch: for batch in data`` does:
    a DataLoader draws its shuffle's seed in ``iter()``, so one call more per epoch
    would shift a seeded shuffle. A one-shot iterator is not started over.
    """
    once = isinstance(data, Iterator)
    while True:
        n = 0
        for batch in data:
            n += 1
            yield batch
        if n == 0 or once:
            return


class Replan(Exception):
    """The job started a new plan epoch (a rewind): feed it from its resume step."""


class KeptBatches:
    """The batches drawn from the data, by step, kept for a replay (module docstring).

    Args:
        batches: the job's data from its first step.
        job_id: for log lines.
    """

    def __init__(self, batches: Iterator[Batch], job_id: str = ""):
        self.batches, self.job_id = batches, job_id
        self.kept: dict[int, Batch] = {}  # step -> (x, y), since the second-newest checkpoint
        self.nbytes = 0  # of the kept batches
        self.drawn = 0  # batches drawn from the data (the steps before it are behind us)

    def __len__(self) -> int:
        return len(self.kept)

    def get(self, step: int, groups: list[GroupFeed]) -> Batch:
        """Step ``step``'s batch: kept, or drawn now (a resumed job skips the steps done).

        Raises:
            StopIteration: the data ran out.
        """
        if step not in self.kept:
            while self.drawn < step:
                self._draw(groups)
                self.drawn += 1
            x, y = self.kept[step] = self._draw(groups)
            self.nbytes += _nbytes(x, y)
            self.drawn += 1
        return self.kept[step]

    def forget_before(self, floor: int) -> None:
        """Drop the batches of the steps before ``floor`` (no rewind goes back that far)."""
        for s in [s for s in self.kept if s < floor]:
            self.nbytes -= _nbytes(*self.kept.pop(s))

    def check_rewind(self, step: int) -> None:
        """Check that a rewind to ``step`` can be fed again.

        Raises:
            RuntimeError: the batches from ``step`` on are no longer kept.
        """
        if step not in self.kept and step < self.drawn:
            raise RuntimeError(f"job {self.job_id} rewound to step {step}, but the feed kept "
                               f"batches from step {min(self.kept, default=self.drawn)} only")

    def _draw(self, groups: list[GroupFeed]) -> Batch:
        """The next batch whose every group's share holds at least one sample per microbatch.

        Smaller batches (a data set's short last batch, say) are skipped with a warning:
        an empty microbatch has no loss to scale.
        """
        while True:
            x, y = next(self.batches)
            shards = shard(x, y, [g.share for g in groups])
            if all(xs.shape[0] >= g.microbatches for g, (xs, _) in zip(groups, shards)):
                return x, y
            log.warning("job %s: skipping a batch of %d samples, too few for %s microbatches",
                        self.job_id, x.shape[0], "+".join(str(g.microbatches) for g in groups))


def _nbytes(x: torch.Tensor, y: torch.Tensor) -> int:
    return x.numel() * x.element_size() + y.numel() * y.element_size()


class Feed:
    """Feeds one job's steps over its plan epochs (module docstring).

    :meth:`run` is the feed thread's body; it raises what ended the feed (the
    :class:`~fedpipe.Job` turns it into the job's fate).

    Args:
        job_id: the job.
        tracker: the tracker's calls (:class:`FeedTracker`).
        nodes: the nodes' calls (:class:`NodeLink`).
        watch: the feeder's watch: the job's state, and the halt flag.
        batches: the job's data from its first step.
        microbatches: the job's microbatches per step (for groups whose plan
            leaves them unset).
        restore: a saved checkpoint to put on the stages before the first step
            (``submit(resume_from=...)``).
        weights: streams the initial weights to each stage of an epoch that starts
            from the job's start (a job whose weights the client holds or reads);
            None: the nodes make or read their own.
    """

    def __init__(self, job_id: str, tracker: FeedTracker, nodes: NodeLink, watch: JobWatch,
                 batches: Iterator[Batch], *, microbatches: int = 1,
                 restore: checkpoints.SavedCheckpoint | None = None,
                 weights: WeightStreamer | None = None):
        self.job_id, self.tracker, self.nodes, self.watch = job_id, tracker, nodes, watch
        self.weights = weights
        self.microbatches, self.restore = microbatches, restore
        self.kept = KeptBatches(batches, job_id)
        self.fed = self.steps = 0  # steps fed in full, of how many
        self.step = 0  # the step being fed

    @property
    def halted(self) -> threading.Event:
        return self.watch.halted

    def run(self) -> None:
        """Feed the job until every step of its last epoch is fed and it ends.

        Raises:
            Halted: the client closed, or another client took the job over.
            StopIteration: the data ran out.
            grpc.RpcError: a node or the tracker refused the feed for good.
            NoLeader: the job needed a recovery and no tracker led within
                :data:`~fedpipe.net.timeouts.LEADER_WAIT`.
        """
        self.watch.wait_started()
        info = self.watch.await_epoch(-1, RECOVERY_POLL)  # running now, not only once
        if info is not None and self.restore is not None:
            info = self._restore(info, self.restore)
        while info is not None:  # one round per plan epoch
            info = self._epoch(info)

    def _epoch(self, info: S.JobInfo) -> S.JobInfo | None:
        """Feed one plan epoch from its resume step; the next epoch's info once the job
        rewinds (None: it ended)."""
        try:
            if self.weights is not None:  # before any input: the stages wait for them
                self.weights.stream(info)
            self._steps(info)
            # every step fed: stay until the job ends, and feed it again if it rewinds
            resumed = self.watch.await_epoch(info.epoch, AFTER_FEED_POLL)
        except Replan:  # an elastic job rewound (fewer than min_replicas groups left)
            resumed = self.watch.await_epoch(info.epoch, RECOVERY_POLL)
        except grpc.RpcError as e:
            if e.code() not in NODE_TROUBLE:
                raise
            # a node of the job is gone, or the job moved to a new epoch without
            # it: once the job runs again, feed it from its resume step
            log.info("job %s: feeding step %d failed (%s: %s); waiting for the job to "
                     "recover", self.job_id, self.step, e.code().name, e.details())
            # only a leading tracker recovers it: wait for one, up to LEADER_WAIT
            resumed = self.watch.await_epoch(info.epoch, RECOVERY_POLL,
                                             time.monotonic() + timeouts.LEADER_WAIT)
        if resumed is None:
            return None
        self.kept.check_rewind(resumed.resume_step)
        log.info("job %s recovered (epoch %d): feeding again from step %d", self.job_id,
                 resumed.epoch, resumed.resume_step)
        return resumed

    def _steps(self, info: S.JobInfo) -> None:
        """Send every step of the epoch from ``info.resume_step``."""
        groups = GroupFeed.of(PlanView(info.plan, self.microbatches))
        elastic = ElasticFeed(self.tracker, self.job_id, info, self.watch.reach) \
            if ElasticFeed.applies(info) else None
        for step in range(info.resume_step, info.steps):
            self.step = step
            if self.halted.is_set():
                raise Halted
            if elastic is not None:  # the live groups only, and any that join
                groups = self._elastic_groups(elastic, step)
            if step not in self.kept.kept:
                self._bound(info)
            x, y = self.kept.get(step, groups)
            for group, (xs, ys) in zip(groups, shard(x, y, [g.share for g in groups])):
                try:
                    self._send_step(step, x.shape[0], group, xs, ys, info.epoch)
                except grpc.RpcError as e:
                    if elastic is None or e.code() not in NODE_TROUBLE or \
                            not elastic.dropped(group.first.replica, info.epoch,
                                                self.halted.is_set):
                        raise
                    log.info("job %s: replica group %d was dropped; feeding the others",
                             self.job_id, group.first.replica)
            self.fed, self.steps = step + 1, info.steps

    def _elastic_groups(self, elastic: ElasticFeed, step: int) -> list[GroupFeed]:
        """The groups to feed at ``step`` of an elastic job (:mod:`.elastic`).

        Raises:
            Replan: the job rewound meanwhile.
        """
        live, now = elastic.members(step)
        if not live:
            raise Replan
        view = PlanView(now.plan, self.microbatches)
        return [g for g in GroupFeed.of(view) if g.first.replica in live]

    def _bound(self, info: S.JobInfo) -> None:
        """Forget kept batches from before the checkpoint one interval older than the last
        complete one (a rewind goes back at most that far: the nodes keep those two
        snapshots); at the bound (:data:`FEED_KEEP_CHECKPOINTS` checkpoint intervals)
        wait for the next checkpoint to complete (or the job to move on: a recovery,
        its end), unless the tracker is silent (module docstring: then up to
        :data:`FEED_OUTAGE_KEEP_BYTES`). The floor follows from the last complete
        checkpoint alone, so checkpoints that complete faster than the feed looks (a
        burst after a tracker restart) still free what they should. What the watch's
        events said (:meth:`~.watch.JobWatch.known`) is enough: the tracker is never asked."""
        every = max(1, info.checkpoint_every or info.steps)
        limit = FEED_KEEP_CHECKPOINTS * every
        while True:
            if len(self.kept) < limit and len(self.kept) % every:
                return  # between checkpoints
            known = self.watch.known()
            self.kept.forget_before(max(0, known.checkpoint_step - every))
            if len(self.kept) < limit or known.state != S.JOB_STATE_RUNNING or \
                    known.epoch != info.epoch:
                return
            if self._tracker_silent() and self.kept.nbytes < FEED_OUTAGE_KEEP_BYTES:
                return  # no checkpoint can be known complete: keep, and train on
            if self.halted.is_set():
                raise Halted
            self.watch.wait_event(RECOVERY_POLL)  # a checkpoint completes with an event

    def _tracker_silent(self) -> bool:
        """Whether the tracker looks gone: the watch's stream is down, or it said nothing of
        the job for :data:`~fedpipe.net.timeouts.TRACKER_SILENT` s."""
        return not self.watch.live or \
            time.monotonic() - self.watch.known().heard > timeouts.TRACKER_SILENT

    def _send_step(self, step: int, batch_size: int, group: GroupFeed, xs: torch.Tensor,
                   ys: torch.Tensor, epoch: int) -> None:
        """One step's inputs to the group's first stage and targets to its last: one tensor
        each, holding all the group's microbatches (the node cuts them as
        ``torch.tensor_split(t, microbatches)``; ``fedpipe.v1.Envelope.microbatches``)."""
        for a, kind, t in ((group.first, node_pb2.KIND_INPUT, xs),
                           (group.last, node_pb2.KIND_TARGET, ys)):
            env = node_pb2.Envelope(job_id=self.job_id, replica=a.replica, stage=a.stage,
                                    kind=kind, step=step, microbatch=0,
                                    microbatches=group.microbatches, batch_size=batch_size,
                                    epoch=epoch)
            self._send_one(a, env, t)

    def _send_one(self, a: node_pb2.StageAssignment, env: node_pb2.Envelope,
                  t: torch.Tensor) -> None:
        """One feed tensor to stage ``a``'s node, sent again while the node is busy, or,
        while the job's epoch holds, for up to :data:`~fedpipe.net.timeouts.FEED_UNREACHABLE`
        seconds after its address first refused connections, or after the link to an
        outbound-only node failed (its relay stayed away: the node re-homed at another
        relay, and the plan names its new addresses). A tensor sent again that the node
        says it already has (ALREADY_EXISTS: it came before the link broke) is delivered.

        Raises:
            grpc.RpcError: any other error, or one of those past its bound.
        """
        deadline, again = None, False
        while True:
            try:
                # RESOURCE_EXHAUSTED is the node's back-pressure (its data-plane slots are
                # taken, or its mailbox full): wait and send again, a bounded number of times
                net.retry(functools.partial(self.nodes.send, a, env, t),
                          f"job {self.job_id}: feeding step {env.step} to {a.address}",
                          attempts=FEED_BUSY_ATTEMPTS, max_delay=FEED_BUSY_MAX_DELAY,
                          stop=self.halted.is_set, codes=(grpc.StatusCode.RESOURCE_EXHAUSTED,))
                return
            except grpc.RpcError as e:
                if again and e.code() == grpc.StatusCode.ALREADY_EXISTS:
                    return
                # refused connection: the call was never sent. An outbound-only node's relay
                # restarting looks so for a moment, while the node lives and comes back at the
                # same address, or at another relay's (the plan follows it: read it again);
                # a dead node's job moves to a new epoch meanwhile
                deadline = deadline or time.monotonic() + timeouts.FEED_UNREACHABLE
                away = unsent(e) or (bool(a.relay) and isinstance(e, links.LinkError)
                                     and e.code() == grpc.StatusCode.UNAVAILABLE)
                info = None if not away or time.monotonic() > deadline \
                    or self.halted.is_set() else self.watch.info()
                if info is None or info.epoch != env.epoch:
                    raise
                log.info("job %s: %s is away (%s); feeding again", self.job_id,
                         a.address, e.details())
                now = PlanView(info.plan).get(StageKey(a.replica, a.stage))
                if now is not None and now.node_id == a.node_id:
                    a.CopyFrom(now)  # in the epoch's plan: later steps go there too
                again = True
                self.halted.wait(FEED_REDIAL)

    def _restore(self, info: S.JobInfo, saved: checkpoints.SavedCheckpoint
                 ) -> S.JobInfo | None:
        """Put each stage's snapshot of a saved checkpoint on the node that runs it,
        then have the job restore it (RestoreJob: a new epoch at its step); return the
        job once it runs there (None if it ended).

        Raises:
            checkpoints.CheckpointError: as :meth:`~.checkpoints.SavedCheckpoint.for_stage`.
        """
        view = PlanView(info.plan)
        for key, a in sorted(view.stages.items()):
            snap = saved.for_stage(key, a.layer_start, a.layer_end)
            env = node_pb2.Envelope(job_id=self.job_id, replica=key.replica, stage=key.stage,
                                    kind=node_pb2.KIND_SNAPSHOT, step=saved.step,
                                    epoch=info.epoch, batch_size=1)
            self.nodes.put_snapshot(view[key], env, snap)
        self.tracker.RestoreJob(S.RestoreJobRequest(job_id=self.job_id, step=saved.step),
                                timeout=timeouts.CONTROL_RPC)
        return self.watch.await_epoch(info.epoch, RECOVERY_POLL)
