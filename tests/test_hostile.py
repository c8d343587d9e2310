"""Hostile or broken callers get a clear error status, and the swarm keeps working."""
from __future__ import annotations

import math

import grpc
import pytest
import zstandard

from fedpipe import net
from fedpipe.proto import node_pb2, tensor_pb2, tracker_pb2, tracker_pb2_grpc
from fedpipe.wire import format, rpc

pytestmark = [pytest.mark.timeout(120), pytest.mark.processes]


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_tracker_refuses_bad_registrations_reports_and_codecs(swarm):
    stub = tracker_pb2_grpc.TrackerStub(net.channel(swarm.tracker))
    for address, flops in (("127.0.0.1:1", math.inf), ("no-port", 1e9), ("h:99999", 1e9),
                           ("http://x:1", 1e9)):
        req = tracker_pb2.RegisterNodeRequest(name="x", address=address,
                                              resources=node_pb2.Resources(flops=flops,
                                                                           memory_bytes=2**30))
        code, details = code_of(lambda req=req: stub.RegisterNode(req, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (address, details)
    spec = tracker_pb2.SubmitJobRequest(
        layers=[b"x"], profile=tracker_pb2.ModelProfile(
            layers=[tracker_pb2.LayerProfile(name="l", flops=1.0)]),
        config=node_pb2.JobConfig(steps=1, microbatches=1, batch_size=4, schedule="gpipe",
                                  optimizer=b"o",
                                  loss_fn=b"l", activation_compression="int8:7"))
    code, details = code_of(lambda: stub.SubmitJob(spec, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "activation_compression" in details
    spec.config.activation_compression = ""
    spec.config.replica_sync, spec.config.outer_every = "diloco", -1  # 0 means the default
    code, details = code_of(lambda: stub.SubmitJob(spec, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "inner_steps" in details, details
    # a stranger's report about a job it does not run is refused, not believed
    job = stub.SubmitJob(tracker_pb2.SubmitJobRequest(
        layers=[b"x"], profile=spec.profile,
        config=node_pb2.JobConfig(steps=1, microbatches=1, batch_size=4, schedule="gpipe",
                                  optimizer=b"o",
                                  loss_fn=b"l")), timeout=10).job_id
    report = tracker_pb2.StageReport(job_id=job, replica=7, stage=9, node_id="stranger",
                                     status=tracker_pb2.StageReport.STATUS_DONE)
    code, _ = code_of(lambda: stub.ReportStage(report, timeout=10))
    assert code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)
    assert stub.GetJob(tracker_pb2.GetJobRequest(job_id=job), timeout=10).state != \
        tracker_pb2.JOB_STATE_SUCCEEDED
    stub.CancelJob(tracker_pb2.CancelJobRequest(job_id=job), timeout=10)


def test_node_refuses_before_buffering_and_bounds_probes(swarm):
    node = swarm.client().nodes()[0]
    stub = rpc.NodeStub(net.channel(node.address))
    # a 1 GiB zstd bomb declared as a link probe: over the probe limit, refused unread
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 * 2**20 + 1))
    head = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[64 * 2**20 + 1],
                             codec=tensor_pb2.CODEC_RAW, zstd=True, encoded_bytes=64 * 2**20 + 1,
                             payload_bytes=len(bomb))
    env = node_pb2.Envelope(kind=node_pb2.KIND_PROBE)
    code, details = code_of(lambda: stub.Send(iter([format.pack_head(
        node_pb2.Frame(envelope=env, tensor=head), bomb)]), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds" in details
    # a big tensor for a job the node does not run is refused at its header
    big = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2**28],
                            codec=tensor_pb2.CODEC_RAW, encoded_bytes=2**30,
                            payload_bytes=2**30)
    frames = iter([format.pack_head(node_pb2.Frame(
        envelope=node_pb2.Envelope(job_id="nope", kind=1, batch_size=1), tensor=big))]
        + [format.pack_more(b"\0" * 2**20)] * 8)
    code, _ = code_of(lambda: stub.Send(frames, timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND
    # a shape whose zero hides huge dimensions
    odd = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2**62, 0],
                            codec=tensor_pb2.CODEC_RAW)
    code, _ = code_of(lambda: stub.Send(iter([format.pack_head(node_pb2.Frame(
        envelope=node_pb2.Envelope(kind=node_pb2.KIND_PROBE), tensor=odd))]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # frames that are not fedpipe wire frames: a protobuf Frame (an old sender), another
    # version, a header length past the frame's end; each refused by name
    old = node_pb2.Frame(envelope=node_pb2.Envelope(kind=node_pb2.KIND_PROBE), tensor=odd)
    for frame, why in ((old.SerializeToString(), "not a fedpipe wire frame"),
                       (b"FPW\x07\x01", "version 7"),
                       (b"FPW\x01\x01\xff\xff\x00\x00", "runs past the end")):
        code, details = code_of(lambda frame=frame: stub.Send(iter([frame]), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and why in details, details
    assert stub.Probe(node_pb2.ProbeRequest(), timeout=10).flops > 0
