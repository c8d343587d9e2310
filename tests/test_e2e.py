"""End to end over real processes on 127.0.0.1: the demo, bad input, leases, restarts."""
from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import grpc
import pytest
import torch
from torch import nn

import fedpipe
from fedpipe import net
from fedpipe.client import JobFailed, NotEnoughMemory
from fedpipe.examples import digits
from fedpipe.proto import node_pb2, tensor_pb2, tracker_pb2
from fedpipe.spec import PlanView
from fedpipe.testing import LocalSwarm, child_env, free_port
from fedpipe.wire import format, rpc

pytestmark = [pytest.mark.timeout(180), pytest.mark.processes]
ADAMW = fedpipe.optimizer(torch.optim.AdamW, lr=3e-3)


def digit_data(batch=32):
    x, y, _, _ = digits.load()
    return digits.batches(x, y, batch)


def submit_digits(client, steps=5, **kw):
    return client.submit(digits.make_model(hidden=32), nn.functional.cross_entropy, ADAMW,
                         digit_data(), steps=steps, microbatches=2, **kw)


def wait_until(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_demo_reaches_95_percent_with_three_node_processes():
    out = subprocess.run([sys.executable, "-m", "fedpipe", "demo", "--nodes", "3"],
                         capture_output=True, text=True, timeout=170, env=child_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    acc = float(re.search(r"held-out accuracy: (\d\.\d{4})", out.stdout).group(1))
    assert acc >= 0.95
    stages = re.findall(r"stage (\d) on (node\d)", out.stdout)
    assert len({node for _, node in stages}) == 3, out.stdout


class Pair(nn.Module):
    def forward(self, x):
        return x, x


def test_bad_models_are_refused_with_a_clear_error(swarm):
    client = swarm.client()
    with pytest.raises(TypeError, match="nn.Sequential"):
        client.submit(nn.Linear(64, 10), nn.functional.cross_entropy, ADAMW, digit_data(),
                      steps=1)
    with pytest.raises(TypeError, match=r"layer 1 \(Pair\).*not a single tensor"):
        client.submit(nn.Sequential(nn.Linear(64, 10), Pair()), nn.functional.cross_entropy,
                      ADAMW, digit_data(), steps=1)
    with pytest.raises(ValueError, match="unknown schedule"):
        submit_digits(client, schedule="zigzag")


def test_malformed_tensor_gets_invalid_argument_and_node_keeps_serving(swarm):
    node = swarm.client().nodes()[0]
    stub = rpc.NodeStub(net.channel(node.address))
    bad = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4, 4],
                            codec=tensor_pb2.CODEC_RAW, payload_bytes=10, encoded_bytes=10)
    env = node_pb2.Envelope(kind=node_pb2.KIND_PROBE)  # a kind any node accepts
    with pytest.raises(grpc.RpcError) as err:
        stub.Send(iter([format.pack_head(node_pb2.Frame(envelope=env, tensor=bad),
                                         b"\0" * 10)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(r"10 .*need 64", err.value.details()), err.value.details()
    # a continuation chunk without a header
    with pytest.raises(grpc.RpcError) as err:
        stub.Send(iter([format.pack_more(b"abc")]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the node still serves: it answers a probe and trains a job
    assert stub.Probe(node_pb2.ProbeRequest(), timeout=10).flops > 0
    assert submit_digits(swarm.client(), stages=3).wait(timeout=60, progress=False).step == 5


def test_pending_without_nodes_then_runs_when_a_node_joins_and_memory_is_checked():
    with LocalSwarm(n_nodes=0) as s:
        client = s.client()
        job = submit_digits(client, pending_timeout=1.5)
        st = job.status()
        assert st.state == "PENDING" and "waiting for a node" in st.reason
        with pytest.raises(JobFailed, match="no node registered within 2 s"):
            job.wait(timeout=30, progress=False)

        waiting = submit_digits(client)
        s.add_node("--memory-limit", str(4 * 2**20))
        s.wait_for_nodes(1)
        assert waiting.wait(timeout=60, progress=False).state == "SUCCEEDED"

        # 1024x1024 float32 weights with AdamW state need ~16 MiB: more than the 4 MiB node
        big = nn.Sequential(nn.Linear(64, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 10))
        with pytest.raises(NotEnoughMemory) as err:  # was: a raw RESOURCE_EXHAUSTED RpcError
            client.submit(big, nn.functional.cross_entropy, ADAMW, digit_data(), steps=1)
        found = re.fullmatch(
            r"job Sequential was refused at submit: the job needs about ([\d.]+) MiB \(.*\) "
            r"but the swarm's 1 node\(s\) have ([\d.]+) MiB in all: ([\d.]+) MiB \((\d+) "
            r"bytes\) more are needed; to fit, submit with recompute=\"auto\" \(or True\), "
            r"more microbatches, precision=\"bf16-mixed\", or add nodes", str(err.value))
        assert found, str(err.value)
        need, have, more, lack = map(float, found.groups())
        assert have == 4.0 and need > 16  # the weights and AdamW's two copies alone: 16 MiB
        assert more == pytest.approx(need - have, abs=0.1)
        assert lack / 2**20 == pytest.approx(more, abs=0.05)


def test_node_retries_an_unreachable_tracker_then_registers(tmp_path):
    port = free_port()
    s = LocalSwarm(n_nodes=0, workdir=str(tmp_path))
    s.tracker = f"127.0.0.1:{port}"
    try:
        node = s.add_node()
        wait_until(lambda: "registering again" in s.log(node), what="a retry in the node's log")
        assert re.search(rf"tracker 127\.0\.0\.1:{port} is unreachable \(UNAVAILABLE: Failed to "
                         rf"connect to remote host: Connection refused\); registering again in "
                         rf"[\d.]+ s", s.log(node))
        assert "failed to connect to all addresses" not in s.log(node)  # gRPC core's preamble
        s.start_tracker()  # on the port the node keeps dialling
        s.wait_for_nodes(1)
    finally:
        s.close()


def test_tracker_restart_keeps_jobs_and_nodes_and_a_lost_nodes_job_recovers(tmp_path):
    with LocalSwarm(n_nodes=2, workdir=str(tmp_path), lease=4.0) as s:
        client = s.client()
        done = submit_digits(client, stages=2)
        assert done.wait(timeout=60, progress=False).state == "SUCCEEDED"
        ids = {n.node_id for n in client.nodes()}

        s.stop_process(s.tracker_proc, kill=True)
        s.start_tracker()
        client = s.client()
        assert client.job(done.id).status().state == "SUCCEEDED"
        assert {n.node_id for n in client.nodes()} == ids
        # the nodes keep their ids across the restart, and the swarm still trains
        assert submit_digits(client, stages=2).wait(timeout=60, progress=False).step == 5

        # a node that dies mid-job is marked lost and the job recovers on the survivor
        long = submit_digits(client, steps=100_000, stages=2)
        wait_until(lambda: long.status().step > 0, what="the long job to start")
        s.stop_process(s.nodes[1], kill=True)
        wait_until(lambda: len(client.nodes()) == 1, what="the dead node to be marked lost")
        info = lambda: client.stub.GetJob(tracker_pb2.GetJobRequest(job_id=long.id),  # noqa: E731
                                          timeout=10)
        wait_until(lambda: info().epoch == 1 and long.status().state == "RUNNING",
                   what="the job to recover")
        step = info().step
        wait_until(lambda: info().step > step + 2, what="the recovered job to train on")
        assert len(PlanView(info().plan).node_ids()) == 1
        long.cancel()


def test_a_diverging_job_still_reports_every_step(swarm):
    """NaN losses are stored (SQLite keeps NaN as NULL) and every step is recorded."""
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    job = swarm.client().submit(model, nn.functional.mse_loss,
                                fedpipe.optimizer(torch.optim.SGD, lr=1e6), [(x, y)], steps=12,
                                stages=2)
    status = job.wait(timeout=60, progress=False)
    assert status.step == 12 and not (status.loss < float("inf"))  # inf or nan at the end
    job.release()


def test_a_stopped_node_leaves_at_once_and_release_is_best_effort(tmp_path):
    with LocalSwarm(n_nodes=2, workdir=str(tmp_path), lease=30.0) as s:
        client = s.client()
        job = submit_digits(client, stages=2)
        assert job.wait(timeout=60, progress=False).state == "SUCCEEDED"
        s.stop_process(s.nodes[1])  # SIGTERM: the node tells the tracker it leaves
        wait_until(lambda: len(client.nodes()) == 1, timeout=10,
                   what="the stopped node to leave well before its 30 s lease")
        job.release()  # one node is gone: no error


def test_batches_too_small_for_the_microbatches_are_skipped(swarm):
    x, y, _, _ = digits.load()
    data = [(x[:32], y[:32]), (x[32:33], y[32:33]), (x[33:65], y[33:65]), (x[65:97], y[65:97])]
    job = swarm.client().submit(digits.make_model(hidden=32), nn.functional.cross_entropy, ADAMW,
                                data, steps=3, microbatches=2, stages=2)
    assert job.wait(timeout=60, progress=False).step == 3
    losses = [ev.loss for ev in job.events() if ev.step > 0]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses  # no empty microbatch
    job.release()
