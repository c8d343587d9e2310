"""The user's handle on a job: its status, progress, weights and checkpoints.

A :class:`Job` that feeds its job runs two threads: the feeder's watch
(:mod:`.watch`, the one source of the job's state) and the feed (:mod:`.feed`, what
is sent each step). ``Job`` starts them, ends them when its client closes, and turns
what ended the feed into the job's fate (:attr:`Job.feed_error`). With a
``checkpoint_dir``, the watch thread keeps the job's checkpoints there (:mod:`.keeping`).
"""
from __future__ import annotations

import copy
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import grpc
import torch
from torch import nn

from .. import net
from ..net import timeouts
from ..observe.source import GrpcSource, naming_job, raise_unknown_job
from ..planner.memfit import is_memory_refusal
from ..observe.views import StepRecord, step_records
from ..proto import node_pb2, tracker_pb2
from ..runtime import checkpoint
from ..runtime.weights import KeyMap
from ..spec import TERMINAL, JobSpec, PlanView, StageKey, state_name
from . import checkpoints
from .errors import CheckpointGone, JobEnded, JobFailed, NotEnoughMemory, TrackerBusy
from .feed import FEED_KEEP_CHECKPOINTS, Batch, ChannelNodes, Feed, GroupFeed, cycle, shard
from .keeping import CheckpointKeeper, newest_checkpoint
from .status import JobStatus
from .watch import RETRYABLE, Halted, JobWatch, NoLeader
from .weights import TensorsOf, WeightStreamer, streamed

if TYPE_CHECKING:
    from .client import Client

# kept for callers of the names these had before the feed moved to .feed
_shard, _cycle, _FeedHalted = shard, cycle, Halted
__all__ = ["Job", "JobFailed", "JobEnded", "CheckpointGone", "JobStatus", "TrackerBusy",
           "NotEnoughMemory",
           "GroupFeed", "FEED_KEEP_CHECKPOINTS"]

log = logging.getLogger("fedpipe.client")
S = tracker_pb2


class Job:
    """A submitted job: its status, progress, and trained weights.

    It talks to the tracker and the nodes over its client's channels.

    Feeding survives recoveries: the feed keeps each batch it sent since the
    second-newest complete checkpoint, so when a lost node makes the job
    rewind to its last complete checkpoint (or the one before, if no snapshot
    of the last survived) the same batches are sent again, in the same
    order, and a synchronous job ends as if nothing happened. The bound:
    ``FEED_KEEP_CHECKPOINTS * checkpoint_every`` batches (3 checkpoint
    intervals: the one being taken, and the two complete ones a rewind may
    go back to). At the bound the feed pauses until the next checkpoint
    completes; it never drops a batch it may need.

    While it feeds, the job holds a *feeder's watch* of the job on the tracker
    (:mod:`fedpipe.tracker.clients`): when that stream ends (the client closed,
    crashed or was cut off) the job stops at its last complete checkpoint and
    waits for a client (WAITING). :meth:`resume` feeds it again from another
    process; only the latest feeder's data is used.
    """

    def __init__(self, client: Client, job_id: str, model: nn.Sequential | None = None,
                 microbatches: int = 1, *, spec: JobSpec | None = None,
                 checkpoint_dir: str | os.PathLike | None = None,
                 weights: TensorsOf | None = None, names: KeyMap | None = None):
        self.client, self.id, self._model = client, job_id, model
        self._names = names  # the model names of each layer's tensors, for saves
        self._weights = weights  # each layer's initial tensors, for stages that await them
        self.microbatches = microbatches
        self.feed_error: BaseException | None = None
        self._spec = spec
        self._checkpoint_dir = checkpoint_dir
        self._keeper: CheckpointKeeper | None = None  # keeps checkpoint_dir, while it feeds
        self._feeder: threading.Thread | None = None
        self._follower: threading.Thread | None = None
        self._feeder_id = os.urandom(8).hex()
        self._halted = threading.Event()
        self._watch: JobWatch | None = None  # the feeder's watch, while this Job feeds
        self._feed: Feed | None = None  # the feed, once this Job feeds

    def _start_feed(self, batches: Iterator, *, take_over: bool = False,
                    restore: checkpoints.SavedCheckpoint | None = None,
                    keeping_since: int | None = 0) -> None:
        """Open the feeder's watch (a refusal is raised here, before any thread starts),
        then start its thread and the feed of ``batches`` (from the job's first step).
        With a ``checkpoint_dir``, the watch keeps the job's checkpoints there
        (:class:`.CheckpointKeeper`; ``keeping_since``: its own).

        Raises:
            RuntimeError: this Job feeds the job already.
            ValueError: the client is closed.
            grpc.RpcError: the tracker refused the watch (:meth:`.JobWatch.open`).
        """
        self._check_not_feeding()
        self._check_open()
        self._halted.clear()  # a resume refused earlier left it set
        keeper = None if self._checkpoint_dir is None else CheckpointKeeper(
            self.id, self._checkpoint_dir, info=self._info, pull=self._pull,
            layout=self._layout, keeping_since=keeping_since)
        watch = JobWatch(self.client.stub, self.id, self._feeder_id, take_over=take_over,
                         on_event=keeper.on_event if keeper is not None else None,
                         halted=self._halted, reach=self.client.reach)
        watch.open()
        nodes = ChannelNodes(self.client)
        streamer = WeightStreamer(self.id, self._weights, nodes) \
            if self._weights is not None else None
        feed = Feed(self.id, self.client.stub, nodes, watch, batches,
                    microbatches=self.microbatches, restore=restore, weights=streamer)
        try:
            self._check_open(add=True)
        except ValueError:
            watch.halt()
            raise
        self._watch, self._feed, self._keeper = watch, feed, keeper
        self._follower = threading.Thread(target=watch.run, name=f"watch-{self.id}",
                                          daemon=True)
        self._feeder = threading.Thread(target=self._run_feed, args=(feed,),
                                        name=f"feed-{self.id}", daemon=True)
        self._follower.start()
        self._feeder.start()

    def _check_not_feeding(self) -> None:
        """Raise RuntimeError if this Job feeds the job already."""
        if self._feeder is not None:
            raise RuntimeError(f"job {self.id} is being fed by this Job already")

    def _check_open(self, add: bool = False) -> None:
        """Raise ValueError if the client is closed; else, with ``add``, count this Job
        among the jobs it feeds (closing it halts their feeds)."""
        with self.client._lock:
            if self.client._closed:
                raise ValueError(f"client of tracker {self.client.address} is closed")
            if add:
                self.client._feeding.add(self)

    def resume(self, data: Iterable[Batch], *,
               checkpoint_dir: str | os.PathLike | None = None,
               model: nn.Sequential | None = None) -> "Job":
        """Feed this job again, from this client: take it over from a client that is
        gone (or still there: it stops feeding), rewind it to its last complete
        checkpoint (a WAITING job's is where it stopped) and feed it from there.

        Args:
            data: the job's data *from its start*, the same batches in the same
                order as the first client gave; the steps before the job's
                resume step are drawn and skipped (a DataLoader re-iterates as
                ``for epoch: for batch in loader`` would).
            checkpoint_dir: keep the job's complete checkpoints in this folder from
                now on, as ``submit(checkpoint_dir=...)`` does (give the first
                client's folder to go on filling it); None: keep none here.
            model: the model as submitted, with its weights, for a job whose weights
                the client streams (``submit`` of a model with its weights, or of
                ``weights=`` a path some node cannot read): if the job rewinds to its
                start (no checkpoint yet), its stages wait for these weights. A meta
                job's nodes make their own; attached by id without it, such stages
                fail after ``fedpipe.net.timeouts.WEIGHTS_WAIT`` s.

        Returns:
            self, being fed (:meth:`wait` for it).

        A resume refused (any error below) leaves this Job as it was: its checkpoint
        folder and model are the ones it had.

        Raises:
            JobEnded: the job has ended (SUCCEEDED, FAILED or CANCELLED): nothing is left
                to feed (``submit(..., resume_from=checkpoint_dir)`` starts a new job
                from a kept checkpoint). Raised at once, before any thread starts.
            RuntimeError: this Job feeds the job already.
            ValueError: the client is closed.
            JobNotFound: the tracker knows no such job (named, with the tracker), raised
                at once, before any thread starts.
            grpc.RpcError: the tracker refused to let this client feed the job
                (PERMISSION_DENIED: another client's job), raised at once, before any
                thread starts (:mod:`.watch`).
        """
        try:
            info = self.client.stub.GetJob(S.GetJobRequest(job_id=self.id),
                                           timeout=timeouts.CONTROL_RPC)
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE:
                raise_unknown_job(e, self.id, self.client.address)
            # the tracker is away (restarting): the watch retries, and the tracker
            # refuses the take-over of an ended job itself
            since = None
        else:
            if info.state in TERMINAL:
                raise JobEnded(self._ended_message(info.state, info.reason))
            since = info.checkpoint_step  # completed before: not this Job's to name
        self._check_not_feeding()  # before anything changes: its keeper reads the model
        kept = self._checkpoint_dir, self._model, self._weights  # as they were, if refused
        if checkpoint_dir is not None:
            self._checkpoint_dir = checkpoint_dir
        if model is not None:
            self._model = model
            self._weights = streamed(model)
        try:
            self._start_feed(cycle(data), take_over=True, keeping_since=since)
        except BaseException as e:
            self._checkpoint_dir, self._model, self._weights = kept
            # a take-over is refused FAILED_PRECONDITION only for a job that ended
            # between GetJob and the watch (fedpipe.tracker.clients.Feeders.attach)
            if isinstance(e, grpc.RpcError):
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise JobEnded(f"job {self.id} cannot be resumed: {e.details()}") from None
                raise_unknown_job(e, self.id, self.client.address)
            raise
        return self

    def _ended_message(self, state: int, reason: str) -> str:
        because = f" ({reason})" if reason else ""
        return (f"job {self.id} cannot be resumed: it has ended {state_name(state)}{because}; "
                f"submit(..., resume_from=CHECKPOINT_DIR) starts a new job from a kept "
                f"checkpoint")

    def save(self, path: str | os.PathLike) -> str:
        """Write the job's last complete checkpoint (its final state, once it has
        SUCCEEDED) to folder ``path``, a stage at a time, streamed a tensor at a time (this
        client holds one tensor at most): the weights as safetensors shards in the Hugging Face
        layout, one per stage, with ``model.safetensors.index.json``; the rest of each
        stage's state (optimizer, LR schedule, DiLoCo state) in a file of its own; the
        metadata (step, plan, config) in ``checkpoint.json``
        (:mod:`fedpipe.client.checkpoints`). ``submit(..., resume_from=path)``
        continues from it, ``submit(..., weights=path)`` starts a new job from its
        weights. For a model from :func:`fedpipe.hf.sequential` the weights have the
        original model's names and ``config.json`` is written:
        ``transformers``' ``from_pretrained(path)`` loads it. Returns the folder.

        Raises:
            RuntimeError: no checkpoint has completed yet.
            JobNotFound: the tracker knows no such job (named, with the tracker).
            CheckpointGone: no node holds a stage's snapshot of that step any more (a
                cancelled or failed job's nodes drop its snapshots).
            grpc.RpcError: a node could not be asked (UNAVAILABLE, ...), or its stream
                broke off midway.
            fedpipe.runtime.weights.WeightsError: two tensors would get one name (names
                given at submit that are not one-to-one).
            fedpipe.wire.WireError: a node's snapshot stream was malformed or cut short.
            OSError: the folder cannot be written.
        """
        info = self._info()
        step = newest_checkpoint(info)
        if step <= 0:
            raise RuntimeError(f"job {self.id} has no complete checkpoint yet "
                               f"({state_name(info.state)} at step {info.step})")
        return str(checkpoints.write(path, step, self._pull(info, step), info.plan,
                                     steps=info.steps, **self._layout()))

    def _layout(self) -> dict[str, Any]:
        """How a checkpoint of this job is written (:func:`.checkpoints.write`'s keywords):
        its config, and how its weights are named (:func:`.checkpoints.layout`)."""
        return {"config": self._spec.summary() if self._spec is not None else {},
                **checkpoints.layout(self._model, self._names, self._spec)}

    def _pull(self, info: tracker_pb2.JobInfo, step: int
              ) -> Iterator[tuple[StageKey, checkpoint.SnapshotStream]]:
        return checkpoints.pull(self.client.node, self.id, info.plan, step, info.state,
                                self.client.data_plane())

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    @property
    def fed(self) -> int:
        """Steps this client has fed in full so far (0 if it does not feed the job), read
        without the tracker: it goes on while no tracker leads (:mod:`.feed`)."""
        feed = self._feed
        return feed.fed if feed is not None else 0

    def status(self) -> JobStatus:
        """The job's current state, reason, progress and plan.

        Raises:
            JobNotFound: the tracker knows no such job (named, with the tracker).
            grpc.RpcError: the tracker is unreachable or refused the call.
        """
        return JobStatus.of(self._source().job(self.id))

    def _source(self) -> GrpcSource:
        """The job's tracker as a read-only source (its unknown job: JobNotFound)."""
        return GrpcSource(self.client.stub, tracker=self.client.address)

    @property
    def plan(self) -> node_pb2.Plan:
        """The plan (empty before PLANNING is over)."""
        return self.status().plan

    def events(self) -> Iterator[tracker_pb2.JobEvent]:
        """The job's events from the start, until it ends.

        Raises:
            JobNotFound: the tracker knows no such job (named, with the tracker).
            grpc.RpcError: the tracker is unreachable or refused the call.
        """
        with naming_job(self.id, self.client.address):
            yield from self.client.stub.WatchJob(S.WatchJobRequest(job_id=self.id))

    def history(self) -> list[StepRecord]:
        """The job's completed steps so far, in the order the tracker recorded them (a step
        replayed after a recovery appears again, with the new epoch): each a
        :class:`~fedpipe.observe.views.StepRecord` with step, time (seconds since the
        epoch), loss, samples/s and per-stage times (``stages``: empty, since the
        tracker's gRPC API does not carry them; its dashboard's ``/api/jobs/ID`` does).

        Raises:
            JobNotFound: (a KeyError) the tracker does not know the job.
        """
        return step_records(self._source().events(self.id, 0))

    def plot(self, path: str):
        """Draw the job's loss and throughput curves (recoveries marked) to ``path``
        (.png, .svg or .pdf), with matplotlib; return the ``matplotlib.figure.Figure``.

        Raises:
            ValueError: no step is recorded yet.
            JobNotFound: (a KeyError) the tracker does not know the job.
        """
        from ..observe.plots import plot_job  # matplotlib loads only when a picture is drawn

        return plot_job(self._source(), self.id, path)

    def wait(self, timeout: float | None = None, progress: bool = True) -> JobStatus:
        """Block until the job ends, showing a progress bar (step, loss, samples/s) and
        state changes unless ``progress`` is False. With a ``checkpoint_dir``, also until
        the job's last checkpoint (its final state) is kept there.

        Raises:
            JobNotFound: the tracker knows no such job (named, with the tracker).
            JobFailed: the job ended FAILED or CANCELLED.
            NotEnoughMemory: (a JobFailed) it FAILED for want of memory: no plan fits the
                nodes' memory, or a node refused to load a stage; the message gives both
                figures and the remedies.
            TimeoutError: it did not end within ``timeout`` seconds.
            TrackerBusy: the tracker refused the watch (this client holds too many
                watches of the job, or the tracker all it takes).
            grpc.RpcError: the tracker refused this client's watch of the job
                (PERMISSION_DENIED: another client's job; :mod:`.watch`).
        """
        from tqdm.auto import tqdm

        if self._watch is not None and self._watch.error is not None:
            raise self._watch.error  # the tracker refused this client's feeder's watch
        status = JobStatus.of(self._info())  # asked again while no tracker leads
        bar = tqdm(total=status.steps, desc=f"job {self.id}", unit="step", disable=not progress)
        deadline = None if timeout is None else time.monotonic() + timeout
        seq, last_state = 0, None
        try:
            while True:  # a dropped stream (tracker restart) is resumed after the last event
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    for ev in self.client.stub.WatchJob(
                            S.WatchJobRequest(job_id=self.id, after_seq=seq), timeout=left):
                        seq = ev.seq
                        self.client.reach.reached()
                        if ev.step:
                            bar.update(ev.step - bar.n)
                            bar.set_postfix(loss=f"{ev.loss:.4f}",
                                            samples_s=f"{ev.samples_per_second:.0f}")
                        elif ev.state != last_state and progress:
                            bar.write(f"job {self.id}: {state_name(ev.state)} — {ev.reason}")
                        last_state = ev.state
                    break
                except grpc.RpcError as e:
                    self._watch_lost(e, timeout)
                    time.sleep(timeouts.WATCH_RESUME)
        finally:
            bar.close()
        if self._follower is not None and self._keeper is not None:
            # the watch keeps the job's last checkpoints in checkpoint_dir: let it finish
            self._follower.join(timeouts.FETCH_STATE_RPC)
            self._sweep_checkpoints()
        status = JobStatus.of(self._info())
        if status.state != "SUCCEEDED":
            detail = f"; feeding data failed: {self.feed_error}" if self.feed_error else ""
            failed = NotEnoughMemory if is_memory_refusal(status.reason) else JobFailed
            raise failed(f"job {self.id} {status.state}: {status.reason}{detail}")
        return status

    def _watch_lost(self, e: grpc.RpcError, timeout: float | None) -> None:
        """:meth:`wait`'s watch failed with ``e``: return to watch again (the tracker is
        unreachable for now: said once, :mod:`.reach`), or raise as :meth:`wait` says."""
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise TimeoutError(f"job {self.id} did not finish within {timeout} s") from None
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise TrackerBusy(f"the tracker refused to watch job {self.id}: "
                              f"{e.details()}") from None
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise_unknown_job(e, self.id, self.client.address)
        if isinstance(self.feed_error, NoLeader):  # no tracker to say so
            raise JobFailed(f"job {self.id} FAILED: {self.feed_error}") from None
        self.client.reach.lost(e)  # one line while it lasts

    def cancel(self, reason: str = "cancelled by the client") -> JobStatus:
        """Cancel the job; its stages stop and drop their weights.

        Raises:
            JobNotFound: the tracker knows no such job (named, with the tracker).
            grpc.RpcError: the tracker is unreachable or refused the call.
        """
        with naming_job(self.id, self.client.address):
            self.client.stub.CancelJob(S.CancelJobRequest(job_id=self.id, reason=reason),
                                       timeout=timeouts.CONTROL_RPC)
        return self.status()

    def state_dict(self, stage: int | None = None) -> dict[str, torch.Tensor]:
        """The trained weights, gathered from the stages of replica group 0 (or from
        stage ``stage`` alone: a big model's weights one stage at a time), keyed as the
        model's own state_dict (``"3.weight"``: layer 3's ``weight``).

        Raises:
            ValueError: the plan has no stage ``stage``.
            CheckpointGone: the job has ended and a stage's node no longer holds it: the
                weights were released (:meth:`release`, which ``fedpipe submit`` does at its
                end), the job was cancelled, or the node restarted; the message names the
                job and the stage, and how to keep weights (a kept checkpoint,
                ``resume_from=``).
            JobNotFound: the tracker knows no such job.
            grpc.RpcError: a stage's node is unreachable, or refused otherwise (NOT_FOUND
                while the job is active: a stage not loaded yet, deploying or recovering).
        """
        info = self._source().job(self.id)
        return checkpoints.stage_weights(self.client.node, self.id, info.plan, stage,
                                         self.client.data_plane(), info.state)

    def model(self) -> nn.Sequential:
        """A copy of the submitted model carrying the trained weights (the whole model,
        in this process: for a model the client holds).

        Raises:
            RuntimeError: the job was attached by id, so the model is not known here; or
                its model was built on the meta device: one that big is not gathered
                into one process (use :meth:`save`, which writes it a stage at a time,
                or :meth:`state_dict` with ``stage=``).
            CheckpointGone: a stage's weights are gone (released, or its node restarted),
                as :meth:`state_dict` says.
            grpc.RpcError: as :meth:`state_dict`.
        """
        if self._model is None:
            raise RuntimeError("this Job was attached by id; use state_dict() instead")
        if any(t.is_meta for t in self._model.state_dict().values()):
            raise RuntimeError(
                f"job {self.id}'s model was built on the meta device, so model() would "
                "gather every weight into this process; use job.save(path) (safetensors "
                "shards, written a stage at a time) or job.state_dict(stage=...) (one "
                "stage's weights)")
        model = copy.deepcopy(self._model)
        model.load_state_dict(self.state_dict())
        return model

    def release(self) -> None:
        """Ask the stages' nodes to drop the job's weights (after :meth:`state_dict`).

        Best effort: a node that cannot be reached (it left, its weights with
        it) is logged and skipped.
        """
        for address in sorted(PlanView(self.plan).addresses()):
            try:
                self.client.node(address).StopJob(
                    node_pb2.StopJobRequest(job_id=self.id, reason="released", release=True),
                    timeout=timeouts.CONTROL_RPC)
            except grpc.RpcError as e:
                log.warning("could not release job %s on %s: %s", self.id, address, e.details())
        plane = self.client.data_plane()
        if plane is not None:  # its own links through relays (the feed's, fetches')
            plane.end_job(self.id)

    # -- data feeding -------------------------------------------------------
    def _halt_feed(self) -> None:
        """Make the feeder stop at once (its client is closing): its watch ends, so the
        job waits for a client."""
        if self._watch is not None:
            self._watch.halt()
        self._halted.set()

    def _join_feed(self, timeout: float) -> None:
        for thread in (self._feeder, self._follower):
            if thread is not None:
                thread.join(timeout)
        self._sweep_checkpoints()

    def _sweep_checkpoints(self) -> None:
        """Remove what unfinished checkpoints left in ``checkpoint_dir`` once the watch
        that keeps them has ended (:meth:`.CheckpointKeeper.sweep`)."""
        if self._keeper is not None and not (
                self._follower is not None and self._follower.is_alive()):
            self._keeper.sweep()

    def _info(self) -> tracker_pb2.JobInfo:
        """The job's info, asked again while the tracker is unreachable (restarting), at
        most :data:`~fedpipe.net.timeouts.RECONNECT_BACKOFF_MAX` apart.

        Raises:
            JobNotFound: the tracker knows no such job (named, with the tracker).
            grpc.RpcError: another refusal that cannot pass (:data:`.watch.RETRYABLE`).
        """
        with naming_job(self.id, self.client.address):
            info = net.retry(lambda: self.client.stub.GetJob(
                                 S.GetJobRequest(job_id=self.id), timeout=timeouts.CONTROL_RPC),
                             f"asking the tracker about job {self.id}", codes=RETRYABLE,
                             max_delay=timeouts.RECONNECT_BACKOFF_MAX,
                             stop=self._halted.is_set, on_retry=self.client.reach.lost)
        self.client.reach.reached()
        return info

    def _run_feed(self, feed: Feed) -> None:
        """The feed thread's body: feed, then turn what ended the feed into the job's fate
        (:attr:`feed_error`)."""
        try:
            feed.run()
        except BaseException as e:  # noqa: BLE001 — kept in feed_error, surfaced by wait()
            self._feed_ended(feed, e)
        finally:
            with self.client._lock:
                self.client._feeding.discard(self)

    def _feed_ended(self, feed: Feed, e: BaseException) -> None:
        """Keep why the feed ended in :attr:`feed_error`; cancel the job if nobody else
        can feed it."""
        watch = feed.watch
        if watch.superseded:
            self.feed_error = Halted("another client took the job over")
        elif watch.error is not None:  # the tracker refused the watch: raised by wait()
            self.feed_error = watch.error
        elif self._halted.is_set():  # the client closed: the job waits for a client
            self.feed_error = Halted(
                "the client was closed before it fed every step; the job waits for a "
                "client to resume it (Client(addr).job(id).resume(data))")
        elif isinstance(e, StopIteration):
            self.feed_error = ValueError("data ran out before the last step")
            try:  # the finished steps' weights stay on the nodes: state_dict() works
                self.client.stub.CancelJob(S.CancelJobRequest(
                    job_id=self.id, keep_weights=True,
                    reason=f"the client's data ran out after step {feed.fed} of "
                           f"{feed.steps}; the weights of the finished steps are kept "
                           f"(state_dict())"), timeout=timeouts.CONTROL_RPC)
            except grpc.RpcError as err:
                log.error("could not end job %s: %s", self.id, err.details())
        elif isinstance(e, grpc.RpcError):
            log.error("feeding job %s failed: %s", self.id, e.details())
            self._give_up(e, f"the client could not feed data: {e.code().name}: "
                             f"{e.details()}")
        else:
            log.error("feeding job %s failed", self.id, exc_info=e)
            self._give_up(e, f"the client could not feed data: {e}")

    def _give_up(self, error: BaseException, reason: str) -> None:
        """Keep the feed's ``error`` and cancel the job with ``reason``: a job nobody feeds
        would wait for ever."""
        self.feed_error = error
        try:
            self.cancel(reason)
        except (grpc.RpcError, ValueError) as e:  # ValueError: the channel is closed
            log.error("could not cancel job %s either: %s", self.id, e)
