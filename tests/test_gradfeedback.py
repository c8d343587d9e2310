"""A stage's gradient error feedback in its checkpoint, in-process: taken at a step
boundary, carried over the wire and through layer pieces, restored so the next gradient
is encoded to the same bytes as without the interruption.

A process test (kill -9 and a drain of a job with int8 activations and top-k gradients)
is tests/test_recovery_codecs.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fedpipe.node.peers import ChannelPool, PeerSender, StagePeers, encode
from fedpipe.proto import node_pb2
from fedpipe.runtime import checkpoint, layerstate
from fedpipe.runtime.checkpoint import FEEDBACK
from fedpipe.runtime.gradfeedback import GradientFeedbackPart
from fedpipe.spec import Kind
from fedpipe.wire import codecs

pytestmark = pytest.mark.timeout(60)
CODEC = "topk:0.05"


def gradient(stage: int, microbatch: int) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id="j", replica=0, stage=stage, kind=Kind.GRADIENT.value,
                             step=0, microbatch=microbatch, batch_size=1)


def send_steps(feedback: codecs.ErrorFeedback, seed: int, steps: int, receiver: int = 1,
               microbatches: int = 2) -> list[bytes]:
    """Encode ``steps`` steps of gradients to ``receiver`` as a stage's senders do; the
    payloads, in order."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        for m in range(microbatches):
            _, payload = encode(gradient(receiver, m), torch.randn(4, 8, generator=g), CODEC,
                                feedback)
            out.append(bytes(payload))
    return out


def part(feedback: codecs.ErrorFeedback, boundary: int = 3, replica: int = 0,
         receiver: int = 1) -> GradientFeedbackPart:
    return GradientFeedbackPart(feedback, lambda: None, boundary, replica, receiver)


def test_a_restored_sender_encodes_the_next_gradients_as_the_uninterrupted_one():
    kept = codecs.ErrorFeedback()
    send_steps(kept, seed=0, steps=3)
    # over the wire, as a buddy keeps it
    _, snap = checkpoint.from_frames(checkpoint.to_frames(checkpoint.take({FEEDBACK: part(kept)},
                                                                          3)), 2**20)
    restored = codecs.ErrorFeedback()
    checkpoint.restore({FEEDBACK: part(restored)}, snap)
    assert len(restored) == 2  # one residual per microbatch
    assert send_steps(restored, seed=1, steps=2) == send_steps(kept, seed=1, steps=2)
    # without the residuals the same gradients are sent otherwise: the check can fail
    assert send_steps(codecs.ErrorFeedback(), seed=1, steps=2) != send_steps(
        _copy(kept), seed=1, steps=2)


def _copy(feedback: codecs.ErrorFeedback) -> codecs.ErrorFeedback:
    out = codecs.ErrorFeedback()
    out.load_state_dict(feedback.state_dict())
    return out


def test_the_state_names_boundary_group_microbatch_and_shape():
    fb = codecs.ErrorFeedback()
    send_steps(fb, seed=0, steps=1, receiver=1)
    state = part(fb).state_dict()
    assert (state["boundary"], state["replica"]) == (3, 0)
    assert [(m, s) for m, s, _ in state["residuals"]] == [(0, [4, 8]), (1, [4, 8])]
    assert all(r.dtype == torch.float32 for _, _, r in state["residuals"])


@pytest.mark.parametrize("boundary,replica", [(5, 0), (3, 1)])
def test_residuals_of_another_boundary_or_group_start_afresh(boundary, replica):
    fb = codecs.ErrorFeedback()
    send_steps(fb, seed=0, steps=2)
    snap = checkpoint.take({FEEDBACK: part(fb)}, 2)
    other = codecs.ErrorFeedback()
    other.remember("stale", torch.zeros(1))
    checkpoint.restore({FEEDBACK: part(other, boundary, replica)}, snap)
    assert len(other) == 0


def test_a_snapshot_without_feedback_restores_with_none():
    fb = codecs.ErrorFeedback()
    fb.remember((1, 0, (2,)), torch.ones(2))
    mod = nn.Sequential(nn.Linear(2, 2))
    snap = checkpoint.take({"module": mod}, 1)  # taken by an older fedpipe
    checkpoint.restore({"module": mod, FEEDBACK: part(fb)}, snap)
    assert len(fb) == 1  # left as the stage was built (a new stage: empty)


def stage_parts(net: nn.Sequential, a: int, b: int, feedback: codecs.ErrorFeedback,
                stage: int) -> dict:
    mod = nn.Sequential(*net[a:b])
    return {checkpoint.LAYOUT: layerstate.Layout(mod, a), "module": mod,
            FEEDBACK: part(feedback, boundary=a, receiver=stage - 1)}


def test_a_resplit_keeps_the_residuals_of_a_boundary_it_keeps():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    # two stages [0, 2) [2, 4); the second's gradients cross the boundary at layer 2
    first, second = codecs.ErrorFeedback(), codecs.ErrorFeedback()
    send_steps(second, seed=0, steps=2, receiver=0)
    snaps = [checkpoint.take(stage_parts(net, 0, 2, first, 0), 2),
             checkpoint.take(stage_parts(net, 2, 4, second, 1), 2)]
    # re-split in three: [0, 1) [1, 2) [2, 4); the boundary at 2 is now stage 2's
    got = [codecs.ErrorFeedback() for _ in range(3)]
    for s, (a, b) in enumerate([(0, 1), (1, 2), (2, 4)]):
        pieces = [layerstate.split(snap, a, b) for snap in snaps]
        parts = stage_parts(net, a, b, got[s], s)
        layerstate.restore(parts, layerstate.merge(pieces))
    assert len(got[0]) == len(got[1]) == 0  # layer 1 was no boundary: a new one starts afresh
    assert {k[0] for k, _ in got[2].state_dict()["residuals"]} == {1}  # keyed to its receiver
    assert send_steps(got[2], seed=1, steps=1, receiver=1) == \
        send_steps(_rekeyed(second, 1), seed=1, steps=1, receiver=1)


def _rekeyed(feedback: codecs.ErrorFeedback, receiver: int) -> codecs.ErrorFeedback:
    out = codecs.ErrorFeedback()
    for (_, m, shape), r in feedback.state_dict()["residuals"]:
        out.remember((receiver, m, shape), r)
    return out


def test_a_stages_senders_share_its_feedback_and_settle_waits_for_their_encoding():
    """A real gRPC sender (to a port nobody listens on: the tensor is encoded, its stream
    waits for the peer): the residual is there once :meth:`StagePeers.settle` returns."""
    pool = ChannelPool()
    peers = StagePeers(pool)
    peer = node_pb2.StageAssignment(replica=0, stage=0, node_id="n", address="127.0.0.1:9",
                                    node_name="n")
    sender = peers.sender(peer)
    try:
        assert isinstance(sender, PeerSender) and sender.feedback is peers.feedback
        big = torch.randn(256, 4096)  # top-k of 1 M values: the encoder takes a while
        sender.submit(gradient(0, 0), big, CODEC)
        state = GradientFeedbackPart(peers.feedback, peers.settle, 2, 0, 0).state_dict()
        [(microbatch, shape, residual)] = state["residuals"]
        assert (microbatch, shape) == (0, [256, 4096])
        # the residual is what top-k left over: the gradient minus what was sent
        assert 0 < int((residual != 0).sum()) < big.numel()
    finally:
        peers.close()
