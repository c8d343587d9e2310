"""``fedpipe status`` marks which of a job's stages sit on outbound-only nodes (behind NAT,
homed at a relay), in the words its node listing uses (:func:`fedpipe.planner.types.reach`):
the plan's ``StageAssignment.relay``, as the tracker serves it (``GetJob``), through the same
views ``fedpipe status`` and ``/api/jobs/ID`` use; ``fedpipe plan``'s table says the same of
a cluster's relayed nodes (:func:`fedpipe.planner.jsonio.format_plan`)."""
from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from fedpipe.observe.status import job_dict, job_renderable, swarm_renderable
from fedpipe.planner import (ClusterView, LayerProfile, ModelProfile, NodeSpec, Plan,
                             ReplicaGroup, StagePlan, TrainConfig)
from fedpipe.planner.jsonio import format_plan
from fedpipe.observe.views import swarm_view
from fedpipe.proto import node_pb2, tracker_pb2

pytestmark = pytest.mark.timeout(60)
RELAY = "203.0.113.5:7071"


class Source:
    """What GetJob serves, as ``fedpipe status`` reads it over gRPC: a running job of three
    stages whose node ``relayed`` (if any) is homed at :data:`RELAY`."""

    def __init__(self, relayed: int | None):
        self.info = tracker_pb2.JobInfo(
            job_id="j", name="net", state=tracker_pb2.JOB_STATE_RUNNING, steps=10,
            plan=node_pb2.Plan(stages=[node_pb2.StageAssignment(
                stage=k, node_id=f"n{k}", node_name=f"node-{k}",
                address=f"127.0.0.1:{7000 + k}", layer_start=2 * k, layer_end=2 * k + 2,
                activation_codec="int8", gradient_codec="bf16",
                relay=RELAY if k == relayed else "")
                for k in range(3)]))

    def job(self, job_id):
        return self.info

    def events(self, job_id, after_seq):
        return []


def _text(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def test_status_marks_the_stages_on_outbound_only_nodes_as_the_node_listing_does():
    # was: only `fedpipe status` without a job (the node listing) said a node was relayed
    view = job_dict(Source(relayed=1), "j")
    [stages] = view["plan"]["groups"]
    assert [st["reach"] for st in stages] == ["direct", f"outbound-only via {RELAY}", "direct"]
    rows = {name: line for line in _text(job_renderable(view)).splitlines()
            for name in ("node-0", "node-1", "node-2") if f" {name} " in line}
    assert re.search(rf"node-1 +outbound-only via {re.escape(RELAY)} +2-3 ", rows["node-1"])
    assert re.search(r"node-0 +direct +0-1 ", rows["node-0"])
    listing = swarm_view([tracker_pb2.NodeInfo(node_id="n1", name="node-1", alive=True,
                                               relay=RELAY)], [])
    assert listing["nodes"][0]["reach"] == stages[1]["reach"]  # one wording
    assert f"outbound-only via {RELAY}" in _text(swarm_renderable(listing))


def test_status_leaves_the_column_out_when_every_stage_is_reached_directly():
    view = job_dict(Source(relayed=None), "j")
    assert "reach" not in _text(job_renderable(view))
    assert all(st["reach"] == "direct" for g in view["plan"]["groups"] for st in g)


def _plan_table(relayed: int | None) -> str:
    """``fedpipe plan``'s table of three stages, two layers each, on nodes ``n0``..``n2``,
    node ``relayed`` (if any) homed at :data:`RELAY`."""
    cluster = ClusterView([NodeSpec(f"n{k}", 1e12, 2**30, name=f"node-{k}",
                                    relay=RELAY if k == relayed else "") for k in range(3)])
    profile = ModelProfile([LayerProfile(f"{i}:Linear", 1e6, 4096, 1024) for i in range(6)],
                           input_bytes=4096)
    plan = Plan([ReplicaGroup([StagePlan(f"n{k}", 2 * k, 2 * k + 2, "int8", "bf16")
                               for k in range(3)], microbatches=1, samples=8)], 0.01)
    return format_plan(plan, cluster, profile, TrainConfig(batch_size=8))


def test_plan_marks_the_stages_on_outbound_only_nodes_as_status_does():
    # was: fedpipe plan's table said nothing of a relayed node, fedpipe status did
    rows = {line.split()[2]: line for line in _plan_table(relayed=1).splitlines()
            if line.startswith("0 ")}
    assert re.search(rf"node-1 +outbound-only via {re.escape(RELAY)} +1 +2-3 ",
                     rows["node-1"])  # then no site, 1 TFLOP/s, its layers
    assert re.search(r"node-0 +direct +1 +0-1 ", rows["node-0"])
    view = job_dict(Source(relayed=1), "j")
    assert f"outbound-only via {RELAY}" == view["plan"]["groups"][0][1]["reach"]  # one wording


def test_plan_leaves_the_column_out_when_every_stage_is_reached_directly():
    text = _plan_table(relayed=None)
    assert "reach" not in text and "direct" not in text
    assert re.search(r"^0 +1 +node-1 +1 +2-3 ", text, re.M)
