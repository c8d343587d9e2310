"""A checkpoint snapshot to a buddy over the socket data plane shares the link with the
stages' tensors to that node, in one process over real sockets on 127.0.0.1: the snapshot
is done once the buddy acknowledged its own tensors, however busy the stages keep the link
(it waited for the link to fall idle: a checkpoint completed late, or not while a stage
streamed), and the buddy's refusal of a snapshot is raised to the snapshot's shipper only,
never to the stage sending on the same link, and leaves nothing behind on the link."""
from __future__ import annotations

import threading

import pytest
import torch

from fedpipe.net.dataplane import Code, DataPlane, PeerRefused
from fedpipe.node.peers import SocketSender
from fedpipe.node.snapshots import send_snapshot
from fedpipe.proto import node_pb2
from fedpipe.spec import Kind, StageKey
from test_node_dataplane import Arrivals, a_snapshot, snapshot_envelope, snapshot_receiver

pytestmark = pytest.mark.timeout(90)
HOLD = 20.0
"""Seconds the buddy's stage holds a tensor at most: a snapshot that waits for the link to
fall idle waits this long."""


def activation(step: int) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id="j", stage=1, step=step, kind=Kind.ACTIVATION.value,
                             batch_size=1)


class Busy:
    """The buddy's receiver: snapshots to the real desk; once the snapshot is kept,
    ``then()`` runs (before the link acknowledges the snapshot's last tensor); a stage
    tensor is held (its stage is busy) until :attr:`release` is set, or :data:`HOLD` passed."""

    def __init__(self, inner, store, then):
        self.inner, self.store, self.then = inner, store, then
        self.release = threading.Event()
        self.done = False

    def admit(self, peer, header):
        return self.inner.admit(peer, header)

    def deliver(self, peer, header, tensor):
        if header.envelope.kind == Kind.ACTIVATION.value:
            self.release.wait(HOLD)
        self.inner.deliver(peer, header, tensor)
        if not self.done and self.store.get("j", StageKey(0, 1), 3) is not None:
            self.done = True
            self.then()


def test_a_snapshot_is_done_once_its_own_tensors_are_acknowledged_while_the_link_is_busy():
    r, store = snapshot_receiver()
    snap = a_snapshot()
    stage: list[SocketSender] = []
    # once the snapshot is in, the node's stage sends a tensor the buddy holds: the link is
    # not idle until it is released
    busy = Busy(r, store, lambda: stage[0].submit(activation(0), torch.zeros(4), "raw"))
    # window_messages=4: the buddy acknowledges each tensor as it is delivered
    with DataPlane("node0", Arrivals()) as a, \
            DataPlane("node1", busy, events=r, window_messages=4) as b:
        link = a.link("node1", b.address)
        stage.append(SocketSender(link, b.address, "node1"))
        try:
            send_snapshot(link, snapshot_envelope(), snap)
            held = busy.done and not busy.release.is_set() and link.credits.messages_out == 1
        finally:
            busy.release.set()
        stage[0].flush()  # the stage's tensor arrives too
    assert held, "the snapshot waited for the stage's tensor to be acknowledged"
    kept = store.get("j", StageKey(0, 1), 3)
    assert kept is not None and all(torch.equal(kept.tensors[k], t)
                                    for k, t in snap.tensors.items())
    assert [env.step for env in r.admission.delivered] == [0]


def test_a_buddys_refusal_of_a_snapshot_is_raised_to_its_shipper_not_to_the_stage():
    r, store = snapshot_receiver(job_bytes=16)  # the snapshot's weight alone is 48 bytes
    with DataPlane("node0", Arrivals()) as a, DataPlane("node1", r, events=r) as b:
        link = a.link("node1", b.address)
        stage = SocketSender(link, b.address, "node1")
        stage.submit(activation(0), torch.zeros(4), "raw")  # the same job and epoch
        with pytest.raises(PeerRefused) as e:
            send_snapshot(link, snapshot_envelope(), a_snapshot())
        assert e.value.code == Code.RESOURCE_EXHAUSTED and "snapshot refused" in str(e.value)
        stage.submit(activation(1), torch.zeros(4), "raw")
        stage.flush()  # the stage's sends are not failed by the snapshot's refusal
        assert link.refused == {}  # every refusal of the snapshot's tensors was collected
    assert store.get("j", StageKey(0, 1), 3) is None
    assert [env.step for env in r.admission.delivered] == [0, 1]
