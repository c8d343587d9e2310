"""FetchState and FetchSnapshot over the socket data plane (FRAMES.md, "Fetches").

A node's :class:`~fedpipe.node.dataplane.NodeReceiver` serves a peer's fetch with
the checks gRPC's handlers make (the method's policy row, the job's assignment,
the stage or snapshot held here), refusing with the same status codes; the asking
side checks each tensor of the answer on its header before its payload is read.
Real links over loopback, a real snapshot desk and store.
"""
from __future__ import annotations

import time

import pytest
import torch

from fedpipe.net.dataplane import Code, DataPlane, LinkFailed, Peer, PeerRefused, Refused
from fedpipe.net.dataplane import connection, records
from fedpipe.net.dataplane.fetch import MAX_SERVED
from fedpipe.net.dataplane.records import Method, RecordType
from fedpipe.node.access import JobAccessBook
from fedpipe.node.dataplane import NodeReceiver
from fedpipe.node.errors import NoSuchSnapshot, NoSuchStage, status_of
from fedpipe.node.snapshots import SnapshotDesk, SnapshotStore
from fedpipe.proto import node_pb2
from fedpipe.runtime import checkpoint
from fedpipe.security import Identity, Role
from fedpipe.runtime.checkpoint import SnapshotTooLarge
from fedpipe.spec import StageKey
from test_dataplane import raw_dial

pytestmark = pytest.mark.timeout(30)

MODEL = torch.nn.Linear(4, 3)


class Stage:
    """A held stage's weights, as :meth:`fedpipe.node.lifecycle.Stage.weights` names them."""

    def weights(self):
        for name, t in MODEL.state_dict().items():
            yield f"0.{name}", t


class Stages:
    def get(self, slot):
        if (slot.job_id, slot.replica, slot.stage) != ("j", 0, 1):
            raise NoSuchStage(f"no stage {slot.stage} of job {slot.job_id!r} here")
        return Stage()


class Nothing:
    """A receiver for the asking side: it is sent nothing but answers."""

    def admit(self, peer, header):
        raise AssertionError("no tensor but an answer is sent here")

    def deliver(self, peer, header, tensor):
        raise AssertionError("no tensor but an answer is sent here")


def serving_node(job_bytes: int = 1 << 30) -> tuple[NodeReceiver, SnapshotStore]:
    """node1's receiver: job ``j`` assigns node0 and node1, holds stage (0, 1) and keeps its
    step 3 snapshot."""
    access = JobAccessBook()
    access.learn("j", "alice", ["node0", "node1"], [StageKey(0, 1)])
    store = SnapshotStore()
    store.put("j", StageKey(0, 1), checkpoint.take({"module": MODEL}, 3))
    desk = SnapshotDesk(store, lambda job: job == "j", job_bytes)
    return NodeReceiver(access, None, Stages(), desk=desk), store  # type: ignore[arg-type]


def snapshot_request(step: int = 3, job: str = "j", stage: int = 1) -> bytes:
    return node_pb2.FetchSnapshotRequest(job_id=job, replica=0, stage=stage,
                                         step=step).SerializeToString()


def fetch_snapshot(link, request: bytes, max_bytes: int = 1 << 20) -> checkpoint.Snapshot:
    assembler = checkpoint.Assembler(max_bytes)
    link.fetch(Method.FETCH_SNAPSHOT, request, assembler.admit, assembler.add, 10)
    return assembler.finish()[1]


def grpc_code(error: Exception) -> Code:
    """The code gRPC's handler answers ``error`` with (the node's error table)."""
    return Code(status_of(error).value[0])


def test_a_snapshot_is_fetched_over_a_socket_link_bit_for_bit():
    r, store = serving_node()
    with DataPlane("node0", Nothing()) as a, DataPlane("node1", r, server=r) as b:
        link = a.link("node1", b.address)
        snap = fetch_snapshot(link, snapshot_request())
        again = fetch_snapshot(link, snapshot_request())  # the link goes on
    kept = store.get("j", StageKey(0, 1), 3)
    assert kept is not None and snap.step == 3 and snap.skeleton == kept.skeleton
    assert set(snap.tensors) == set(kept.tensors) == set(again.tensors)
    assert all(torch.equal(snap.tensors[k], t) for k, t in kept.tensors.items())
    assert r.fetches_served == 2 and link.fetches.answered == 2


def test_a_stages_state_is_fetched_over_a_socket_link_as_copies():
    r, _ = serving_node()
    got: dict[str, torch.Tensor] = {}
    with DataPlane("node0", Nothing()) as a, DataPlane("node1", r, server=r) as b:
        n = a.link("node1", b.address).fetch(
            Method.FETCH_STATE,
            node_pb2.FetchStateRequest(job_id="j", replica=0, stage=1).SerializeToString(),
            lambda head: 1 << 20, lambda head, t: got.__setitem__(head.name, t), 10)
    assert n == 2 and set(got) == {"0.weight", "0.bias"}
    assert torch.equal(got["0.weight"], MODEL.weight.detach())


@pytest.mark.parametrize("request_, code", [
    (snapshot_request(step=4), grpc_code(NoSuchSnapshot(""))),  # no such step kept
    (snapshot_request(stage=2), grpc_code(NoSuchSnapshot(""))),  # no such stage kept
    (b"\xff\xff\xff", Code.INVALID_ARGUMENT),                    # not a request
])
def test_a_snapshot_fetch_is_refused_as_on_grpc_and_the_link_goes_on(request_, code):
    r, _ = serving_node()
    with DataPlane("node0", Nothing()) as a, DataPlane("node1", r, server=r) as b:
        link = a.link("node1", b.address)
        with pytest.raises(PeerRefused) as e:
            fetch_snapshot(link, request_)
        assert e.value.code == code
        assert fetch_snapshot(link, snapshot_request()).step == 3  # the same link serves on


def identity(role: Role, name: str) -> Peer:
    return Peer(name, role.value, Identity(role, name, 1))


@pytest.mark.parametrize("who, method, request_, code", [
    # a node the job's plans do not name, a client not the job's owner
    (identity(Role.NODE, "mallory"), Method.FETCH_SNAPSHOT, snapshot_request(),
     Code.PERMISSION_DENIED),
    (identity(Role.CLIENT, "bob"), Method.FETCH_STATE, node_pb2.FetchStateRequest(
        job_id="j", replica=0, stage=1).SerializeToString(), Code.PERMISSION_DENIED),
    # a job this node does not know
    (identity(Role.NODE, "node0"), Method.FETCH_SNAPSHOT, snapshot_request(job="k"),
     Code.PERMISSION_DENIED),
    # a role the policy's rows for FetchSnapshot do not admit
    (identity(Role.TRACKER, "tracker"), Method.FETCH_SNAPSHOT, snapshot_request(),
     Code.PERMISSION_DENIED),
])
def test_who_may_fetch_is_checked_by_certificate_as_on_grpc(who, method, request_, code):
    r, _ = serving_node()
    with pytest.raises(Refused) as e:
        r.serve(who, method, request_)
    assert e.value.code == code
    # the job's owner and its nodes may
    assert next(iter(r.serve(identity(Role.NODE, "node0"), method,
                             snapshot_request() if method is Method.FETCH_SNAPSHOT
                             else request_)))[0]
    if method is Method.FETCH_STATE:
        assert list(r.serve(identity(Role.CLIENT, "alice"), method, request_))


def test_a_state_fetch_of_a_stage_not_held_is_not_found_as_on_grpc():
    r, _ = serving_node()
    with DataPlane("node0", Nothing()) as a, DataPlane("node1", r, server=r) as b:
        with pytest.raises(PeerRefused) as e:
            a.link("node1", b.address).fetch(
                Method.FETCH_STATE,
                node_pb2.FetchStateRequest(job_id="j", replica=0, stage=0).SerializeToString(),
                lambda head: 1 << 20, lambda head, t: None, 10)
    assert e.value.code == grpc_code(NoSuchStage("")) == Code.NOT_FOUND
    assert "no stage 0" in str(e.value)


def test_an_answer_past_the_fetchs_limit_is_refused_on_its_header_and_the_link_goes_on():
    r, _ = serving_node()
    with DataPlane("node0", Nothing()) as a, DataPlane("node1", r, server=r) as b:
        link = a.link("node1", b.address)
        with pytest.raises(SnapshotTooLarge, match="past its limit of 16 bytes"):
            fetch_snapshot(link, snapshot_request(), max_bytes=16)  # the weight is 48 bytes
        assert fetch_snapshot(link, snapshot_request()).step == 3
        assert link.credits.failed is None


def test_a_node_without_a_fetch_server_answers_unimplemented():
    r, _ = serving_node()
    with DataPlane("node0", Nothing()) as a, DataPlane("node1", r) as b:  # no server=
        with pytest.raises(PeerRefused) as e:
            fetch_snapshot(a.link("node1", b.address), snapshot_request())
    assert e.value.code == Code.UNIMPLEMENTED


def _read_text(conn) -> tuple[RecordType, int, Code, str]:
    kind, arg = records.unpack(conn.read_exact(records.PREFIX_BYTES))
    code, size = records.TEXT.unpack(conn.read_exact(records.TEXT.size))
    return kind, arg, Code(code), conn.read_exact(size).decode()


def test_a_fetch_request_longer_than_its_limit_ends_the_link_before_it_is_read():
    r, _ = serving_node()
    with DataPlane("node1", r, server=r) as b:
        conn = raw_dial(b.port, "node0")
        conn.write(records.pack(RecordType.FETCH, 1)
                   + records.FETCH_BODY.pack(Method.FETCH_SNAPSHOT, 1 << 30))  # 1 GiB, announced
        kind, _, code, text = _read_text(conn)
        assert (kind, code) == (RecordType.GOAWAY, Code.INVALID_ARGUMENT)
        assert f"exceeds {records.MAX_REQUEST_BYTES}" in text
        conn.close()
    assert r.fetches_served == 0


def test_unknown_methods_and_fetches_past_the_cap_are_refused_by_a_fetched_record():
    r, _ = serving_node()
    with DataPlane("node1", r, server=r) as b:
        conn = raw_dial(b.port, "node0")
        conn.write(records.pack(RecordType.FETCH, 7) + records.FETCH_BODY.pack(99, 0))
        assert _read_text(conn)[:3] == (RecordType.FETCHED, 7, Code.UNIMPLEMENTED)
        link = b.links()[0]
        for _ in range(MAX_SERVED):  # as if that many were being served
            assert link.fetches.start_serving()
        conn.write(records.pack_fetch(8, Method.FETCH_SNAPSHOT, snapshot_request()))
        kind, arg, code, text = _read_text(conn)
        assert (kind, arg, code) == (RecordType.FETCHED, 8, Code.RESOURCE_EXHAUSTED)
        assert f"at most {MAX_SERVED} fetches" in text
        conn.close()


def test_a_fetch_fails_when_its_connection_breaks_and_a_late_answer_is_dropped():
    r, _ = serving_node()
    with DataPlane("node0", Nothing()) as a, DataPlane("node1", r, server=r) as b:
        link = a.link("node1", b.address)
        pending = link.fetches.open(lambda head: 1 << 20, lambda head, t: None)
        assert link.conn is not None
        link.conn.close()  # the dialer redials; the fetch is lost with the connection
        with pytest.raises(LinkFailed, match="connection broke"):
            pending.wait(5)
        link.fetches.close(pending)
        assert link.wait_up(5)
        assert fetch_snapshot(link, snapshot_request()).step == 3


def test_the_peer_in_a_fetch_is_the_links(monkeypatch):
    seen: list[Peer] = []
    r, _ = serving_node()
    serve = r.serve

    def spy(peer, method, request):
        seen.append(peer)
        return serve(peer, method, request)
    monkeypatch.setattr(r, "serve", spy)
    with DataPlane("node0", Nothing()) as a, DataPlane("node1", r, server=r) as b:
        fetch_snapshot(a.link("node1", b.address), snapshot_request())
    assert [p.name for p in seen] == ["node0"]


def test_a_clients_state_dict_comes_over_its_socket_plane_and_a_gone_stage_is_named():
    from fedpipe.client import CheckpointGone, checkpoints, links
    from fedpipe.proto import tracker_pb2
    r, _ = serving_node()
    plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=1, node_name="node1", address="127.0.0.1:1")])  # no gRPC there

    def no_grpc(address):
        raise AssertionError(f"FetchState went to {address} over gRPC")
    with links.client_plane(None) as client, DataPlane("node1", r, server=r) as b:
        plan.stages[0].data_address = b.address
        got = checkpoints.stage_weights(no_grpc, "j", plan, plane=client)
        assert set(got) == {"0.weight", "0.bias"}
        assert torch.equal(got["0.bias"], MODEL.bias.detach())
        plan.stages[0].stage = 0  # a stage node1 does not hold (released): NOT_FOUND
        with pytest.raises(CheckpointGone) as e:
            checkpoints.stage_weights(no_grpc, "j", plan, plane=client,
                                      state=tracker_pb2.JOB_STATE_SUCCEEDED)
    # the same words as over gRPC (tests/test_job_errors.py), not the link's refusal
    assert str(e.value).startswith("job j: the trained weights of stage 0 (replica group 0) "
                                   "are gone: its nodes no longer hold them (released, or "
                                   "they restarted); "), str(e.value)
    assert "refused it" not in str(e.value)


def test_an_accepted_connection_silent_after_its_preface_is_closed_and_gives_its_slot_back():
    from fedpipe.net.dataplane import Timeouts
    quick = Timeouts(silent=0.5, resume=0.5)
    with DataPlane("node1", Nothing(), timeouts=quick) as b:
        silent, talking = raw_dial(b.port, "mallory"), raw_dial(b.port, "node0")
        talking.write(records.pack(RecordType.SYNC, 0))  # a record: the deadline is lifted
        assert records.unpack(talking.read_exact(records.PREFIX_BYTES))[0] is RecordType.ACK
        assert b.caps.held() == 2
        silent.sock.settimeout(10)
        with pytest.raises(connection.Closed):  # closed by the listener, without a word
            silent.read_exact(1)
        talking.write(records.pack(RecordType.SYNC, 0))  # past the deadline: still served
        assert records.unpack(talking.read_exact(records.PREFIX_BYTES))[0] is RecordType.ACK
        deadline = time.monotonic() + 5
        while b.caps.held() != 1 and time.monotonic() < deadline:  # its thread lets go
            time.sleep(0.01)
        assert b.caps.held() == 1
        silent.close()
        talking.close()


class NoGrpc:
    """A client's node stubs and socket plane (:class:`fedpipe.client.feed.NodeStubs`) where
    any gRPC call is a failure: the socket path must be taken."""

    def __init__(self, plane):
        self.plane = plane

    def node(self, address):
        raise AssertionError(f"a call went to {address} over gRPC")

    def data_plane(self):
        return self.plane


def node1_plan(data_address: str, stage: int = 1) -> node_pb2.Plan:
    return node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=stage, node_name="node1", address="127.0.0.1:1",  # no gRPC there
        data_address=data_address)])


def snapshot_envelope(step: int, job: str = "j", stage: int = 1) -> node_pb2.Envelope:
    return node_pb2.Envelope(job_id=job, replica=0, stage=stage, kind=node_pb2.KIND_SNAPSHOT,
                             step=step, batch_size=1)


def test_a_clients_save_pulls_each_snapshot_over_its_socket_plane_bit_for_bit():
    from fedpipe.client import checkpoints, links
    r, store = serving_node()
    kept = store.get("j", StageKey(0, 1), 3)
    assert kept is not None
    with links.client_plane(None) as client, DataPlane("node1", r, server=r) as b:
        stubs = NoGrpc(client)
        [(key, snap)] = list(checkpoints.pull(stubs.node, "j", node1_plan(b.address), 3, 0,
                                              client))
        got = dict(snap.tensors)  # read as it comes, then checked complete
        assert key == StageKey(0, 1) and snap.step == 3 and snap.skeleton == kept.skeleton
        assert got.keys() == kept.tensors.keys()
        assert all(torch.equal(got[k], t) for k, t in kept.tensors.items())
        # a step no node keeps: NOT_FOUND over the socket plane, as on gRPC
        with pytest.raises(checkpoints.CheckpointGone, match="checkpoint of step 4 is gone"):
            list(checkpoints.pull(stubs.node, "j", node1_plan(b.address), 4, 0, client))
        # a reader that stops after the skeleton's first tensor: the fetch ends, the
        # link goes on
        [(_, cut)] = list(checkpoints.pull(stubs.node, "j", node1_plan(b.address), 3, 0,
                                           client))
        next(cut.tensors)
        cut.tensors.close()  # type: ignore[attr-defined]
        [(_, again)] = list(checkpoints.pull(stubs.node, "j", node1_plan(b.address), 3, 0,
                                             client))
        assert dict(again.tensors).keys() == kept.tensors.keys()
    assert r.fetches_served == 4


def test_a_snapshot_answer_past_the_saves_limit_is_grpcs_invalid_argument():
    import grpc

    from fedpipe.client import links
    r, _ = serving_node()
    with links.client_plane(None) as client, DataPlane("node1", r, server=r) as b:
        a = node1_plan(b.address).stages[0]
        request = node_pb2.FetchSnapshotRequest.FromString(snapshot_request())
        stream = links.fetch_snapshot(client, a, request, max_bytes=16)  # skeleton fits
        with pytest.raises(grpc.RpcError) as e:
            list(stream.tensors)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "past its limit of 16 bytes" in e.value.details()


def test_a_client_puts_a_snapshot_over_its_socket_plane_and_a_refusal_is_grpcs_error():
    import grpc

    from fedpipe.client import feed, links
    r, store = serving_node()
    torch.manual_seed(1)
    snap = checkpoint.take({"module": torch.nn.Linear(4, 3)}, 5)
    with links.client_plane(None) as client, DataPlane("node1", r, server=r) as b:
        nodes = feed.ChannelNodes(NoGrpc(client))
        a = node1_plan(b.address).stages[0]
        nodes.put_snapshot(a, snapshot_envelope(5), snap)  # returns once it is kept
        kept = store.get("j", StageKey(0, 1), 5)
        assert kept is not None and kept.skeleton == snap.skeleton
        assert kept.tensors.keys() == snap.tensors.keys()
        assert all(torch.equal(kept.tensors[k], t) for k, t in snap.tensors.items())
        # PutSnapshot's checks, with its codes: a stage of no plan of the job, a job this
        # node knows no plan of, a job it runs no stage of (it keeps no snapshot of it);
        # the link goes on
        r.access.learn("h", "alice", ["node0", "node1"], [StageKey(0, 1)])
        for env, code, why in [
                (snapshot_envelope(5, stage=2), grpc.StatusCode.INVALID_ARGUMENT,
                 "job 'j' has no stage 2 of replica group 0"),
                (snapshot_envelope(5, job="k"), grpc.StatusCode.INVALID_ARGUMENT,
                 "job 'k' has no stage 1 of replica group 0"),
                (snapshot_envelope(5, job="h"), grpc.StatusCode.NOT_FOUND,
                 "this node runs no stage of job 'h'")]:
            with pytest.raises(links.LinkError) as e:
                nodes.put_snapshot(a, env, snap)
            assert e.value.code() == code and why in e.value.details(), e.value.details()
            assert "node1 refused it" in e.value.details()
        nodes.put_snapshot(a, snapshot_envelope(7), checkpoint.take({"module": MODEL}, 7))
    assert 7 in store.steps("j", StageKey(0, 1)) and store.steps("h", StageKey(0, 1)) == []
