"""In-process fakes of the tracker and nodes a client's feed and watch talk to
(:class:`fedpipe.client.feed.FeedTracker`, :class:`fedpipe.client.feed.NodeLink`,
:class:`fedpipe.client.watch.WatchTracker`)."""
from __future__ import annotations

import queue
import threading
from typing import Callable

import grpc
import torch

from fedpipe.client.watch import JobWatch
from fedpipe.proto import node_pb2, tracker_pb2 as S
from fedpipe.status import StatusError


FakeRpcError = StatusError  # a failing fake call raises what a real one would


_END = object()


class FakeStream:
    """A WatchJob call: yields what the tracker pushes, raises a pushed error, ends on
    :data:`_END`; :meth:`cancel` ends it with CANCELLED as gRPC does."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.cancelled = False

    def __iter__(self):
        return self

    def __next__(self) -> S.JobEvent:
        item = self.q.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        self.q.put(FakeRpcError(grpc.StatusCode.CANCELLED, "cancelled by the caller"))
        return True


def plan(groups: int = 1, depth: int = 2, epoch: int = 1, relay: str = "") -> node_pb2.Plan:
    """A plan of ``groups`` replica groups of ``depth`` stages; node addresses "rR-sS"
    (``relay``: every node is outbound-only behind that relay)."""
    return node_pb2.Plan(epoch=epoch, stages=[
        node_pb2.StageAssignment(replica=r, stage=s, address=f"r{r}-s{s}", node_id=f"r{r}-s{s}",
                                 layer_start=s, layer_end=s + 1, relay=relay)
        for r in range(groups) for s in range(depth)])


class FakeTracker:
    """The tracker of one job: ``info`` is what GetJob answers; :meth:`move` changes it and
    pushes the matching event to every open watch.

    Args:
        watch_errors: errors the next WatchJob calls raise at their first ``next``, in turn
            (None in the list: that call succeeds).
    """

    def __init__(self, job_id: str = "j", *, steps: int = 4, checkpoint_every: int = 0,
                 groups: int = 1, watch_errors: list | None = None):
        self.lock = threading.Lock()
        self.info = S.JobInfo(job_id=job_id, state=S.JOB_STATE_PENDING, steps=steps,
                              epoch=0, checkpoint_every=checkpoint_every,
                              plan=plan(groups, epoch=0))
        self.events: list[S.JobEvent] = [S.JobEvent(seq=1, state=S.JOB_STATE_PENDING)]
        self.streams: list[FakeStream] = []
        self.watch_requests: list[S.WatchJobRequest] = []
        self.watch_errors = list(watch_errors or [])
        self.get_calls = 0
        self.restored: list[int] = []
        self.cancelled: list[S.CancelJobRequest] = []

    # -- the calls --------------------------------------------------------
    def SubmitJob(self, request: S.SubmitJobRequest, timeout: float | None = None
                  ) -> S.SubmitJobReply:
        self.submitted = request
        return S.SubmitJobReply(job_id=self.info.job_id)

    def WatchJob(self, request: S.WatchJobRequest, timeout: float | None = None) -> FakeStream:
        stream = FakeStream()
        with self.lock:
            self.watch_requests.append(request)
            error = self.watch_errors.pop(0) if self.watch_errors else None
            if error is not None:
                stream.q.put(error)
                return stream
            if request.feeder:
                self.info.feeder = request.feeder
            for ev in self.events:
                if ev.seq > request.after_seq:
                    stream.q.put(ev)
            if self.info.state in (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED,
                                   S.JOB_STATE_CANCELLED):
                stream.q.put(_END)
            self.streams.append(stream)
        return stream

    def GetJob(self, request: S.GetJobRequest, timeout: float | None = None) -> S.JobInfo:
        with self.lock:
            self.get_calls += 1
            out = S.JobInfo()
            out.CopyFrom(self.info)
            return out

    def RestoreJob(self, request: S.RestoreJobRequest, timeout: float | None = None
                   ) -> S.JobInfo:
        self.restored.append(request.step)
        self.run(epoch=self.info.epoch + 1, resume_step=request.step)
        return self.info

    def CancelJob(self, request: S.CancelJobRequest, timeout: float | None = None
                  ) -> S.JobInfo:
        self.cancelled.append(request)
        self.move(S.JOB_STATE_CANCELLED, reason=request.reason)
        return self.info

    def JoinReplica(self, request: S.JoinReplicaRequest, timeout: float | None = None
                    ) -> S.JoinReplicaReply:
        return S.JoinReplicaReply(accepted=False, reason="not in this fake")

    # -- what the test does --------------------------------------------------
    def move(self, state: int, *, reason: str = "", checkpoint_step: int = 0, step: int = 0,
             **fields) -> None:
        """Change the job (``fields`` of its JobInfo) and push the event (a step's, with
        ``step``)."""
        with self.lock:
            self.info.state, self.info.reason = state, reason
            for k, v in fields.items():
                setattr(self.info, k, v)
            if checkpoint_step:
                self.info.checkpoint_step = checkpoint_step
            if step:
                self.info.step = step
            ev = S.JobEvent(seq=len(self.events) + 1, state=state, reason=reason,
                            checkpoint_step=checkpoint_step, epoch=self.info.epoch, step=step)
            self.events.append(ev)
            for s in self.streams:
                s.q.put(ev)
                if state in (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED,
                             S.JOB_STATE_CANCELLED):
                    s.q.put(_END)

    def run(self, *, epoch: int, resume_step: int = 0, groups: int = 1, relay: str = ""
            ) -> None:
        """The job RUNS in a new plan ``epoch`` from ``resume_step`` (``relay``: on
        outbound-only nodes behind it)."""
        with self.lock:
            self.info.plan.CopyFrom(plan(groups, epoch=epoch, relay=relay))
        self.move(S.JOB_STATE_RECOVERING if epoch > 1 else S.JOB_STATE_DEPLOYING,
                  epoch=epoch)
        self.move(S.JOB_STATE_RUNNING, epoch=epoch, resume_step=resume_step)

    def drop_streams(self, error: grpc.RpcError) -> None:
        """Every open watch fails with ``error`` (the tracker restarts, say)."""
        with self.lock:
            streams, self.streams = self.streams, []
        for s in streams:
            s.q.put(error)


class FakeNodes:
    """The job's nodes: records each send; ``on_send(address, envelope)`` may raise (a lost
    node, back-pressure) or move the fake tracker."""

    def __init__(self, on_send: Callable[[str, node_pb2.Envelope], None] | None = None):
        self.lock = threading.Lock()
        self.sent: list[tuple[str, node_pb2.Envelope, torch.Tensor]] = []
        self.snapshots: list[tuple[str, node_pb2.Envelope]] = []
        self.on_send = on_send
        self.attempts = 0

    def send(self, node: node_pb2.StageAssignment, envelope: node_pb2.Envelope,
             tensor: torch.Tensor) -> None:
        address = node.address
        with self.lock:
            self.attempts += 1
        if self.on_send is not None:
            self.on_send(address, envelope)
        with self.lock:
            self.sent.append((address, envelope, tensor))

    def put_snapshot(self, node: node_pb2.StageAssignment, envelope: node_pb2.Envelope,
                     snapshot) -> None:
        self.snapshots.append((node.address, envelope))

    def inputs(self, epoch: int | None = None) -> list[tuple[int, torch.Tensor]]:
        """(step, tensor) of every input sent (in ``epoch`` only, if given), in order."""
        with self.lock:
            return [(e.step, t) for _, e, t in self.sent
                    if e.kind == node_pb2.KIND_INPUT and (epoch is None or e.epoch == epoch)]


def running_watch(tracker: FakeTracker) -> tuple[JobWatch, threading.Thread]:
    """A watch of ``tracker``'s job on its own thread, as a feed runs it, once the job
    RUNS at epoch 1 and the watch has heard so; returns the watch and its thread
    (``watch.halt()`` ends it)."""
    watch = JobWatch(tracker, "j", "me")
    watch.open()
    runner = threading.Thread(target=watch.run, daemon=True)
    runner.start()
    tracker.run(epoch=1)
    watch.wait_started()
    return watch, runner
