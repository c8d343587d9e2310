"""Bounded resources on a node, in one process over real gRPC on 127.0.0.1 (issue 11, item 5):
the tensors one job may have waiting, and idle data-plane streams that serve no running job.

A NodeService runs on a real server from :func:`fedpipe.net.server`; the tests load a
stage with LoadStage as the tracker would and play the hostile peer themselves.
"""
from __future__ import annotations

import queue
import threading
import time

import cloudpickle
import grpc
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe import net
from fedpipe.node.mailbox import Full, Mailbox
from fedpipe.node.service import NodeService
from fedpipe.node.streams import StreamWatch
from fedpipe.proto import node_pb2
from fedpipe.spec import JobSpec, Kind
from fedpipe.wire import frames, rpc

pytestmark = pytest.mark.timeout(60)
QUICK = 2.0  # seconds a control call must take at most while a peer misbehaves


class Node:
    """A NodeService on a real server on 127.0.0.1; its stage reports are dropped."""

    def __init__(self, **kw):
        self.service = NodeService(lambda: "n0", "n0", node_pb2.Resources(device="cpu"),
                                   lambda report: None, **kw)
        self.server = net.server(max_workers=16)
        rpc.add_node_servicer(self.service, self.server)
        self.address = f"127.0.0.1:{net.bind(self.server, '127.0.0.1', 0)}"
        self.server.start()
        self.channel = net.channel(self.address)
        self.stub = rpc.NodeStub(self.channel)

    def load(self, job_id: str, steps: int = 50) -> None:
        """A one-stage job of ``steps`` steps, waiting for its first input."""
        torch.manual_seed(0)
        spec = JobSpec(steps=steps, microbatches=1, batch_size=2, schedule="gpipe",
                       optimizer=cloudpickle.dumps(fedpipe.optimizer(torch.optim.SGD, lr=0.1)),
                       loss_fn=cloudpickle.dumps(nn.functional.mse_loss)).validate()
        plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(
            replica=0, stage=0, node_id="n0", address=self.address, node_name="n0",
            layer_start=0, layer_end=1)])
        self.stub.LoadStage(node_pb2.LoadStageRequest(
            job_id=job_id, replica=0, stage=0, plan=plan, config=spec.to_proto(),
            layers=[cloudpickle.dumps(nn.Linear(4, 2))]), timeout=30)

    def close(self) -> None:
        self.service.stop_all()
        self.channel.close()
        self.server.stop(grace=None)


def tensor_frames(job_id: str, kind: Kind, step: int) -> list[bytes]:
    env = node_pb2.Envelope(job_id=job_id, replica=0, stage=0, kind=kind, step=step,
                            microbatch=0, batch_size=2)
    return list(frames.encode_frames(torch.ones(2, 4), envelope=env))


def probe_frames() -> list[bytes]:
    return list(frames.encode_frames(torch.zeros(4), envelope=node_pb2.Envelope(
        kind=Kind.PROBE, batch_size=1)))


# -- the per-job cap on waiting tensors -----------------------------------------------------


def test_a_mailbox_refuses_a_jobs_tensors_past_its_cap_and_frees_room_as_they_go():
    box = Mailbox(8, bounded=(Kind.INPUT,), job_cap=3, job_of=lambda slot: slot[0])
    t = torch.zeros(1)
    box.put(("j", 0), Kind.ACTIVATION, 0, 0, t, 1)
    box.put(("j", 1), Kind.GRADIENT, 0, 0, t, 1)
    box.put(("j", 1), Kind.INPUT, 0, 0, t, 1)
    with pytest.raises(Full, match=r"job j already has 3 tensors waiting on this node, the most "
                                   r"one job may \(3, "):
        box.put(("j", 0), Kind.ACTIVATION, 1, 0, t, 1)
    with pytest.raises(Full):  # bounded kinds too, once there is room in their slot
        box.put(("j", 1), Kind.INPUT, 1, 0, t, 1)
    box.put(("k", 0), Kind.ACTIVATION, 0, 0, t, 1)  # another job has its own
    assert box.waiting("j") == 3 and box.waiting("k") == 1
    box.get(("j", 0), Kind.ACTIVATION, 0, 0, stopped=lambda: False)
    box.put(("j", 0), Kind.ACTIVATION, 1, 0, t, 1)
    box.drop(lambda slot: slot[0] == "j")
    assert box.waiting("j") == 0 and box.waiting("k") == 1
    with pytest.raises(ValueError, match="job_cap must be >= 1"):
        Mailbox(8, bounded=(), job_cap=0)


def test_a_sender_past_a_jobs_tensor_cap_is_refused_with_the_figure_and_the_node_serves_on():
    cap = 4
    node = Node(job_tensors=cap)
    try:
        node.load("flood")
        # activations for steps the stage will not ask for yet: each waits in the mailbox
        for step in range(1, cap + 1):
            rpc.send(node.stub, tensor_frames("flood", Kind.ACTIVATION, step), timeout=QUICK)
        with pytest.raises(grpc.RpcError) as e:
            rpc.send(node.stub, tensor_frames("flood", Kind.ACTIVATION, cap + 1), timeout=QUICK)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert f"job flood already has {cap} tensors waiting on this node, the most one job " \
               f"may ({cap}, fedpipe.node.mailbox.JOB_TENSORS)" in e.value.details()
        assert node.service.stages.mailbox.waiting("flood") == cap  # nothing more was kept
        # the node goes on serving: control calls, link probes, and the job itself
        start = time.monotonic()
        node.stub.Ping(node_pb2.PingRequest(), timeout=QUICK)
        rpc.send(node.stub, probe_frames(), timeout=QUICK)
        assert time.monotonic() - start < QUICK
        assert node.service.stages.runs("flood")
        node.stub.StopJob(node_pb2.StopJobRequest(job_id="flood", release=True), timeout=QUICK)
        assert node.service.stages.mailbox.waiting("flood") == 0
    finally:
        node.close()


# -- idle streams ---------------------------------------------------------------------------


def idle_send(stub: rpc.NodeStub, first: list[bytes] | None = None):
    """A Send stream that sends ``first`` (if any) and then nothing: (queue, call)."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    for f in first or ():
        q.put(f)
    return q, stub.Send.future(iter(q.get, None))


def test_idle_streams_of_no_running_job_are_closed_in_bounded_time_and_a_running_jobs_stay():
    idle = 0.5  # any idle bound shows it; a short one keeps the test short
    node = Node(idle_stream=idle)
    try:
        node.load("live")
        node.load("ended", steps=50)
        start = time.monotonic()
        nameless_q, nameless = idle_send(node.stub)  # opened, never said which job
        live_q, live = idle_send(node.stub, tensor_frames("live", Kind.ACTIVATION, 3))
        ended_q, ended = idle_send(node.stub, tensor_frames("ended", Kind.ACTIVATION, 3))
        deadline = time.monotonic() + 5
        while node.service.stages.mailbox.waiting("ended") < 1:
            assert time.monotonic() < deadline, "the ended job's tensor never arrived"
            time.sleep(0.05)
        node.stub.StopJob(node_pb2.StopJobRequest(job_id="ended"), timeout=QUICK)  # it ends

        for call in (nameless, ended):
            with pytest.raises(grpc.RpcError) as e:
                call.result(timeout=idle + 5)
            assert e.value.code() == grpc.StatusCode.CANCELLED
        bound = idle + node.service.streams.interval + 1.0  # + scheduling slack
        assert time.monotonic() - start < bound
        # a running job's stream idles on (as stages do between DiLoCo outer steps)
        time.sleep(2 * idle)
        assert not live.done()
        assert node.service.streams.count() == 1
        live_q.put(None)
        assert isinstance(live.result(timeout=QUICK), node_pb2.SendReply)
        for q in (nameless_q, ended_q):
            q.put(None)
    finally:
        node.close()


def test_the_stream_watch_reaps_only_idle_streams_of_jobs_that_do_not_run():
    class Context:
        def __init__(self):
            self.cancelled = threading.Event()

        def cancel(self):
            self.cancelled.set()

        def peer(self):
            return "ipv4:127.0.0.1:1"

    running = {"a"}
    watch = StreamWatch(lambda job: job in running, idle=0.2, interval=3600)  # reap by hand
    try:
        contexts = {name: Context() for name in ("none", "a", "b", "busy")}
        with watch.open(contexts["none"], "Send"), \
                watch.open(contexts["a"], "Send", "a"), \
                watch.open(contexts["b"], "FetchState", "b"), \
                watch.open(contexts["busy"], "Send", "b") as busy:
            assert watch.reap() == 0  # nobody idled yet
            time.sleep(0.3)
            busy.touch()
            assert watch.reap() == 2
            assert {n for n, c in contexts.items() if c.cancelled.is_set()} == {"none", "b"}
            running.clear()
            time.sleep(0.3)
            assert watch.reap() == 2  # "a" has ended; "busy" has idled since
            assert watch.count() == 0
    finally:
        watch.close()


def test_every_channel_and_server_gets_keepalive():
    # one factory: the options every channel and server is made with
    for options in (net._OPTIONS, net._SERVER_OPTIONS):
        given = dict(options)
        assert given["grpc.keepalive_time_ms"] == round(net.timeouts.KEEPALIVE_TIME * 1000)
        assert given["grpc.keepalive_timeout_ms"] == round(
            net.timeouts.KEEPALIVE_TIMEOUT * 1000)
        assert given["grpc.keepalive_permit_without_calls"] == 1


def test_a_watched_stream_ends_at_its_next_message_once_its_caller_is_revoked():
    from fedpipe.security.certs import Identity, Role
    from fedpipe.security.errors import DenyListUnreadable
    from fedpipe.security.interceptor import _ATTR

    class Aborted(Exception):
        pass

    class Context:
        def peer(self):
            return "ipv4:127.0.0.1:1"

        def abort(self, code, details):
            raise Aborted(code, details)

    revoked: set[int] = set()
    broken: list[str] = []

    def serials() -> frozenset[int]:
        if broken:
            raise DenyListUnreadable(broken[0])
        return frozenset(revoked)

    watch = StreamWatch(lambda job: True, idle=60, interval=3600, revoked_serials=serials)
    try:
        ctx, other = Context(), Context()
        setattr(ctx, _ATTR, Identity(Role.NODE, "n1", 7))
        setattr(other, _ATTR, Identity(Role.NODE, "n2", 8))
        with watch.open(ctx, "Send") as w, watch.open(other, "Send") as w2:
            it, it2 = w.track(iter(range(10))), w2.track(iter(range(10)))
            assert [next(it), next(it2)] == [0, 0]
            revoked.add(7)
            with pytest.raises(Aborted) as e:
                next(it)
            assert e.value.args == (grpc.StatusCode.UNAUTHENTICATED,
                                    "Send stream ended: its certificate was revoked")
            assert next(it2) == 1  # others' streams go on
            broken.append("this server cannot read its deny list: bad JSON")
            with pytest.raises(Aborted) as e:
                next(it2)
            assert e.value.args[0] is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(Aborted):  # a stream opened after the revocation ends at once
            broken.clear()
            with watch.open(ctx, "FetchState"):
                pass
    finally:
        watch.close()
