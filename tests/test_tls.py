"""A swarm over mutual TLS: it trains, and every caller without the right certificate,
identity or signature is refused, over real processes (LocalSwarm(tls=True))."""
from __future__ import annotations

import datetime as dt
import threading
import time

import cloudpickle
import grpc
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe import net
from fedpipe.client import Client
from fedpipe.examples import digits
from fedpipe.net import timeouts
from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2, tracker_pb2_grpc
from fedpipe.security import TlsConfig, certs
from fedpipe.security.signing import sign_job
from fedpipe.security.tls import DENY_RELOAD_SECONDS
from fedpipe.spec import JobSpec
from fedpipe.testing import LocalSwarm
from fedpipe.wire import frames, rpc

pytestmark = [pytest.mark.timeout(600), pytest.mark.processes]
RPC = timeouts.CONTROL_RPC


@pytest.fixture(scope="module")
def swarm():
    with LocalSwarm(2, tls=True, lease=5.0) as s:
        yield s


def _tracker(swarm: LocalSwarm, tls: TlsConfig | None, creds=None):
    ch = (grpc.secure_channel(swarm.tracker, creds) if creds is not None
          else net.channel(swarm.tracker, tls=tls))
    return ch, tracker_pb2_grpc.TrackerStub(ch)


def _node(address: str, tls: TlsConfig):
    ch = net.channel(address, tls=tls)
    return ch, node_pb2_grpc.NodeStub(ch)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _signed_request(tls: TlsConfig) -> tracker_pb2.SubmitJobRequest:
    """A well-formed job signed by ``tls``'s key (the layers are real pickles)."""
    model = _model()
    layers = [cloudpickle.dumps(m) for m in model]
    config = JobSpec(steps=10, microbatches=1, schedule="gpipe",
                     optimizer=cloudpickle.dumps(fedpipe.optimizer(torch.optim.SGD, lr=0.1)),
                     loss_fn=cloudpickle.dumps(nn.functional.mse_loss),
                     batch_size=4).validate(len(layers)).to_proto()
    profile = tracker_pb2.ModelProfile(layers=[tracker_pb2.LayerProfile(name=str(i))
                                               for i in range(len(layers))])
    signed = sign_job(tls, layers, config)
    return tracker_pb2.SubmitJobRequest(
        name="t", layers=layers, config=config, profile=profile, owner=signed.owner,
        job_signature=signed.job_signature, client_cert=signed.client_cert,
        layer_digests=signed.layer_digests)


def test_a_digits_job_trains_to_succeeded_over_mutual_tls(swarm):
    client = swarm.client(sockets=True)
    acc = digits.train(client, steps=40, stages=2, progress=False, out=lambda *a: None)
    assert acc > 0.5  # digits.train raises JobFailed unless the job SUCCEEDED
    # the feed went over mutual-TLS socket links (the nodes took the client's certificate)
    plane = client.data_plane()
    assert plane is not None
    fed = {link.peer_name: link.next_seq for link in plane.links()}
    assert len(fed) == 2 and all(n >= 40 for n in fed.values()), fed


def _expect(code: grpc.StatusCode, call, *words: str):
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, (e.value.code(), e.value.details())
    for w in words:
        assert w in (e.value.details() or ""), e.value.details()


def test_callers_without_a_valid_certificate_are_refused_and_others_still_served(swarm, tmp_path):
    other = tmp_path / "other"
    certs.make_ca(other)
    certs.issue(other, "client", "stranger")
    stranger = TlsConfig.load(other, "stranger")
    swarm_ca = TlsConfig.load(swarm.tls_dir, "client").ca_pem
    old = swarm.issue("client", "old-client", days=1,
                      not_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2))
    cases = {
        "no certificate": grpc.insecure_channel(swarm.tracker),
        "another CA": grpc.secure_channel(swarm.tracker, grpc.ssl_channel_credentials(
            swarm_ca, stranger.key_pem, stranger.cert_pem)),
        "expired": grpc.secure_channel(swarm.tracker, grpc.ssl_channel_credentials(
            swarm_ca, old.key_pem, old.cert_pem)),
    }
    for why, ch in cases.items():
        stub = tracker_pb2_grpc.TrackerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ListNodes(tracker_pb2.ListNodesRequest(), timeout=RPC)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.UNAUTHENTICATED), (why, e.value.code())
        ch.close()
    assert len(swarm.client().nodes()) == 2  # the tracker still serves the swarm


def test_a_node_may_not_speak_for_another_node(swarm):
    rogue = swarm.issue("node", "rogue")
    victim = swarm.client().nodes()[0]
    ch, stub = _tracker(swarm, rogue)
    with ch:
        _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: stub.Heartbeat(
            tracker_pb2.HeartbeatRequest(node_id=victim.node_id, leaving=True), timeout=RPC),
            "may speak only for itself", victim.name)
        _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: stub.RegisterNode(
            tracker_pb2.RegisterNodeRequest(name=victim.name, address="127.0.0.1:1"),
            timeout=RPC), "may speak only for itself")
        _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: stub.ReportStage(
            tracker_pb2.StageReport(job_id="x", node_id=victim.node_id), timeout=RPC),
            "may speak only for itself")
    assert victim.node_id in {n.node_id for n in swarm.client().nodes()}  # still alive


def test_a_client_may_not_watch_cancel_stop_or_fetch_another_clients_job(swarm):
    alice = swarm.client("alice")
    x = torch.randn(64, 4)
    job = alice.submit(_model(), nn.functional.mse_loss,
                       fedpipe.optimizer(torch.optim.SGD, lr=0.01), [(x, torch.randn(64, 2))],
                       steps=100_000, stages=2)
    try:
        info = alice.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=RPC)
        assert info.owner == "alice"
        mallory = swarm.issue("client", "mallory")
        ch, stub = _tracker(swarm, mallory)
        with ch:
            for call in (lambda: stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id),
                                             timeout=RPC),
                         lambda: stub.CancelJob(tracker_pb2.CancelJobRequest(job_id=job.id),
                                                timeout=RPC),
                         lambda: list(stub.WatchJob(tracker_pb2.WatchJobRequest(
                             job_id=job.id), timeout=RPC))):
                _expect(grpc.StatusCode.PERMISSION_DENIED, call, "not the owner", job.id)
        t0 = time.monotonic()
        while not info.plan.stages and time.monotonic() - t0 < 120:
            time.sleep(0.5)
            info = alice.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=RPC)
        assert info.plan.stages, "the job was never planned"
        a = info.plan.stages[0]
        nch, node = _node(a.address, mallory)
        with nch:
            _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: list(node.FetchState(
                node_pb2.FetchStateRequest(job_id=job.id, replica=a.replica,
                                           stage=a.stage), timeout=RPC)), "not the owner")
            _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: node.StopJob(
                node_pb2.StopJobRequest(job_id=job.id, release=True), timeout=RPC),
                "not the owner")
        assert alice.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id),
                                 timeout=RPC).state not in (tracker_pb2.JOB_STATE_CANCELLED,
                                                            tracker_pb2.JOB_STATE_FAILED)
    finally:
        job.cancel("test over")


def test_resuming_another_clients_job_is_refused_at_once_and_starts_no_thread(swarm):
    alice = swarm.client("alice")
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    job = alice.submit(_model(), nn.functional.mse_loss,
                       fedpipe.optimizer(torch.optim.SGD, lr=0.01), [(x, y)],
                       steps=100_000, stages=2)
    try:
        mallory = swarm.client("mallory")
        before = set(threading.enumerate())
        theirs = mallory.job(job.id)
        t0 = time.monotonic()
        _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: theirs.resume([(x, y)]),
                "not the owner", job.id)
        assert time.monotonic() - t0 < RPC  # raised, not retried
        assert [t.name for t in set(threading.enumerate()) - before
                if job.id in t.name] == []  # no watch or feed thread
        assert theirs._feeder is None and theirs not in mallory._feeding
        info = alice.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=RPC)
        assert info.state not in (tracker_pb2.JOB_STATE_CANCELLED, tracker_pb2.JOB_STATE_FAILED)
        assert info.feeder == job._feeder_id  # still alice's job, fed by alice
    finally:
        job.cancel("test over")


def test_tampered_or_unsigned_jobs_are_refused_before_unpickling(swarm):
    client_tls = TlsConfig.load(swarm.tls_dir, "client")
    ch, stub = _tracker(swarm, client_tls)
    with ch:
        req = _signed_request(client_tls)
        req.job_signature = bytes([req.job_signature[0] ^ 1]) + req.job_signature[1:]
        _expect(grpc.StatusCode.PERMISSION_DENIED,
                lambda: stub.SubmitJob(req, timeout=RPC), "signature does not match")
        req = _signed_request(client_tls)
        req.layers[0] = cloudpickle.dumps(nn.Linear(4, 9))
        _expect(grpc.StatusCode.PERMISSION_DENIED,
                lambda: stub.SubmitJob(req, timeout=RPC), "not the one the client signed")
        req = _signed_request(client_tls)
        req.ClearField("job_signature")
        _expect(grpc.StatusCode.UNAUTHENTICATED,
                lambda: stub.SubmitJob(req, timeout=RPC), "not signed")

    # a node: from the tracker's certificate, a tampered job; bytes that are no
    # pickle, so INVALID_ARGUMENT would mean the node tried to unpickle them
    node = swarm.client().nodes()[0]
    tracker_tls = TlsConfig.load(swarm.tls_dir, "tracker")
    signed = _signed_request(client_tls)
    plan = node_pb2.Plan(stages=[node_pb2.StageAssignment(
        replica=0, stage=0, node_id=node.node_id, address=node.address, layer_start=0,
        layer_end=3, node_name=node.name)])
    load = node_pb2.LoadStageRequest(
        job_id="tampered", replica=0, stage=0, layers=[b"\x80not a pickle"] * 3, plan=plan,
        config=signed.config, owner="client", job_signature=signed.job_signature,
        client_cert=signed.client_cert, layer_digests=signed.layer_digests)
    nch, stub_n = _node(node.address, tracker_tls)
    with nch:
        _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: stub_n.LoadStage(load, timeout=RPC),
                "not the one the client signed")
        load.owner = "someone-else"
        _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: stub_n.LoadStage(load, timeout=RPC),
                "owner")
    # a client may not call LoadStage at all
    cch, stub_c = _node(node.address, client_tls)
    with cch:
        _expect(grpc.StatusCode.PERMISSION_DENIED, lambda: stub_c.LoadStage(
            node_pb2.LoadStageRequest(job_id="x"), timeout=RPC), "wrong role")


def test_forty_jobs_at_once_from_one_client_are_queued_or_refused_with_a_reason(swarm):
    flood = swarm.issue("client", "flood")
    ch, stub = _tracker(swarm, flood)
    req = _signed_request(flood)
    results: list = []
    lock = threading.Lock()

    def submit():
        try:
            out = stub.SubmitJob(req, timeout=60).job_id
        except grpc.RpcError as e:
            out = e
        with lock:
            results.append(out)

    with ch:
        threads = [threading.Thread(target=submit) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        accepted = [r for r in results if isinstance(r, str)]
        refused = [r for r in results if not isinstance(r, str)]
        assert len(results) == 40
        assert 1 <= len(accepted) <= 8
        for e in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            assert "the most one client may have at once (8)" in e.details()
        # the tracker keeps serving, and its nodes stay alive
        assert len(swarm.client().nodes()) == 2
        for job_id in accepted:
            stub.CancelJob(tracker_pb2.CancelJobRequest(job_id=job_id), timeout=RPC)


def test_a_client_refuses_to_start_with_a_certificate_of_the_wrong_ca(tmp_path):
    certs.make_ca(tmp_path / "a")
    certs.make_ca(tmp_path / "b")
    certs.issue(tmp_path / "b", "client", "c")
    (tmp_path / "b" / "ca.crt").unlink()
    (tmp_path / "b" / "ca.crt").write_bytes((tmp_path / "a" / "ca.crt").read_bytes())
    with pytest.raises(certs.CertError, match="another CA"):
        Client("127.0.0.1:1", tls=tmp_path / "b")


def _wait_running(client: Client, job_id: str) -> tracker_pb2.JobInfo:
    """The job's info once it runs (its stages are loaded on their nodes)."""
    t0 = time.monotonic()
    info = client.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job_id), timeout=RPC)
    while info.state != tracker_pb2.JOB_STATE_RUNNING and time.monotonic() - t0 < 120:
        time.sleep(0.5)
        info = client.stub.GetJob(tracker_pb2.GetJobRequest(job_id=job_id), timeout=RPC)
    assert info.state == tracker_pb2.JOB_STATE_RUNNING, info.reason
    return info


def test_only_nodes_assigned_to_a_job_move_its_snapshots_and_state(swarm):
    owner = swarm.client("snap-owner")
    x = torch.randn(64, 4)
    job = owner.submit(_model(), nn.functional.mse_loss,
                       fedpipe.optimizer(torch.optim.SGD, lr=0.01), [(x, torch.randn(64, 2))],
                       steps=100_000, stages=2)
    try:
        info = _wait_running(owner, job.id)
        a, b = info.plan.stages[0], info.plan.stages[-1]
        assert a.node_name != b.node_name
        snap_req = node_pb2.FetchSnapshotRequest(job_id=job.id, replica=a.replica, stage=a.stage,
                                                 step=999_999)
        state_req = node_pb2.FetchStateRequest(job_id=job.id, replica=a.replica, stage=a.stage)
        env = node_pb2.Envelope(job_id=job.id, replica=a.replica, stage=a.stage,
                                kind=node_pb2.KIND_SNAPSHOT, step=1, batch_size=1)
        put = list(frames.encode_frames(torch.zeros(4), envelope=env))

        rogue = swarm.issue("node", "unassigned")
        ch = net.channel(a.address, tls=rogue)
        with ch:
            stub = rpc.NodeStub(ch)
            for call in (lambda: list(stub.FetchSnapshot(snap_req, timeout=RPC)),
                         lambda: stub.PutSnapshot(iter(put), timeout=RPC),
                         lambda: list(stub.FetchState(state_req, timeout=RPC))):
                _expect(grpc.StatusCode.PERMISSION_DENIED, call,
                        f"node 'unassigned' is not assigned to job {job.id}")
        # the job's other node passes the check: there is simply no snapshot of that step
        ch = net.channel(a.address, tls=TlsConfig.load(swarm.tls_dir, b.node_name))
        with ch:
            stub = rpc.NodeStub(ch)
            _expect(grpc.StatusCode.NOT_FOUND, lambda: list(stub.FetchSnapshot(snap_req,
                                                                               timeout=RPC)),
                    "no step 999999 snapshot")
            assert list(stub.FetchState(state_req, timeout=RPC))
        # and the job's own client fetches its state
        assert list(owner.node(a.address).FetchState(state_req, timeout=RPC))
    finally:
        job.cancel("test over")


def test_a_certificate_revoked_at_the_tracker_is_refused_by_every_node_within_two_heartbeats():
    with LocalSwarm(2, tls=True, lease=4.0) as s:
        by_name = {n.name: n for n in s.client().nodes()}
        n0, n1 = by_name["node0"], by_name["node1"]
        gone = TlsConfig.load(s.tls_dir, "node1")
        own = TlsConfig.load(s.tls_dir, "node0")
        tracker_tls = TlsConfig.load(s.tls_dir, "tracker")
        ping = node_pb2.PingRequest()
        nch, node0 = _node(n0.address, gone)
        tch, tracker = _tracker(s, own)
        with nch, tch:
            node0.Ping(ping, timeout=RPC)  # served before the revocation
            certs.revoke(s.tls_dir, "node1")
            # the tracker re-reads its deny list within DENY_RELOAD_SECONDS and serves it
            # in every heartbeat reply
            deadline = time.monotonic() + DENY_RELOAD_SECONDS + 5
            while True:
                reply = tracker.Heartbeat(tracker_pb2.HeartbeatRequest(node_id=n0.node_id),
                                          timeout=RPC)
                if reply.revoked or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            revoked_at = time.monotonic()
            assert [(r.name, int(r.serial)) for r in reply.revoked] == [
                ("node1", gone.identity.serial)]
            # node0 learns it from its next heartbeat: node1's calls to it are refused
            bound = 2 * reply.heartbeat_seconds + 1.0
            while True:
                try:
                    node0.Ping(ping, timeout=RPC)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
                    assert e.details() == (f"certificate of node 'node1' (serial "
                                           f"{gone.identity.serial}) is revoked")
                    break
                assert time.monotonic() - revoked_at < bound, "node0 still serves node1"
                time.sleep(0.1)
            _expect(grpc.StatusCode.UNAUTHENTICATED,
                    lambda: rpc.send(rpc.NodeStub(nch), [b""], timeout=RPC), "revoked")
            # the tracker refuses it too, and both still serve everyone else
            _expect(grpc.StatusCode.UNAUTHENTICATED, lambda: _tracker(s, gone)[1].Heartbeat(
                tracker_pb2.HeartbeatRequest(node_id=n1.node_id), timeout=RPC), "revoked")
        with net.channel(n0.address, tls=tracker_tls) as ch:
            node_pb2_grpc.NodeStub(ch).Ping(ping, timeout=RPC)
        assert "node0" in {n.name for n in s.client().nodes()}


@pytest.fixture
def no_tls_env(monkeypatch):
    monkeypatch.delenv("FEDPIPE_TLS_DIR", raising=False)


def _one_line_failure(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert "\n" not in str(e.value) and "\n" not in e.value.details(), str(e.value)
    assert "Socket closed" not in e.value.details()
    return e.value


def test_a_client_with_no_certificate_is_told_so_in_one_line(swarm, no_tls_env):
    with Client(swarm.tracker) as client:
        err = _one_line_failure(client.nodes)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == (f"{swarm.tracker} requires mutual TLS and this caller has no "
                             "certificate: give --tls-dir, tls= or set FEDPIPE_TLS_DIR")


def test_a_client_of_another_ca_is_told_so_in_one_line(swarm, tmp_path):
    other = tmp_path / "elsewhere"
    certs.make_ca(other)
    certs.issue(other, "client", "stranger")
    with Client(swarm.tracker, tls=other) as client:
        err = _one_line_failure(client.nodes)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details().startswith(f"{swarm.tracker} presents a certificate from another CA: "
                                    "issued by "), err.details()
    assert err.details().endswith(f"; this caller trusts only {other / 'ca.crt'}")


def test_a_client_with_an_expired_certificate_is_told_so_in_one_line(swarm):
    old = swarm.issue("client", "lapsed", days=1,
                      not_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2))
    with Client(swarm.tracker, tls=old) as client:
        err = _one_line_failure(client.nodes)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details().startswith("this caller's certificate 'lapsed' is unusable: "
                                    "certificate expired at "), err.details()


def test_a_client_with_a_certificate_of_the_wrong_role_is_told_so_in_one_line(swarm):
    with Client(swarm.tracker, tls=TlsConfig.load(swarm.tls_dir, "tracker")) as client:
        assert len(client.nodes()) == 2  # every role may list nodes
        err = _one_line_failure(lambda: client.job("j-none").status())
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.details() == ("wrong role for /fedpipe.v1.Tracker/GetJob: tracker 'tracker' may "
                             "not call it (allowed: admin, client)")
    assert str(err) == f"PERMISSION_DENIED: {err.details()}"


def test_one_identitys_idle_streams_past_its_limit_are_refused_over_any_connection(swarm):
    """Under TLS the per-peer limit counts the certificate, however many connections it
    opens; another identity's calls and the tracker's Ping are still served promptly."""
    import queue
    node = swarm.client().nodes()[0]
    hog = swarm.issue("node", "hog")
    chans = [grpc.secure_channel(node.address, hog.channel_credentials(),
                                 options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(2)]
    extra = 4
    idle: list = []
    calls = []
    for i in range(net.PEER_DATA_CALLS + extra):
        q: queue.SimpleQueue = queue.SimpleQueue()
        idle.append(q)
        calls.append(node_pb2_grpc.NodeStub(chans[i % 2]).Send.future(iter(q.get, None)))
    try:
        deadline = time.monotonic() + 30
        while sum(c.done() for c in calls) < extra:
            assert time.monotonic() < deadline, "the excess streams were not refused"
            time.sleep(0.05)
        time.sleep(0.5)  # any further refusal would come at once
        ended = [c for c in calls if c.done()]
        assert len(ended) == extra
        for c in ended:
            assert c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, c.details()
            assert (f"fedpipe://node/hog already has {net.PEER_DATA_CALLS} data-plane calls "
                    f"open on this server") in c.details()
        probe = list(frames.encode_frames(torch.zeros(4), envelope=node_pb2.Envelope(
            kind=node_pb2.KIND_PROBE, batch_size=1)))
        other = swarm.issue("node", "polite")
        for tls, call in ((other, lambda s: rpc.NodeStub(s).Send(iter(probe), timeout=2.0)),
                          (TlsConfig.load(swarm.tls_dir, "tracker"),
                           lambda s: node_pb2_grpc.NodeStub(s).Ping(node_pb2.PingRequest(),
                                                                    timeout=2.0))):
            with grpc.secure_channel(node.address, tls.channel_credentials(),
                                     options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                start = time.monotonic()
                call(ch)
                assert time.monotonic() - start < 2.0
    finally:
        for q in idle:
            q.put(None)
        for ch in chans:
            ch.close()
