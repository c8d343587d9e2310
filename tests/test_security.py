"""Mutual TLS, the policy table and the auth interceptor, on a real gRPC server on 127.0.0.1.

The server serves every method of the Tracker and Node services with its real
RPC shape and message types (a servicer that answers an empty reply and says
in trailing metadata who it thinks called), gRPC's health service, and one
stream-stream test method, all behind :class:`AuthInterceptor`.
"""
from __future__ import annotations

import datetime as dt
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.security import certs, policy, tls
from fedpipe.security.certs import Identity, Role
from fedpipe.security.errors import DenyListUnreadable, PermissionDenied, Unauthenticated
from fedpipe.security.interceptor import AuthInterceptor, identity_of
from fedpipe.security.policy import Rule
from fedpipe.security.tls import Authenticator, TlsConfig

pytestmark = pytest.mark.timeout(120)

# Issue 11, item 3, written out independently of fedpipe/security/policy.py:
# method -> roles that may call it.
EXPECTED = {
    "/fedpipe.v1.Tracker/RegisterNode": {"node"},
    "/fedpipe.v1.Tracker/Heartbeat": {"node"},
    "/fedpipe.v1.Tracker/ReportStage": {"node"},
    "/fedpipe.v1.Tracker/RestoreJob": {"client"},
    "/fedpipe.v1.Tracker/ListNodes": {"node", "tracker", "client", "admin"},
    "/fedpipe.v1.Tracker/SubmitJob": {"client"},
    "/fedpipe.v1.Tracker/GetJob": {"client", "admin"},
    "/fedpipe.v1.Tracker/ListJobs": {"client", "admin"},  # a client sees its own
    "/fedpipe.v1.Tracker/WatchJob": {"client", "admin"},
    "/fedpipe.v1.Tracker/CancelJob": {"client", "admin"},
    "/fedpipe.v1.Tracker/DrainNode": {"admin", "node"},
    "/fedpipe.v1.Tracker/ReplicaQuorum": {"node"},
    "/fedpipe.v1.Tracker/JoinReplica": {"client"},
    "/fedpipe.v1.Node/Probe": {"node", "tracker"},
    "/fedpipe.v1.Node/LoadStage": {"tracker"},
    "/fedpipe.v1.Node/StopJob": {"tracker", "client"},
    "/fedpipe.v1.Node/Send": {"node", "client"},
    "/fedpipe.v1.Node/SendOne": {"node", "client"},
    "/fedpipe.v1.Node/FetchState": {"client", "node"},
    "/fedpipe.v1.Node/PutSnapshot": {"node", "client"},
    "/fedpipe.v1.Node/PutWeights": {"client"},
    "/fedpipe.v1.Node/FetchSnapshot": {"node", "client"},
    "/fedpipe.v1.Node/Ping": {"node", "tracker"},
    "/fedpipe.v1.Node/MeasureLinks": {"tracker"},
    "/fedpipe.v1.Node/HoldAt": {"tracker"},
    # who a new plan epoch assigns: the control plane's word only, never a node's
    "/fedpipe.v1.Node/AssignJob": {"tracker"},
}
CALLERS = {"tracker": "t", "node": "n1", "client": "alice", "admin": "op"}
CHAT = "/fedpipe.test.Echo/Chat"


def ago(days: float) -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days)


def _service_methods():
    for desc in (tracker_pb2.DESCRIPTOR.services_by_name["Tracker"],
                 node_pb2.DESCRIPTOR.services_by_name["Node"]):
        for m in desc.methods:
            yield f"/{desc.full_name}/{m.name}", m


def _fake_handlers() -> grpc.GenericRpcHandler:
    """Every Tracker and Node method with its real shape and types; replies name the caller."""

    def said(context):
        ident = identity_of(context)
        context.set_trailing_metadata((("fedpipe-caller", ident.uri if ident else "-"),))

    handlers = {}
    for full, m in _service_methods():
        req = message_factory.GetMessageClass(m.input_type)
        rep = message_factory.GetMessageClass(m.output_type)
        kw = dict(request_deserializer=req.FromString, response_serializer=rep.SerializeToString)
        if m.client_streaming:
            def behaviour(requests, context, rep=rep):
                for _ in requests:
                    pass
                said(context)
                return rep()
            handlers[full] = grpc.stream_unary_rpc_method_handler(behaviour, **kw)
        elif m.server_streaming:
            def behaviour(request, context, rep=rep):
                said(context)
                yield rep()
            handlers[full] = grpc.unary_stream_rpc_method_handler(behaviour, **kw)
        else:
            def behaviour(request, context, rep=rep):
                said(context)
                return rep()
            handlers[full] = grpc.unary_unary_rpc_method_handler(behaviour, **kw)

    def chat(requests, context):  # stream-stream, raw bytes: echo each message
        said(context)
        for r in requests:
            yield r
    handlers[CHAT] = grpc.stream_stream_rpc_method_handler(chat)

    class Generic(grpc.GenericRpcHandler):
        def service(self, details):
            return handlers.get(details.method)
    return Generic()


def _refuse_stop(identity, message: bytes) -> None:
    if message == b"stop":
        raise PermissionDenied(f"{identity} may not say stop")


@pytest.fixture(scope="module")
def swarm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    certs.make_ca(d)
    for role, name in CALLERS.items():
        certs.issue(d, role, name)
    certs.issue(d, "client", "bob")
    certs.issue(d, "node", "n2")
    certs.issue(d, "client", "old", not_before=ago(3), days=1)
    certs.issue(d, "client", "gone")
    certs.revoke(d, "gone")
    other = tmp_path_factory.mktemp("other")
    certs.make_ca(other)
    certs.issue(other, "client", "alice")
    certs.issue(other, "tracker", "t")
    return d, other


@pytest.fixture(scope="module")
def server(swarm_dir):
    d, _ = swarm_dir
    cfg = TlsConfig.load(d, "t")
    table = {**policy.POLICY, CHAT: Rule(frozenset({Role.CLIENT}), message_check=_refuse_stop)}
    srv = grpc.server(futures.ThreadPoolExecutor(8),
                      interceptors=[AuthInterceptor(cfg.authenticator(), table)])
    srv.add_generic_rpc_handlers((_fake_handlers(),))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = srv.add_secure_port("127.0.0.1:0", cfg.server_credentials())
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(grace=None)


def _channel(address, creds=None) -> grpc.Channel:
    # a private subchannel pool, so no call reuses another caller's TLS connection
    opts = [("grpc.use_local_subchannel_pool", 1)]
    if creds is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, creds, options=opts)


def _call(ch: grpc.Channel, method: str, request: bytes = b""):
    """Call ``method`` in its real shape with a serialized request; returns the trailing caller."""
    shape = {full: m for full, m in _service_methods()}[method]
    if shape.client_streaming:
        _, call = ch.stream_unary(method).with_call(iter([request]), timeout=10)
        return dict(call.trailing_metadata())["fedpipe-caller"]
    if shape.server_streaming:
        call = ch.unary_stream(method)(request, timeout=10)
        list(call)
        return dict(call.trailing_metadata())["fedpipe-caller"]
    _, call = ch.unary_unary(method).with_call(request, timeout=10)
    return dict(call.trailing_metadata())["fedpipe-caller"]


def _send_frame(kind) -> bytes:
    return node_pb2.Frame(envelope=node_pb2.Envelope(job_id="j", kind=kind)).SerializeToString()


@pytest.fixture(scope="module")
def channels(swarm_dir, server):
    d, _ = swarm_dir
    chans = {role: _channel(server, TlsConfig.load(d, name).channel_credentials())
             for role, name in CALLERS.items()}
    yield chans
    for ch in chans.values():
        ch.close()


def test_policy_table_is_the_issues_and_covers_every_rpc():
    served = {full for full, _ in _service_methods()}
    assert set(EXPECTED) == served
    for method, roles in EXPECTED.items():
        assert {r.value for r in policy.POLICY[method].roles} == roles, method
        assert not policy.POLICY[method].public
    health_methods = {k for k in policy.POLICY if k.startswith("/grpc.health.v1.Health/")}
    assert health_methods == {f"/grpc.health.v1.Health/{m}" for m in ("Check", "List", "Watch")}
    assert set(policy.POLICY) == served | health_methods


@pytest.mark.parametrize("method", sorted(EXPECTED))
@pytest.mark.parametrize("role", sorted(CALLERS))
def test_every_role_on_every_rpc(channels, method, role):
    request = _send_frame(node_pb2.KIND_INPUT) if method.endswith("/Send") else b""
    if role in EXPECTED[method]:
        assert _call(channels[role], method, request) == f"fedpipe://{role}/{CALLERS[role]}"
    else:
        with pytest.raises(grpc.RpcError) as e:
            _call(channels[role], method, request)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.value.details() == (
            f"wrong role for {method}: {role} {CALLERS[role]!r} may not call it (allowed: "
            + ", ".join(sorted(EXPECTED[method])) + ")")


def test_a_method_not_in_the_table_is_denied(swarm_dir):
    d, _ = swarm_dir
    cfg = TlsConfig.load(d, "t")
    # the same handlers behind the bare policy table: the test method has no row
    srv = grpc.server(futures.ThreadPoolExecutor(2),
                      interceptors=[AuthInterceptor(cfg.authenticator())])
    srv.add_generic_rpc_handlers((_fake_handlers(),))
    port = srv.add_secure_port("127.0.0.1:0", cfg.server_credentials())
    srv.start()
    try:
        with _channel(f"127.0.0.1:{port}",
                      TlsConfig.load(d, "alice").channel_credentials()) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(ch.stream_stream(CHAT)(iter([b"hi"]), timeout=10))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "not in fedpipe's policy table: denied by default" in e.value.details()
            # and a method the server does not have is simply unimplemented
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/fedpipe.v1.Node/Nope")(b"", timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        srv.stop(grace=None)


@pytest.mark.parametrize("method", ["/fedpipe.v1.Node/Send", "/fedpipe.v1.Node/SendOne"])
def test_a_client_may_send_only_inputs_and_targets(channels, method):
    for kind in (node_pb2.KIND_INPUT, node_pb2.KIND_TARGET):
        assert _call(channels["client"], method, _send_frame(kind))
    for kind in (node_pb2.KIND_ACTIVATION, node_pb2.KIND_GRADIENT, node_pb2.KIND_OUTER,
                 node_pb2.KIND_REDUCE):
        with pytest.raises(grpc.RpcError) as e:
            _call(channels["client"], method, _send_frame(kind))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.value.details() == ("client 'alice' may send only inputs and targets, not "
                                     + node_pb2.Kind.Name(kind))
        # a node sends any kind
        assert _call(channels["node"], method, _send_frame(kind))


def test_stream_stream_is_checked_message_by_message(channels):
    chat = channels["client"].stream_stream(CHAT)
    assert list(chat(iter([b"a", b"b"]), timeout=10)) == [b"a", b"b"]
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for r in chat(iter([b"a", b"stop", b"c"]), timeout=10):
            got.append(r)
    assert got == [b"a"]
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert e.value.details() == "client 'alice' may not say stop"
    with pytest.raises(grpc.RpcError) as e:
        list(channels["node"].stream_stream(CHAT)(iter([b"a"]), timeout=10))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_health_is_open_to_every_certificate(channels):
    for ch in channels.values():
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _refused_handshake(server, creds):
    with _channel(server, creds) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/fedpipe.v1.Tracker/ListNodes")(b"", timeout=10)
    return e.value


def test_no_certificate_is_refused_and_explained(server, swarm_dir, channels):
    d, _ = swarm_dir
    for creds in (None, grpc.ssl_channel_credentials(TlsConfig.load(d, "alice").ca_pem)):
        err = _refused_handshake(server, creds)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    line = tls.explain(err, server, None)
    assert line == (f"{server} requires mutual TLS and this caller has no certificate: "
                    "give --tls-dir, tls= or set FEDPIPE_TLS_DIR")
    assert _call(channels["client"], "/fedpipe.v1.Tracker/ListNodes")


def test_a_certificate_from_another_ca_is_refused_and_explained(server, swarm_dir, channels):
    d, other = swarm_dir
    # the stranger trusts our CA (so it accepts our server) but shows its own CA's certificate
    stranger = TlsConfig.load(other, "alice")
    creds = grpc.ssl_channel_credentials(TlsConfig.load(d, "alice").ca_pem,
                                         stranger.key_pem, stranger.cert_pem)
    err = _refused_handshake(server, creds)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    line = tls.explain(err, server, stranger)
    # from the stranger's side, the server is the one from another CA
    assert line.startswith(f"{server} presents a certificate from another CA: issued by ")
    # and a caller of our CA whose server trusts another CA learns that it was refused
    ours = TlsConfig.load(d, "alice")
    other_server = TlsConfig.load(other, "t")
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = srv.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(TlsConfig.load(d, "t").key_pem, TlsConfig.load(d, "t").cert_pem)],
        root_certificates=other_server.ca_pem, require_client_auth=True))
    srv.start()
    try:
        address = f"127.0.0.1:{port}"
        err = _refused_handshake(address, ours.channel_credentials())
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert tls.explain(err, address, ours).startswith(
            f"{address} refused this caller's certificate 'alice' in the TLS handshake: the "
            "server probably trusts another CA")
    finally:
        srv.stop(grace=None)
    assert _call(channels["client"], "/fedpipe.v1.Tracker/ListNodes")


def test_an_expired_certificate_is_refused_and_explained(server, swarm_dir, channels):
    d, _ = swarm_dir
    old = TlsConfig.load(d, "old", check=False)
    err = _refused_handshake(server, old.channel_credentials())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert tls.explain(err, server, old).startswith(
        "this caller's certificate 'old' is unusable: certificate expired at ")
    assert _call(channels["client"], "/fedpipe.v1.Tracker/ListNodes")


def test_a_revoked_certificate_is_refused_and_others_served(server, swarm_dir, channels):
    d, _ = swarm_dir
    gone = TlsConfig.load(d, "gone")
    with _channel(server, gone.channel_credentials()) as ch:
        with pytest.raises(grpc.RpcError) as e:
            _call(ch, "/fedpipe.v1.Tracker/ListNodes")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert e.value.details() == (f"certificate of client 'gone' (serial "
                                     f"{gone.identity.serial}) is revoked")
    assert _call(channels["client"], "/fedpipe.v1.Tracker/ListNodes")


def test_a_revocation_takes_effect_on_a_running_server(server, swarm_dir):
    d, _ = swarm_dir
    with _channel(server, TlsConfig.load(d, "bob").channel_credentials()) as ch:
        assert _call(ch, "/fedpipe.v1.Tracker/GetJob") == "fedpipe://client/bob"
        certs.revoke(d, "bob")
        deadline = time.monotonic() + tls.DENY_RELOAD_SECONDS + 5
        while True:  # within DENY_RELOAD_SECONDS, on the same connection
            try:
                _call(ch, "/fedpipe.v1.Tracker/GetJob")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in e.details()
                break
            assert time.monotonic() < deadline, "revocation not applied"
            time.sleep(0.1)


def test_diagnose_names_plaintext_mismatches_and_dead_addresses(swarm_dir):
    d, _ = swarm_dir
    alice = TlsConfig.load(d, "alice")
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        address = f"127.0.0.1:{port}"
        err = _refused_handshake(address, alice.channel_credentials())
        assert tls.explain(err, address, alice) == (
            f"{address} does not speak TLS (was it started without --tls-dir?), but this "
            "caller uses mutual TLS")
        assert tls.diagnose(address, None) is None  # plaintext to plaintext: not TLS's fault
    finally:
        srv.stop(grace=None)
    assert tls.diagnose(address, alice).startswith(f"cannot reach {address}: ")


def test_diagnose_names_a_server_certificate_without_the_dialled_host(swarm_dir):
    d, _ = swarm_dir
    alice = TlsConfig.load(d, "alice")
    certs.issue(d, "tracker", "far", hosts=["tracker.example.org"])
    far = TlsConfig.load(d, "far")
    srv = grpc.server(futures.ThreadPoolExecutor(2),
                      interceptors=[AuthInterceptor(far.authenticator())])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = srv.add_secure_port("127.0.0.1:0", far.server_credentials())
    srv.start()
    try:
        address = f"127.0.0.1:{port}"
        err = _refused_handshake(address, alice.channel_credentials())
        assert tls.explain(err, address, alice) == (
            f"{address}'s certificate does not name the host '127.0.0.1'; issue the server's "
            "certificate with --host 127.0.0.1")
    finally:
        srv.stop(grace=None)


# -- in-process: the authenticator and the identity checks, with fake auth contexts


def _auth_context(pem: bytes | None, kind: bytes = b"ssl") -> dict:
    ctx = {"transport_security_type": [kind]}
    if pem is not None:
        ctx["x509_pem_cert"] = [pem]
    return ctx


def test_authenticator_names_each_refusal(swarm_dir, tmp_path):
    d, other = swarm_dir
    auth = Authenticator(certs.load_ca(d), deny_file=d / certs.REVOKED)
    alice = (d / "alice.crt").read_bytes()
    assert auth.authenticate(_auth_context(alice)).name == "alice"
    cases = [
        (_auth_context(None, b"insecure"), "no TLS: this server requires mutual TLS"),
        (_auth_context(None), "no client certificate"),
        (_auth_context((other / "alice.crt").read_bytes()), "certificate from another CA"),
        (_auth_context((d / "old.crt").read_bytes()), "certificate of client 'old' expired at"),
        (_auth_context((d / "gone.crt").read_bytes()), "certificate of client 'gone' (serial"),
        (_auth_context((d / "ca.crt").read_bytes()),
         "certificate has no subject alternative names, so no fedpipe identity"),
    ]
    for ctx, message in cases:
        with pytest.raises(Unauthenticated) as e:
            auth.authenticate(ctx)
        assert str(e.value).startswith(message), (message, e.value)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    # a list pushed by the tracker adds to the file's
    auth.set_deny_list(certs.DenyList((certs.RevokedEntry(
        certs.read_identity(alice).serial, "alice", 0.0),)))
    with pytest.raises(Unauthenticated, match="'alice'.*is revoked"):
        auth.authenticate(_auth_context(alice))
    auth.set_deny_list(certs.DenyList())
    assert auth.authenticate(_auth_context(alice)).name == "alice"


def test_identity_checks_for_own_node_and_own_job():
    n1, n2 = Identity(Role.NODE, "n1", 1), Identity(Role.NODE, "n2", 2)
    alice, bob = Identity(Role.CLIENT, "alice", 3), Identity(Role.CLIENT, "bob", 4)
    tracker, admin = Identity(Role.TRACKER, "t", 5), Identity(Role.ADMIN, "op", 6)

    policy.require_self(n1, "n1")
    with pytest.raises(PermissionDenied, match="node 'n1' may speak only for itself, not for "
                                               "node 'n2'"):
        policy.require_self(n1, "n2")

    for who in (alice, tracker, admin):
        policy.require_owner(who, "alice", job_id="j1")
    for who in (bob, n1):
        with pytest.raises(PermissionDenied, match="is not the owner of job j1 \\(owner: "
                                                   "'alice'\\)"):
            policy.require_owner(who, "alice", job_id="j1")
    with pytest.raises(PermissionDenied, match="it has no owner"):
        policy.require_owner(alice, "", job_id="j1")

    policy.require_owner_or_assigned(alice, "alice", {"n1"}, job_id="j1")
    policy.require_owner_or_assigned(n1, "alice", {"n1"}, job_id="j1")
    with pytest.raises(PermissionDenied, match="node 'n2' is not assigned to job j1"):
        policy.require_owner_or_assigned(n2, "alice", {"n1"}, job_id="j1")
    with pytest.raises(PermissionDenied, match="client 'bob' is not the owner"):
        policy.require_owner_or_assigned(bob, "alice", {"n1"}, job_id="j1")

    # without TLS nobody has an identity and the loopback rules apply instead
    policy.require_self(None, "n2")
    policy.require_owner(None, "alice")
    policy.require_owner_or_assigned(None, "alice", ())
    assert policy.authorize("/fedpipe.v1.Node/LoadStage", None) is not None


def test_identity_of_a_call_no_interceptor_saw_is_a_wiring_error():
    class Context:
        pass
    with pytest.raises(RuntimeError, match="no AuthInterceptor admitted this call"):
        identity_of(Context())


def test_a_plaintext_server_admits_every_call_with_no_identity():
    srv = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[AuthInterceptor(None)])
    srv.add_generic_rpc_handlers((_fake_handlers(),))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        with _channel(f"127.0.0.1:{port}") as ch:
            assert _call(ch, "/fedpipe.v1.Node/LoadStage") == "-"
            assert _call(ch, "/fedpipe.v1.Node/Send", _send_frame(node_pb2.KIND_GRADIENT)) == "-"
    finally:
        srv.stop(grace=None)


def test_diagnose_names_an_expired_server_certificate(swarm_dir):
    d, _ = swarm_dir
    alice = TlsConfig.load(d, "alice")
    certs.issue(d, "tracker", "stale", not_before=ago(3), days=1)
    stale = TlsConfig.load(d, "stale", check=False)
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = srv.add_secure_port("127.0.0.1:0", stale.server_credentials())
    srv.start()
    try:
        address = f"127.0.0.1:{port}"
        err = _refused_handshake(address, alice.channel_credentials())
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert tls.explain(err, address, alice).startswith(
            f"{address} presents a certificate expired at ")
    finally:
        srv.stop(grace=None)


def test_explain_keeps_a_refusal_that_is_not_a_connection_failure(server, channels, swarm_dir):
    with pytest.raises(grpc.RpcError) as e:
        _call(channels["client"], "/fedpipe.v1.Node/LoadStage")
    alice = TlsConfig.load(swarm_dir[0], "alice")
    assert tls.explain(e.value, server, alice) == (
        "PERMISSION_DENIED: wrong role for /fedpipe.v1.Node/LoadStage: client 'alice' may not "
        "call it (allowed: tracker)")


def test_a_deny_list_made_unreadable_refuses_every_caller_until_fixed(tmp_path, monkeypatch):
    # the re-read interval is read at each look; a short one keeps the two waits below short
    monkeypatch.setattr(tls, "DENY_RELOAD_SECONDS", 0.2)
    certs.make_ca(tmp_path)
    certs.issue(tmp_path, "client", "alice")
    alice = _auth_context((tmp_path / "alice.crt").read_bytes())
    (tmp_path / "revoked.json").write_text("{")
    with pytest.raises(certs.CertError, match="cannot read its deny list: .*not JSON"):
        Authenticator(certs.load_ca(tmp_path), deny_file=tmp_path / certs.REVOKED)
    (tmp_path / "revoked.json").unlink()
    auth = Authenticator(certs.load_ca(tmp_path), deny_file=tmp_path / certs.REVOKED)
    assert auth.authenticate(alice).name == "alice"
    (tmp_path / "revoked.json").write_text('{"revoked": 5}')
    deadline = time.monotonic() + tls.DENY_RELOAD_SECONDS + 5
    while True:
        try:
            auth.authenticate(alice)
        except DenyListUnreadable as e:
            assert e.code == grpc.StatusCode.UNAVAILABLE
            assert str(e).startswith("this server cannot read its deny list: ")
            break
        assert time.monotonic() < deadline, "a broken deny list went unnoticed"
        time.sleep(0.1)
    (tmp_path / "revoked.json").write_text('{"revoked": []}')
    time.sleep(tls.DENY_RELOAD_SECONDS + 0.1)
    assert auth.authenticate(alice).name == "alice"


def test_only_nodes_of_a_jobs_plans_move_its_snapshots():
    n1, n2 = Identity(Role.NODE, "n1", 1), Identity(Role.NODE, "n2", 2)
    policy.require_assigned(n1, {"n1"}, job_id="j1")
    policy.require_assigned(None, (), job_id="j1")  # no TLS: the loopback rules apply
    for who, name in ((n2, "node 'n2'"), (Identity(Role.CLIENT, "alice", 3), "client 'alice'"),
                      (Identity(Role.TRACKER, "t", 4), "tracker 't'")):
        with pytest.raises(PermissionDenied, match=f"^{name} is not assigned to job j1$"):
            policy.require_assigned(who, {"n1"}, job_id="j1")


def test_the_deny_list_travels_in_heartbeat_replies_and_a_bad_serial_is_refused():
    deny = certs.DenyList((certs.RevokedEntry(2**150 + 7, "gone", 1.5),
                           certs.RevokedEntry(3, "old", 2.0)))
    reply = tracker_pb2.HeartbeatReply(revoked=deny.to_proto())
    assert certs.DenyList.from_proto(tracker_pb2.HeartbeatReply.FromString(
        reply.SerializeToString()).revoked) == deny
    for serial in ("-1", "12a", "", "9" * 51):
        with pytest.raises(certs.CertError, match="is not a decimal certificate serial"):
            certs.DenyList.from_proto([tracker_pb2.RevokedCert(serial=serial, name="x")])


def test_a_tls_config_shares_one_authenticator_so_a_pushed_deny_list_reaches_every_check(
        swarm_dir):
    d, _ = swarm_dir
    cfg = TlsConfig.load(d, "t")
    assert cfg.authenticator() is cfg.authenticator()
    alice = (d / "alice.crt").read_bytes()
    cfg.authenticator().set_deny_list(certs.DenyList((certs.RevokedEntry(
        certs.read_identity(alice).serial, "alice", 0.0),)))
    with pytest.raises(Unauthenticated, match="'alice'.*is revoked"):
        cfg.authenticator().authenticate(_auth_context(alice))
    names = [e.name for e in cfg.authenticator().deny_list().entries]
    assert names[-1] == "alice" and "gone" in names  # the file's, then the pushed


def test_a_client_feeds_inputs_to_the_first_stage_and_targets_to_the_last():
    alice, n1 = Identity(Role.CLIENT, "alice", 3), Identity(Role.NODE, "n1", 1)
    inp, tgt, act = node_pb2.KIND_INPUT, node_pb2.KIND_TARGET, node_pb2.KIND_ACTIVATION
    policy.require_feeds_stage(alice, inp, 0, 3, job_id="j1")
    policy.require_feeds_stage(alice, tgt, 2, 3, job_id="j1")
    policy.require_feeds_stage(alice, inp, 0, 1, job_id="j1")  # one stage takes both
    policy.require_feeds_stage(alice, tgt, 0, 1, job_id="j1")
    for kind, stage, says in ((inp, 1, "KIND_INPUT to stage 1 of job j1: a client feeds only "
                                        "stage 0"),
                              (tgt, 0, "KIND_TARGET to stage 0 of job j1: a client feeds only "
                                       "stage 2"),
                              (act, 1, "KIND_ACTIVATION to stage 1 of job j1: a client feeds "
                                       "no stage")):
        with pytest.raises(PermissionDenied, match=f"^client 'alice' may not send {says}"):
            policy.require_feeds_stage(alice, kind, stage, 3, job_id="j1")
    for who in (n1, None):  # stages send each other any kind; no TLS: loopback rules
        policy.require_feeds_stage(who, act, 1, 3, job_id="j1")
