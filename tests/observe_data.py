"""Known figures in a real tracker Store (SQLite), for the observe tests."""
from __future__ import annotations

import time

from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import JobSpec
from fedpipe.tracker.store import SqliteStore, new_id

NODES = [("fast", 120e9, 8 << 30), ("mid", 60e9, 4 << 30), ("slow", 15e9, 2 << 30)]


def fill_store(path: str, steps=((1, 2.5, 100.0), (2, 1.5, 150.0), (3, 0.75, 180.0))):
    """A Store with three nodes, their six links, and one RUNNING 2-stage job with
    ``steps`` recorded as (step, loss, samples/s); returns (store, job id, node ids)."""
    store = SqliteStore(path)
    ids = []
    for i, (name, flops, mem) in enumerate(NODES):
        ids.append(new_id())
        store.add_node(ids[-1], name, f"127.0.0.1:{6000 + i}",
                       node_pb2.Resources(device="cpu", device_name="test cpu", cores=2,
                                          flops=flops, memory_bytes=mem),
                       f"boot-{i}", tracker_pb2.Versions(), time.time())
    store.set_links([node_pb2.LinkMeasurement(src_id=a, dst_id=b, bandwidth=1e7 * (1 + 3 * i + j),
                                              latency=1e-3 * (1 + i + 2 * j),
                                              measured_at=time.time())
                     for i, a in enumerate(ids) for j, b in enumerate(ids) if a != b])
    config = JobSpec(steps=10, microbatches=2, schedule="1f1b", optimizer=b"o", loss_fn=b"l",
                     batch_size=32).to_proto()
    profile = tracker_pb2.ModelProfile(
        layers=[tracker_pb2.LayerProfile(name=f"{k}:Linear", flops=2e6 * (k + 1),
                                         activation_bytes=512, parameter_bytes=8192)
                for k in range(4)], input_bytes=256)
    job = store.add_job(tracker_pb2.SubmitJobRequest(name="mlp", layers=[b"x"] * 4,
                                                     config=config, profile=profile), "queued",
                         time.time())
    plan = node_pb2.Plan(predicted_step_seconds=0.04, summary="two stages",
                         replicas=[node_pb2.ReplicaInfo(microbatches=2, samples=32)])
    for s, (a, b) in enumerate([(0, 1), (1, 4)]):
        plan.stages.append(node_pb2.StageAssignment(
            replica=0, stage=s, node_id=ids[s], node_name=NODES[s][0],
            address=f"127.0.0.1:{6000 + s}", layer_start=a, layer_end=b,
            activation_codec="int8+zstd", gradient_codec="fp16"))
    store.set_plan(job, plan)
    store.set_state(job, tracker_pb2.JOB_STATE_RUNNING, "all stages loaded", time.time())
    for step, loss, sps in steps:
        store.record_step(job, step, loss, sps, time.time())
        time.sleep(0.01)  # distinct times, so the measured step time is > 0
    return store, job, ids
