"""The node's socket receiver checks a tensor as ``Send`` on gRPC does, with the same codes.

:class:`fedpipe.node.dataplane.NodeReceiver` between a link and the node's
admission: the policy's roles for ``Send``, the kinds a client may send, who is
assigned to the job, then the stage; each refusal carries the gRPC status
code the node's error table gives the same error on gRPC. A link that broke
after a neighbour's pipeline tensor reports that neighbour (the suspect path). A client
that leaves once its jobs are over here ends quietly ("client X left"); one whose link
broke mid-job is still a warning.
A stage's :class:`~fedpipe.node.peers.SocketSender` on an emulated link
(``--link-profile``) pays the link's latency and bandwidth as gRPC's shaper does.
"""
from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from fedpipe.net.dataplane import Code, DataPlane, Peer, PeerRefused, Refused
from fedpipe.net.emulation import EmulatedLink, Pacer
from fedpipe.node.access import JobAccessBook
from fedpipe.node.dataplane import NodeReceiver
from fedpipe.node.errors import NoSuchStage
from fedpipe.node.linkprobe import measure_socket_link
from fedpipe.node.peers import SocketSender
from fedpipe.node.snapshots import SnapshotDesk, SnapshotStore, send_snapshot
from fedpipe.proto import node_pb2
from fedpipe.security import Identity, Role
from fedpipe.runtime import checkpoint
from fedpipe.runtime.checkpoint import Snapshot
from fedpipe.spec import Kind, StageKey

pytestmark = pytest.mark.timeout(30)


class FakeAdmission:
    """Admits every tensor of job ``j`` (for a held stage), records deliveries and suspects."""

    def __init__(self):
        self.delivered: list[node_pb2.Envelope] = []
        self.suspected: list[node_pb2.Envelope] = []

    def admit(self, env, shape=()):
        if env.job_id != "j":
            raise NoSuchStage(f"no stage {env.stage} of job {env.job_id!r}")
        return 1 << 20

    def admitted(self, env, shape=()):  # its stages keep no codec state: the limit alone
        return self.admit(env, shape)

    def deliver(self, env, tensor, active, defer=False):
        self.delivered.append(env)

    def suspect(self, env):
        self.suspected.append(env)


class FakeStages:
    def get(self, slot):
        class Stage:
            n_stages = 2
        if slot.job_id != "j":
            raise NoSuchStage(f"no job {slot.job_id!r}")
        return Stage()


def receiver() -> tuple[NodeReceiver, FakeAdmission]:
    access = JobAccessBook()
    access.learn("j", "alice", ["node0", "node1"])
    admission = FakeAdmission()
    return NodeReceiver(access, admission, FakeStages()), admission  # type: ignore[arg-type]


def peer(role: Role, name: str) -> Peer:
    return Peer(name, role.value, Identity(role, name, 1))


def header(kind: Kind, job: str = "j", stage: int = 1) -> node_pb2.Frame:
    return node_pb2.Frame(envelope=node_pb2.Envelope(job_id=job, stage=stage, kind=kind.value,
                                                     batch_size=1))


def refused(r: NodeReceiver, who: Peer, head: node_pb2.Frame) -> Code:
    with pytest.raises(Refused) as e:
        r.admit(who, head)
    return e.value.code


def test_an_assigned_node_may_send_a_job_its_activations():
    r, admission = receiver()
    assert r.admit(peer(Role.NODE, "node0"), header(Kind.ACTIVATION)) == 1 << 20
    r.deliver(peer(Role.NODE, "node0"), header(Kind.ACTIVATION), torch.zeros(1))
    assert len(admission.delivered) == 1 and r.received == 1


def test_a_node_the_job_does_not_assign_is_refused_permission():
    r, _ = receiver()
    assert refused(r, peer(Role.NODE, "mallory"), header(Kind.ACTIVATION)) \
        == Code.PERMISSION_DENIED


def test_a_client_may_send_only_its_own_jobs_inputs_and_targets():
    r, _ = receiver()
    assert refused(r, peer(Role.CLIENT, "alice"), header(Kind.ACTIVATION)) \
        == Code.PERMISSION_DENIED
    assert refused(r, peer(Role.CLIENT, "bob"), header(Kind.INPUT, stage=0)) \
        == Code.PERMISSION_DENIED
    assert r.admit(peer(Role.CLIENT, "alice"), header(Kind.INPUT, stage=0)) == 1 << 20
    # inputs go to the first stage only
    assert refused(r, peer(Role.CLIENT, "alice"), header(Kind.INPUT, stage=1)) \
        == Code.PERMISSION_DENIED


def test_a_role_the_policy_does_not_admit_to_send_is_refused():
    r, _ = receiver()
    assert refused(r, peer(Role.TRACKER, "tracker"), header(Kind.ACTIVATION)) \
        == Code.PERMISSION_DENIED


def test_a_revoked_certificate_is_refused_on_a_link_that_is_already_open():
    r, _ = receiver()
    r.revoked = lambda: frozenset({1})
    assert refused(r, peer(Role.NODE, "node0"), header(Kind.ACTIVATION)) \
        == Code.UNAUTHENTICATED


def test_a_stage_not_held_here_is_not_found_as_on_grpc():
    r, _ = receiver()
    assert refused(r, Peer("node0", "node"), header(Kind.ACTIVATION, job="other")) \
        == Code.NOT_FOUND


def test_a_broken_link_reports_the_neighbour_whose_pipeline_tensor_came_last():
    r, admission = receiver()
    r.lost("node0", "reset")  # nothing came from it yet: nothing to report
    assert admission.suspected == []
    r.deliver(peer(Role.NODE, "node0"), header(Kind.ACTIVATION), torch.zeros(1))
    r.lost("node0", "reset")
    assert [e.kind for e in admission.suspected] == [Kind.ACTIVATION.value]


class LiveJobs(FakeStages):
    """Stages of job ``j`` (as FakeStages); ``live``: the jobs with a live stage here
    (:meth:`fedpipe.node.stages.StageRegistry.runs`), changed by the test."""

    def __init__(self, live: set[str]):
        self.live = live

    def runs(self, job_id: str) -> bool:
        return job_id in self.live


def logged(caplog, text: str, level: int, timeout: float = 10.0) -> logging.LogRecord:
    """The first record of ``fedpipe.node.dataplane`` at ``level`` whose message holds
    ``text``, waited for (a link's events come on its own threads)."""
    deadline = time.monotonic() + timeout
    while True:
        for r in list(caplog.records):
            if r.name == "fedpipe.node.dataplane" and r.levelno == level \
                    and text in r.getMessage():
                return r
        assert time.monotonic() < deadline, f"no {logging.getLevelName(level)} " \
            f"{text!r} in {[r.getMessage() for r in caplog.records]}"
        time.sleep(0.02)


@pytest.mark.parametrize("live_at_break, live_at_failure, left", [
    (False, False, True),   # the job ended (and was released) before the client went
    (True, True, False),    # the client went mid-job
    (True, False, False),   # mid-job, and the job was parked before the link failed
])
def test_a_client_that_leaves_after_its_jobs_ended_is_no_warning_but_mid_job_it_is(
        caplog, live_at_break, live_at_failure, left):
    from fedpipe.client.links import NoInbound
    from fedpipe.net.dataplane import Timeouts, client_name
    access = JobAccessBook()
    access.learn("j", "", ["node0"])
    stages = LiveJobs({"j"} if live_at_break else set())
    r = NodeReceiver(access, FakeAdmission(), stages)  # type: ignore[arg-type]
    quick = Timeouts(resume=0.5)  # how long the node waits for the client to dial again
    name = client_name("alice")
    with caplog.at_level(logging.DEBUG, logger="fedpipe.node.dataplane"), \
            DataPlane("node0", r, events=r, timeouts=quick) as node:
        with DataPlane(name, NoInbound(), role="client", listen=False) as client:
            client.link("node0", node.address, "j").send(
                torch.zeros(2), envelope=header(Kind.INPUT, stage=0).envelope, flush=True)
        if live_at_break:  # the break was seen while the job ran
            logged(caplog, f"data connection to {name} broke", logging.INFO)
        else:
            logged(caplog, f"data connection to client {name} closed", logging.DEBUG)
        stages.live = {"j"} if live_at_failure else set()
        if left:
            logged(caplog, f"client {name} left: no job it fed runs on this node",
                   logging.INFO)
        else:
            logged(caplog, f"data link to {name} failed: {name} did not reconnect",
                   logging.WARNING)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                and r.name == "fedpipe.node.dataplane"]
    assert (warnings == []) == left, warnings


class Arrivals:
    """A receiver that notes when each tensor arrived (``time.monotonic()``)."""

    def __init__(self):
        self.times: list[float] = []
        self.tensors: list[torch.Tensor] = []
        self.cond = threading.Condition()

    def admit(self, peer, header):
        return 1 << 24

    def deliver(self, peer, header, tensor):
        with self.cond:
            self.times.append(time.monotonic())
            self.tensors.append(tensor.clone())
            self.cond.notify_all()


def test_a_socket_sender_on_an_emulated_link_pays_latency_in_flight_and_bandwidth():
    inbox = Arrivals()
    latency, bandwidth, n, size = 0.2, 2e6, 4, 100_000  # 4 x 100 kB at 2 MB/s: 0.2 s
    with DataPlane("a", Arrivals()) as a, DataPlane("b", inbox) as b:
        sender = SocketSender(a.link("b", b.address), "b:grpc", "b",
                              pacer=Pacer(EmulatedLink(bandwidth, latency)))
        sent = [torch.full((size // 4,), float(i)) for i in range(n)]
        t0 = time.monotonic()
        for i, t in enumerate(sent):
            sender.submit(node_pb2.Envelope(kind=Kind.ACTIVATION.value, microbatch=i), t, "raw")
        sender.flush()
        took = time.monotonic() - t0
        sender.close()
    assert all(torch.equal(x, y) for x, y in zip(sorted(inbox.tensors, key=lambda t: t[0]),
                                                 sent))
    first = inbox.times[0] - t0
    assert first >= latency, f"the first tensor came {first:.3f} s after it was sent"
    # in flight together (a delay line), not one latency each; the bucket paces the bytes;
    # the flush pays the acknowledgement's trip back
    span = inbox.times[-1] - t0
    assert latency + (n * size - 64 * 1024) / bandwidth * 0.9 <= span < n * latency + 1.0, span
    assert took >= span + latency * 0.9, (took, span)


def test_a_socket_sender_without_emulation_sends_small_raw_tensors_on_the_callers_thread():
    inbox = Arrivals()
    with DataPlane("a", Arrivals()) as a, DataPlane("b", inbox) as b:
        sender = SocketSender(a.link("b", b.address), "b:grpc", "b")
        t = torch.arange(10.0)
        sender.submit(node_pb2.Envelope(kind=Kind.GRADIENT.value), t, "raw")
        sender.flush()
        sender.check()
        sender.close()
    assert torch.equal(inbox.tensors[0], t)


def snapshot_receiver(job_bytes: int = 1 << 30, directory=None
                      ) -> tuple[NodeReceiver, SnapshotStore]:
    """A receiver whose snapshots go to a real desk and store (on disk in ``directory``,
    if given); job ``j``'s stage (0, 1)."""
    access = JobAccessBook()
    access.learn("j", "alice", ["node0", "node1"], [StageKey(0, 1)])
    store = SnapshotStore(directory=directory)
    desk = SnapshotDesk(store, lambda job: job == "j", job_bytes)
    return NodeReceiver(access, FakeAdmission(), FakeStages(), desk=desk), store  # type: ignore[arg-type]


def a_snapshot(step: int = 3) -> Snapshot:
    model = torch.nn.Linear(4, 3)
    return checkpoint.take({"module": model}, step)


def snapshot_envelope(step: int = 3, job: str = "j") -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id=job, replica=0, stage=1, kind=Kind.SNAPSHOT.value,
                             step=step, batch_size=1)


def test_a_buddys_snapshot_comes_over_a_socket_link_and_is_kept_bit_for_bit():
    r, store = snapshot_receiver()
    snap = a_snapshot()
    with DataPlane("node0", Arrivals()) as a, DataPlane("node1", r, events=r) as b:
        send_snapshot(a.link("node1", b.address), snapshot_envelope(), snap)
    kept = store.get("j", StageKey(0, 1), 3)
    assert kept is not None and kept.skeleton == snap.skeleton
    assert set(kept.tensors) == set(snap.tensors)
    assert all(torch.equal(kept.tensors[k], t) for k, t in snap.tensors.items())
    assert r.snapshot_tensors == 1 + len(snap.tensors)  # the skeleton, then each tensor


def test_a_buddys_snapshot_over_a_socket_link_goes_to_disk_tensor_by_tensor(tmp_path):
    from fedpipe.runtime.tensorfile import TensorFile
    r, store = snapshot_receiver(directory=tmp_path)
    snap = a_snapshot()
    with DataPlane("node0", Arrivals()) as a, DataPlane("node1", r, events=r) as b:
        send_snapshot(a.link("node1", b.address), snapshot_envelope(), snap)
        send_snapshot(a.link("node1", b.address), snapshot_envelope(5), a_snapshot(5))
    kept = store.get("j", StageKey(0, 1), 3)
    assert kept is not None and isinstance(kept.tensors, TensorFile)
    assert all(torch.equal(kept.tensors[k], t) for k, t in snap.tensors.items())
    assert store.steps("j", StageKey(0, 1)) == [3, 5]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == sorted(
        store.file("j", StageKey(0, 1), s).name for s in (3, 5))  # no partial file


def test_a_snapshot_past_the_jobs_room_is_refused_on_a_header_and_nothing_is_kept():
    r, store = snapshot_receiver(job_bytes=16)  # the weight alone is 48 bytes
    with DataPlane("node0", Arrivals()) as a, DataPlane("node1", r, events=r) as b:
        with pytest.raises(PeerRefused) as e:
            send_snapshot(a.link("node1", b.address), snapshot_envelope(), a_snapshot())
    assert e.value.code == Code.RESOURCE_EXHAUSTED and "snapshot refused" in str(e.value)
    assert store.get("j", StageKey(0, 1), 3) is None


def test_a_snapshot_tensor_is_checked_as_put_snapshot_is():
    r, _ = snapshot_receiver()
    skeleton = node_pb2.Frame(envelope=snapshot_envelope(), name=checkpoint.SKELETON)
    # a node the job does not assign, a client of another user: as PutSnapshot refuses them
    assert refused(r, peer(Role.NODE, "mallory"), skeleton) == Code.PERMISSION_DENIED
    assert refused(r, peer(Role.CLIENT, "bob"), skeleton) == Code.PERMISSION_DENIED
    # a tensor of a snapshot whose skeleton did not come first
    part = node_pb2.Frame(envelope=snapshot_envelope(), name="module/weight")
    assert refused(r, peer(Role.NODE, "node0"), part) == Code.INVALID_ARGUMENT


def test_a_link_measured_over_the_socket_plane_pays_the_emulated_link():
    latency, bandwidth = 0.02, 20e6
    inbox = Arrivals()
    with DataPlane("a", Arrivals()) as a, DataPlane("b", inbox) as b:
        one_way, measured = measure_socket_link(
            a.link("b", b.address), Pacer(EmulatedLink(bandwidth, latency)), pings=3,
            max_bytes=1 << 20, seconds=0.05)
    assert latency * 0.9 <= one_way <= latency * 3, one_way
    assert bandwidth * 0.5 <= measured <= bandwidth * 1.5, measured
    assert len(inbox.tensors) == 3 + 2  # the pings and two probes crossed the link
