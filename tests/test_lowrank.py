"""Tests of the lowrank codecs (fedpipe.wire.lowrank): a basis per link at both ends, sent
when it changes; round trips, size model, replay, checkpointed state, hostile messages."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedpipe.proto import tensor_pb2 as pb
from fedpipe.runtime import checkpoint
from fedpipe.spec import (CodecSpec, JobSpec, JobSpecError, SpecError, check_compression,
                          lowrank_problem, parse_codec)
from fedpipe.wire.codecmodel import MODELS, Layout, lowrank_basis_bytes, lowrank_bytes_per_row
from fedpipe.wire.codecs import ErrorFeedback, WireError, decode, encode
from fedpipe.wire.lowrank import End, Subspace, principal

pytestmark = pytest.mark.timeout(120)

KEY = "boundary:0"


def wire(msg: pb.Tensor) -> pb.Tensor:
    """The message as a receiver sees it: serialised and parsed again."""
    return pb.Tensor.FromString(msg.SerializeToString())


def acts(shape=(4, 16, 32), seed=0, rank=None):
    """Activations; with ``rank``, lying in a random ``rank``-dimensional subspace."""
    g = torch.Generator().manual_seed(seed)
    if rank is None:
        return torch.randn(shape, generator=g)
    q, _ = torch.linalg.qr(torch.randn(shape[-1], rank, generator=g, dtype=torch.float64))
    return (torch.randn(*shape[:-1], rank, generator=g, dtype=torch.float64) @ q.T).float()


class Link:
    """Both ends of one boundary: the sender's and the receiver's state."""

    def __init__(self):
        self.sender, self.receiver = Subspace(), Subspace()

    def forward(self, x, spec, step):
        msg = wire(encode(x, spec, end=End(self.sender, KEY, step)))
        return msg, decode(msg, end=End(self.receiver, KEY))

    def backward(self, g, spec, feedback=None, key=None):
        msg = wire(encode(g, spec, feedback=feedback, key=key, end=End(self.receiver, KEY)))
        return msg, decode(msg, end=End(self.sender, KEY))


# --- round trips -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_activations_in_the_subspace_come_back_and_others_are_projected_onto_it(dtype):
    link = Link()
    x = acts(rank=6).to(dtype)
    msg, y = link.forward(x, "lowrank:6", step=0)
    assert (y.dtype, y.shape, msg.k, msg.basis, msg.basis_version) == (dtype, x.shape, 6, True, 1)
    torch.testing.assert_close(y, x, rtol=0, atol=1e-5 if dtype != torch.bfloat16 else 0.05)
    other = acts(seed=1).to(dtype)  # full rank: its projection onto the same basis
    _, y = link.forward(other, "lowrank:6", step=1)
    p = link.sender.basis(KEY).matrix.double()
    torch.testing.assert_close(y.double(), other.double() @ p @ p.T, rtol=0,
                               atol=1e-5 if dtype != torch.bfloat16 else 0.1)


def test_the_basis_is_the_top_principal_directions_orthonormal_and_sign_fixed():
    x = acts(shape=(512, 32), seed=2) * 0.6 ** torch.arange(32)  # decreasing variances
    p = principal(x, 5)
    torch.testing.assert_close(p.T @ p, torch.eye(5), rtol=0, atol=1e-5)
    assert (p.abs().argmax(0) == torch.arange(5)).all()  # the 5 largest-variance axes
    assert (p.gather(0, p.abs().argmax(0, keepdim=True)) > 0).all()


def test_lowrank8_is_within_int8_error_of_the_projection():
    link = Link()
    x = acts(rank=8, seed=3)
    _, y = link.forward(x, "lowrank8:8", step=0)
    err = ((y - x).norm() / x.norm()).item()
    assert 0 < err < 0.01  # 127 levels per row of coefficients


def test_gradients_go_back_in_the_basis_the_activations_made():
    link = Link()
    link.forward(acts(seed=4), "lowrank:8", step=0)
    g = acts(seed=5)
    msg, back = link.backward(g, "lowrank:8")
    assert not msg.basis and msg.basis_version == 1  # the receiver made it: nothing to carry
    p = link.sender.basis(KEY).matrix
    torch.testing.assert_close(back, g @ p @ p.T, rtol=1e-5, atol=1e-5)


def test_gradient_error_feedback_loses_nothing():
    link, fb = Link(), ErrorFeedback()
    link.forward(acts(seed=6), "lowrank:4", step=0)
    inputs = sent = torch.zeros(4, 16, 32, dtype=torch.float64)
    for step in range(20):
        g = acts(seed=100 + step)
        inputs = inputs + g.double()
        sent = sent + link.backward(g, "lowrank:4", fb, key=(0, 0))[1].double()
    torch.testing.assert_close(sent + fb.residual((0, 0)).double(), inputs, rtol=1e-5,
                               atol=1e-4)


# --- sizes -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["lowrank", "lowrank8"])
@pytest.mark.parametrize("shape,rank", [((4, 16, 32), 8), ((7, 3), 3), ((0, 8), 2), ((5,), 5)])
def test_the_wire_encodes_exactly_the_bytes_its_model_says(name, shape, rank):
    link = Link()
    for step, carried in ((0, True), (1, False)):
        msg, y = link.forward(acts(shape, seed=7), f"{name}:{rank}", step)
        assert msg.basis == carried and y.shape == shape
        layout = Layout(math.prod(shape), k=rank, width=shape[-1], basis=carried)
        assert msg.encoded_bytes == len(msg.payload) == MODELS[name].encoded_bytes(layout)


def test_the_basis_is_sent_only_when_it_is_refreshed_and_the_amortised_size_holds():
    link, total, rows = Link(), 0, 0
    for step in range(12):
        msg, _ = link.forward(acts(seed=step), "lowrank8:8@5", step)
        assert msg.basis == (step % 5 == 0) and msg.basis_version == step // 5 + 1
        total, rows = total + len(msg.payload), rows + 4 * 16
    # 3 bases in 12 steps of 64 rows: each carried once per 5 x 64 rows, but for the last
    assert total == 3 * lowrank_basis_bytes(32, 8) + rows * (4 + 8)
    assert lowrank_bytes_per_row("lowrank8", 32, 8, 5 * 64) == 12 + 4 * 32 * 8 / 320


# --- replay and checkpoints -------------------------------------------------------

def test_the_same_data_give_the_same_bytes():
    a, b = Link(), Link()
    for step in range(6):
        x = acts(seed=10 + step)
        assert a.forward(x, "lowrank8:4@2", step)[0] == b.forward(x, "lowrank8:4@2", step)[0]


def test_a_restored_link_continues_as_the_original_and_carries_its_basis_once_more():
    original = Link()
    for step in range(3):
        original.forward(acts(seed=step), "lowrank:8@4", step)
    snaps = [checkpoint.take({"codec": end}, 3) for end in (original.sender, original.receiver)]
    restored = Link()
    for snap, end in zip(snaps, (restored.sender, restored.receiver)):
        _, got = checkpoint.from_frames(checkpoint.to_frames(snap), 2**30)  # over the wire
        checkpoint.restore({"codec": end}, got)
    migrated = Link()  # a receiver that never had the basis: a replacement stage
    migrated.sender = restored.sender
    for step in range(3, 10):
        x = acts(seed=step)
        want_msg, want = original.forward(x, "lowrank:8@4", step)
        msg, got = restored.forward(x, "lowrank:8@4", step)
        assert msg.basis == (step in (3, 4, 8)) and msg.basis_version == want_msg.basis_version
        assert torch.equal(got, want)
        assert torch.equal(decode(msg, end=End(migrated.receiver, KEY)), want)


def test_a_sender_restarted_without_state_replaces_the_receivers_basis():
    link = Link()
    link.forward(acts(seed=30), "lowrank:4", step=0)
    link.sender = Subspace()  # a replacement with no checkpoint: its first basis is version 1
    x = acts(seed=31, rank=4)
    msg, y = link.forward(x, "lowrank:4", step=0)
    assert msg.basis and msg.basis_version == 1
    torch.testing.assert_close(y, x, rtol=0, atol=1e-5)  # decoded in the new basis, not the old


class Stage(nn.Module):
    def __init__(self, d_in, d_out, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d_in, 32), nn.Tanh(), nn.Linear(32, d_out))

    def forward(self, x):
        return self.net(x)


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, link, step, mb, fb):
        ctx.link, ctx.mb, ctx.fb = link, mb, fb
        return link.forward(x, "lowrank8:6@3", step)[1]

    @staticmethod
    def backward(ctx, g):
        return ctx.link.backward(g.contiguous(), "lowrank8:6@3", ctx.fb,
                                 key=(1, ctx.mb))[1], None, None, None, None


def train(steps, resume=None):
    """Two stages joined by a lowrank8 link (activations, and gradients with error feedback),
    SGD with momentum; from ``resume``'s snapshots if given. Returns the stages' snapshots."""
    torch.manual_seed(0)
    data = [(torch.randn(2, 8, 16), torch.randn(2, 8, 4)) for _ in range(steps)]
    first, second, link, fb = Stage(16, 32, 1), Stage(32, 4, 2), Link(), ErrorFeedback()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (first, second)]
    parts = [{"module": first, "optimizer": opts[0], "codec": link.sender},
             {"module": second, "optimizer": opts[1], "codec": link.receiver, "feedback": fb}]
    start = 0
    if resume is not None:
        for p, snap in zip(parts, resume):
            checkpoint.restore(p, snap)
        start = resume[0].step
    for step in range(start, steps):
        for opt in opts:
            opt.zero_grad()
        for mb, (x, y) in enumerate(zip(*data[step])):
            out = second(_Boundary.apply(first(x), link, step, mb, fb))
            nn.functional.mse_loss(out, y).backward()
        for opt in opts:
            opt.step()
    return [checkpoint.take(p, steps) for p in parts]


def test_a_recovered_job_equals_an_uninterrupted_one():
    whole = train(10)
    recovered = train(10, resume=train(4))
    for a, b in zip(whole, recovered):
        assert a.tensors.keys() == b.tensors.keys()
        for name in a.tensors:
            torch.testing.assert_close(a.tensors[name], b.tensors[name], rtol=0, atol=1e-5,
                                       msg=name)
    assert any(k.startswith("codec/bases") for k in whole[0].tensors)
    assert any(k.startswith("feedback/residuals") for k in whole[1].tensors)


def test_a_basis_received_while_a_stage_restores_is_kept_over_its_snapshots():
    # a node's stage takes tensors while it restores: its restored peer's basis, carried in
    # then, is what the peer uses now (a refresh at the resume step), not the snapshot's
    link = Link()
    link.forward(acts(seed=40), "lowrank:4@2", step=0)
    saved = link.receiver.state_dict()
    link.forward(acts(seed=41), "lowrank:4@2", step=2)  # version 2 arrives
    link.receiver.load_state_dict(saved)  # the snapshot's version 1 loads after it
    assert link.receiver.basis(KEY).version == 2
    link.receiver.load_state_dict(saved)  # a later restore takes the snapshot again
    assert link.receiver.basis(KEY).version == 1


def test_both_receive_paths_decode_with_the_end_admission_gives():
    """gRPC's frame reader (whole and chunked tensors) and the socket link's reader."""
    from fedpipe.net.dataplane.connection import read_tensor
    from fedpipe.wire import frames

    sender, x = Subspace(), acts(shape=(64, 32), seed=50)
    msg = encode(x, "lowrank8:4", end=End(sender, KEY, 0))
    for chunk in (frames.CHUNK_BYTES, 100):  # one frame (decoded in place), several
        receiver = Subspace()
        admit = lambda head, r=receiver: frames.Admitted(1 << 20, End(r, KEY))  # noqa: E731
        stream = frames.to_frames(msg, chunk_bytes=chunk)
        (_, y), = frames.read_tensors(stream, admit, in_place=True)
        assert receiver.basis(KEY).version == 1
        torch.testing.assert_close(y, decode(msg, end=End(Subspace(), KEY)), rtol=0, atol=0)
    with pytest.raises(WireError, match="needs the receiving stage's basis"):
        list(frames.read_tensors(frames.to_frames(msg), lambda head: 1 << 20))

    class Conn:  # the part of a socket Connection read_tensor uses
        def read_into(self, view):
            view[:] = msg.payload

    receiver = Subspace()
    head = frames.format.unpack(next(frames.to_frames(msg)))[0]
    y = read_tensor(Conn(), head, 1 << 20, End(receiver, KEY))
    assert receiver.basis(KEY).version == 1 and y.shape == x.shape


def test_a_resplit_drops_the_bases_and_a_whole_snapshot_keeps_them():
    from fedpipe.runtime import layerstate

    link = Link()
    link.forward(acts(seed=60), "lowrank:4", step=0)
    mod = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    snap = checkpoint.take({"layers": layerstate.Layout(mod, 0), "module": mod,
                            "codec": link.sender}, 3)
    whole, pieces = Subspace(), Subspace()
    layerstate.restore({"layers": layerstate.Layout(mod, 0), "module": mod, "codec": whole},
                       snap)
    assert whole.basis(KEY) is not None
    torch.testing.assert_close(whole.basis(KEY).matrix, link.sender.basis(KEY).matrix)
    layered = layerstate.merge([layerstate.split(snap, 0, 1), layerstate.split(snap, 1, 2)])
    layerstate.restore({"layers": layerstate.Layout(mod, 0), "module": mod, "codec": pieces},
                       layered)
    assert len(pieces) == 0  # the boundaries moved: the next activations make new bases


# --- hostile messages and callers -------------------------------------------------

def _message(**fields):
    link = Link()
    msg, _ = link.forward(acts(seed=20), "lowrank:4", step=0)
    for name, value in fields.items():
        if name == "shape":
            msg.ClearField("shape")
            msg.shape.extend(value)
        else:
            setattr(msg, name, value)
    return msg


@pytest.mark.parametrize("fields,error", [
    ({"k": 0}, r"rank must be in \[1, min\(4096, the last dimension\)\], got 0"),
    ({"k": 33}, r"got 33 for shape \[4, 16, 32\]"),
    ({"basis_version": 0}, "basis_version must be at least 1"),
    ({"basis": False},
     r"encoded_bytes is 1536 but codec lowrank and shape \[4, 16, 32\] need 1024"),
    ({"shape": [4, 16, 16]}, "encoded_bytes is"),
    ({"block_size": 64}, "field block_size=64 is set but codec lowrank does not use it"),
])
def test_bad_headers_are_wire_errors(fields, error):
    with pytest.raises(WireError, match=error):
        decode(_message(**fields), end=End(Subspace(), KEY))


def test_a_basis_the_receiver_lacks_is_a_clear_error():
    sender, receiver = Subspace(), Subspace()
    first = wire(encode(acts(), "lowrank:4", end=End(sender, KEY, 0)))
    second = wire(encode(acts(seed=1), "lowrank:4", end=End(sender, KEY, 1)))
    with pytest.raises(WireError, match=r"uses basis version 1, but this end holds no basis"):
        decode(second, end=End(receiver, KEY))
    decode(first, end=End(receiver, KEY))
    decode(second, end=End(receiver, KEY))
    stale = wire(encode(acts(seed=2), "lowrank:4@1", end=End(sender, KEY, 2)))
    stale.basis, stale.encoded_bytes = False, stale.encoded_bytes - 4 * 32 * 4
    stale.payload = stale.payload[4 * 32 * 4:]
    stale.payload_bytes = len(stale.payload)
    with pytest.raises(WireError, match="uses basis version 2, this end holds version 1"):
        decode(stale, end=End(receiver, KEY))
    narrow = wire(encode(acts(shape=(4, 16, 8)), "lowrank:4", end=End(Subspace(), KEY, 0)))
    narrow.basis, narrow.encoded_bytes = False, narrow.encoded_bytes - 4 * 8 * 4
    narrow.payload = narrow.payload[4 * 8 * 4:]
    narrow.payload_bytes = len(narrow.payload)
    with pytest.raises(WireError, match=r"needs a \(8, 4\) basis, this end holds \(32, 4\)"):
        decode(narrow, end=End(receiver, KEY))
    with pytest.raises(WireError, match="needs the receiving stage's basis"):
        decode(first)
    with pytest.raises(ValueError, match="keeps a basis per link"):
        encode(acts(), "lowrank:4")
    with pytest.raises(WireError, match="has no basis yet"):
        encode(acts(), "lowrank:4", end=End(Subspace(), KEY))  # a gradient before activations
    with pytest.raises(WireError, match="non-finite"):
        encode(acts() * float("nan"), "lowrank:4", end=End(Subspace(), KEY, 0))


def test_specs_parse_print_and_jobs_take_them_with_lowrank_activations_in_sync():
    assert parse_codec("lowrank8:8@50") == CodecSpec("lowrank8", rank=8, refresh=50)
    assert str(parse_codec("lowrank8:8@50")) == "lowrank8:8@50"
    assert str(parse_codec("lowrank:4")) == "lowrank:4"
    assert parse_codec("lowrank") == CodecSpec("lowrank", rank=16, refresh=100)
    for bad in ("lowrank:0", "lowrank:8@0", "lowrank:8@x", "int8:64@3"):
        with pytest.raises(SpecError):
            parse_codec(bad)
    assert check_compression("lowrank8:8", "activations") == "lowrank8:8"
    with pytest.raises(SpecError, match="not DiLoCo's outer sync"):
        check_compression("lowrank8:8", "outer")
    assert lowrank_problem("lowrank8:8@5", "lowrank8:8", "1f1b") is None
    assert lowrank_problem("lowrank:8", "int8", "gpipe") is None
    assert lowrank_problem("int8", "none", "async") is None
    for act, grad, schedule, error in [
            ("lowrank8:8", "lowrank8:8", "async", "needs a synchronous schedule"),
            ("int8", "lowrank8:8", "gpipe", "need a lowrank codec of rank 8 too, not 'int8'"),
            ("auto", "lowrank:4", "gpipe", "rank 4 too, not 'auto'"),
            ("lowrank:8", "lowrank:4", "gpipe", "rank 4 too, not 'lowrank:8'")]:
        assert error in lowrank_problem(act, grad, schedule)
        with pytest.raises(JobSpecError, match="activation_compression"):
            JobSpec(steps=1, optimizer=b"o", loss_fn=b"l", schedule=schedule,
                    activation_compression=act, gradient_compression=grad).validate()


FIELDS = {"k": st.integers(0, 2**64 - 1), "basis": st.booleans(),
          "basis_version": st.integers(0, 2**64 - 1), "encoded_bytes": st.integers(0, 10**6),
          "codec": st.sampled_from([pb.CODEC_LOWRANK, pb.CODEC_LOWRANK8, pb.CODEC_INT8]),
          "shape": st.lists(st.integers(-2, 2**20), max_size=3)}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_fuzzed_messages_decode_or_raise_wire_error(data):
    """Random header fields and payload bytes, to a receiver that holds a basis or none:
    decode returns a tensor of the declared shape or raises WireError, nothing else."""
    sender, receiver = Subspace(), Subspace()
    decode(wire(encode(acts(), "lowrank8:4", end=End(sender, KEY, 0))),
           end=End(receiver, KEY))
    fresh = data.draw(st.booleans())  # a fresh sender carries its basis, the other does not
    msg = wire(encode(acts(seed=1), "lowrank:4", end=End(Subspace() if fresh else sender, KEY, 1)))
    for name in data.draw(st.lists(st.sampled_from([*FIELDS, "payload"]), max_size=3,
                                   unique=True)):
        if name == "payload":
            cut = data.draw(st.integers(0, len(msg.payload)))
            msg.payload = msg.payload[:cut]
            msg.payload_bytes = cut
        elif name == "shape":
            del msg.shape[:]
            msg.shape.extend(data.draw(FIELDS["shape"]))
        else:
            setattr(msg, name, data.draw(FIELDS[name]))
    holder = receiver if data.draw(st.booleans()) else Subspace()
    try:
        out = decode(wire(msg), end=End(holder, KEY))
    except WireError:
        return
    assert out.shape == tuple(msg.shape)
