"""The command line's and the client's one-line errors about what they were pointed at,
in-process (no subprocess): an unknown job on a tracker or its dashboard, a dashboard
nothing serves, a node's port or an HTTP port given as the tracker's.

The servers run in this process: the real dashboard over an empty store, a gRPC server
with a node's service only, and a stand-in tracker that knows no job (a real tracker
starts its planner's worker process: ``test_tracker`` checks that it answers an unknown
job's GetJob with these words; ``test_cli`` runs the commands against a real swarm).
"""
from __future__ import annotations

import grpc
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe import net
from fedpipe.cli import main
from fedpipe.client import Client, JobNotFound
from fedpipe.proto import node_pb2, node_pb2_grpc, tracker_pb2_grpc
from fedpipe.testing import free_port
from fedpipe.tracker.http import start_http
from fedpipe.tracker.store import open_store

pytestmark = pytest.mark.timeout(60)
JOB = "deadbeef0000"


class NoJobs(tracker_pb2_grpc.TrackerServicer):
    """A tracker that knows no job: GetJob and WatchJob answer as the tracker's do for an
    unknown id (NOT_FOUND, ``no job 'ID'``)."""

    def GetJob(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r}")

    def WatchJob(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r}")

    def CancelJob(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r}")


class Pinged(node_pb2_grpc.NodeServicer):
    """A node's gRPC port: the node's service, none of the tracker's calls."""

    def Ping(self, request, context):
        return node_pb2.PingReply()


def grpc_server(add) -> tuple[grpc.Server, str]:
    srv = net.server(max_workers=4)
    add(srv)
    port = net.bind(srv, "127.0.0.1", 0)
    srv.start()
    return srv, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tracker():
    """The address of a tracker that knows no job."""
    srv, address = grpc_server(lambda s: tracker_pb2_grpc.add_TrackerServicer_to_server(
        NoJobs(), s))
    yield address
    srv.stop(grace=0).wait()


@pytest.fixture(scope="module")
def node():
    """The address of a node's gRPC port."""
    srv, address = grpc_server(lambda s: node_pb2_grpc.add_NodeServicer_to_server(Pinged(), s))
    yield address
    srv.stop(grace=0).wait()


@pytest.fixture(scope="module")
def dashboard():
    """The URL of a tracker's dashboard over a store without jobs."""
    store = open_store("memory:")
    served = start_http(store)
    yield served.url
    served.close()
    store.close()


def said(capsys, argv: list[str]) -> str:
    """What ``fedpipe ARGV`` prints on stderr, once it has exited 1."""
    assert main(argv) == 1
    return capsys.readouterr().err


def test_plot_and_status_of_an_unknown_job_name_the_job_and_the_tracker(tracker, tmp_path,
                                                                         capsys):
    # was (plot): "fedpipe plot: KeyError: 'deadbeef0000'"
    line = f"no job '{JOB}' on tracker {tracker}\n"
    assert said(capsys, ["plot", "--tracker", tracker, JOB, "-o", str(tmp_path / "x.png")]) \
        == f"fedpipe plot: {line}"
    assert not (tmp_path / "x.png").exists()
    assert said(capsys, ["status", "--tracker", tracker, JOB]) == f"fedpipe status: {line}"
    assert said(capsys, ["status", "--tracker", tracker, JOB, "--json"]) == \
        f"fedpipe status: {line}"
    # was (cancel): "fedpipe cancel: NOT_FOUND: no job 'deadbeef0000'", no tracker named
    assert said(capsys, ["cancel", "--tracker", tracker, JOB]) == f"fedpipe cancel: {line}"


def test_status_of_an_unknown_job_on_the_dashboard_names_the_job_and_the_url(dashboard,
                                                                              capsys):
    # was: "fedpipe status: KeyError: 'deadbeef0000'"
    line = f"fedpipe status: no job '{JOB}' on the dashboard at {dashboard}\n"
    assert said(capsys, ["status", "--dashboard", dashboard, JOB]) == line
    assert said(capsys, ["status", "--dashboard", dashboard + "/", JOB, "--json"]) == line


def test_a_dashboard_nothing_serves_is_named_with_why(capsys):
    # was: "URLError: <urlopen error [Errno 111] Connection refused>"
    url = f"http://127.0.0.1:{free_port()}"
    assert said(capsys, ["status", "--dashboard", url]) == \
        f"fedpipe status: cannot reach the dashboard at {url}: connection refused\n"


def test_a_dashboard_url_that_is_no_dashboard_is_named(dashboard, node, capsys):
    assert said(capsys, ["status", "--dashboard", f"{dashboard}/elsewhere"]) == (
        f"fedpipe status: the dashboard at {dashboard}/elsewhere answered GET /api/nodes "
        f"with HTTP 404: no such path: /elsewhere/api/nodes\n")
    assert said(capsys, ["status", "--dashboard", f"http://{node}"]) == (
        f"fedpipe status: http://{node} does not speak HTTP/1.1 (is it the tracker's --port? "
        f"give the tracker's --http-port)\n")


def test_a_nodes_port_given_as_the_trackers_is_named_by_the_cli_and_the_client(node, capsys):
    # was: "fedpipe status: UNIMPLEMENTED: Method not found!"; from Python, gRPC's raw
    # _InactiveRpcError
    line = (f"{node} is not a fedpipe tracker (it does not serve the tracker's calls; is it "
            f"a node's port?)")
    assert said(capsys, ["status", "--tracker", node]) == \
        f"fedpipe status: UNIMPLEMENTED: {line}\n"
    with Client(node) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.nodes()
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNIMPLEMENTED, line)
        assert str(e.value) == f"UNIMPLEMENTED: {line}"
    with Client(node) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.submit(nn.Sequential(nn.Linear(3, 2)), nn.functional.mse_loss,
                          fedpipe.optimizer(torch.optim.SGD, lr=0.1),
                          [(torch.zeros(4, 3), torch.zeros(4, 2))], steps=1)
        assert e.value.details() == line


def test_the_trackers_http_port_given_as_its_port_is_named(dashboard, capsys):
    # was: "UNAVAILABLE: Failed parsing HTTP/2 (Expected SETTINGS frame as the first
    # frame, got frame type 79)"
    address = dashboard.removeprefix("http://")
    assert said(capsys, ["status", "--tracker", address]) == (
        f"fedpipe status: UNAVAILABLE: {address} does not speak gRPC (is it the tracker's "
        f"--http-port? give the tracker's --port)\n")


def test_an_unknown_job_is_job_not_found_from_status_wait_and_history(tracker):
    # was: status() and wait() raised gRPC's raw _InactiveRpcError (NOT_FOUND), history() a
    # bare KeyError('nope')
    with Client(tracker) as client:
        job = client.job("nope")
        for call in (job.status, lambda: job.wait(timeout=10, progress=False), job.history):
            with pytest.raises(JobNotFound) as e:
                call()
            assert str(e.value) == f"no job 'nope' on tracker {tracker}"
            assert (e.value.job_id, e.value.where) == ("nope", f"tracker {tracker}")
            assert isinstance(e.value, LookupError) and isinstance(e.value, KeyError)


def test_every_job_call_on_an_unknown_job_names_it_and_the_tracker(tracker, tmp_path):
    # was: resume, events and save raised gRPC's raw NOT_FOUND (status, wait, cancel did not)
    with Client(tracker) as client:
        job = client.job(JOB)
        for call in (lambda: job.resume([]), lambda: list(job.events()),
                     lambda: job.save(tmp_path / "kept")):
            with pytest.raises(JobNotFound) as e:
                call()
            assert str(e.value) == f"no job '{JOB}' on tracker {tracker}"
        assert job._feeder is None and not (tmp_path / "kept").exists()
