"""The socket data plane between two processes: tensors echoed back over the one connection
the parent dialed, and a peer killed mid-stream reported at once, then given up."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from fedpipe.net.dataplane import DataPlane, LinkFailed, Timeouts
from fedpipe.proto import node_pb2

pytestmark = [pytest.mark.timeout(180), pytest.mark.processes]

# the child: a plane whose receiver echoes every tensor back to its sender, from a thread of
# its own (a receiver must not send on the link it is being read from: it would wait for
# credit that only its own reader can bring back)
CHILD = textwrap.dedent("""
    import queue, sys, threading
    from fedpipe.net.dataplane import DataPlane
    out = queue.SimpleQueue()

    class Echo:
        def admit(self, peer, header):
            return 1 << 30

        def deliver(self, peer, header, tensor):
            out.put((peer.name, header, tensor))

    plane = DataPlane("child", Echo())
    print(plane.port, flush=True)

    def echo():
        while True:
            name, header, tensor = out.get()
            plane.link(name, "").send(tensor * 2, envelope=header.envelope)
    threading.Thread(target=echo, daemon=True).start()
    sys.stdin.read()
""")


class Inbox:
    def __init__(self):
        self.got: queue.SimpleQueue = queue.SimpleQueue()

    def admit(self, peer, header):
        return 1 << 30

    def deliver(self, peer, header, tensor):
        self.got.put((header, tensor))


@pytest.fixture
def child():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(p.stdout.readline())
        yield p, port
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def env(step: int) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id="j", stage=1, step=step, kind=node_pb2.KIND_ACTIVATION,
                             batch_size=1)


def test_tensors_go_to_another_process_and_come_back_over_one_connection(child):
    _, port = child
    inbox = Inbox()
    with DataPlane("parent", inbox) as plane:
        link = plane.link("child", f"127.0.0.1:{port}")
        sent = [torch.randn(n) for n in (1, 1000, 1 << 20, 3 << 20)] * 3
        for i, t in enumerate(sent):
            link.send(t, envelope=env(i))
        link.flush(30)
        back = [inbox.got.get(timeout=30) for _ in sent]
        assert len(plane.links()) == 1  # the echo came over the connection dialed here
    assert [h.envelope.step for h, _ in back] == list(range(len(sent)))
    assert all(torch.equal(t, 2 * s) for (_, t), s in zip(back, sent))


def test_a_killed_peer_is_reported_at_once_and_its_link_fails_after_the_resume_window(child):
    p, port = child
    lost, failed = [], []

    class Events:
        def lost(self, peer, why):
            lost.append(time.monotonic())

        def failed(self, peer, why):
            failed.append(time.monotonic())
    quick = Timeouts(credit=10.0, resume=1.0, handshake=1.0, backoff_min=0.05,
                     backoff_max=0.2)
    with DataPlane("parent", Inbox(), events=Events(), timeouts=quick) as plane:
        link = plane.link("child", f"127.0.0.1:{port}")
        stop = threading.Event()
        errors: list[Exception] = []

        def pump():
            try:
                while not stop.is_set():
                    link.send(torch.randn(1 << 18), envelope=env(0))
            except LinkFailed as e:
                errors.append(e)
        th = threading.Thread(target=pump)
        th.start()
        time.sleep(0.5)
        killed = time.monotonic()
        p.send_signal(signal.SIGKILL)
        th.join(15)
        stop.set()
        assert not th.is_alive()
    assert lost and lost[0] - killed < 1.0  # the broken connection, reported at once
    # no redial answered within 1 s (it gives up when the next pause would pass that)
    assert failed and 0.7 <= failed[0] - killed < 5.0
    assert errors and "child" in str(errors[0])
