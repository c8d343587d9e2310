"""``fedpipe status`` and the dashboard's API show which stages recompute (issue 22,
item 4): the plan's ``StageAssignment.recompute``, per stage, as the tracker serves it
(``GetJob``) through the same views ``fedpipe status`` and ``/api/jobs/ID`` use. The
dashboard page's column is checked in tests/test_dashboard.py (a browser renders it)."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from fedpipe.observe.status import job_dict, job_renderable
from fedpipe.proto import node_pb2, tracker_pb2

pytestmark = pytest.mark.timeout(60)


class Source:
    """What GetJob serves, as ``fedpipe status`` reads it over gRPC: a running job whose
    plan's auto recomputation chose stage 1 of each replica group only."""

    def __init__(self, recompute: tuple[bool, ...]):
        self.info = tracker_pb2.JobInfo(
            job_id="j", name="net", state=tracker_pb2.JOB_STATE_RUNNING, steps=10,
            plan=node_pb2.Plan(stages=[node_pb2.StageAssignment(
                replica=r, stage=k, node_id=f"n{r}{k}", node_name=f"node-{r}{k}",
                address=f"127.0.0.1:{7000 + 10 * r + k}", layer_start=2 * k,
                layer_end=2 * k + 2, activation_codec="int8", gradient_codec="bf16",
                recompute=on)
                for r in range(2) for k, on in enumerate(recompute)]))

    def job(self, job_id):
        return self.info

    def events(self, job_id, after_seq):
        return []


def _rows(view: dict) -> dict[str, str]:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(job_renderable(view))
    return {name: line for line in out.getvalue().splitlines()
            for name in (f"node-{r}{k}" for r in range(2) for k in range(3))
            if f" {name} " in line}


def test_status_shows_which_stages_recompute():
    view = job_dict(Source((False, True, False)), "j")
    assert [[st["recompute"] for st in g] for g in view["plan"]["groups"]] == \
        [[False, True, False]] * 2
    rows = _rows(view)
    assert len(rows) == 6
    for name, row in rows.items():
        cells = row.split()
        after_codecs = cells[cells.index("int8") + 3]  # "int8 / bf16", then recompute
        assert after_codecs == ("yes" if name.endswith("1") else "no"), row


def test_status_leaves_the_column_out_when_no_stage_recomputes():
    view = job_dict(Source((False, False, False)), "j")
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(job_renderable(view))
    assert "recompute" not in out.getvalue()
    assert all(not st["recompute"] for g in view["plan"]["groups"] for st in g)
