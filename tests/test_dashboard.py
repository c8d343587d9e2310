"""The dashboard against a real tracker: a LocalSwarm trains the digits MLP over gRPC,
the dashboard serves a second reader of the tracker's SQLite file, and headless
chromium renders the page. The job is held at a known step (its data stops coming),
so the API, GetJob, the page and the metrics all describe the same moment.

A missing chromium fails the browser test: tools/setup-test-deps.sh installs it.
"""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.observe import browser
from fedpipe.observe.metrics import tracker_registry
from fedpipe.proto import tracker_pb2
from fedpipe.testing import LocalSwarm
from fedpipe.tracker.http import start_http
from fedpipe.tracker.store import Store

pytestmark = pytest.mark.timeout(240)
HELD_AT = 4
STATIC = Path(fedpipe.__file__).parent / "tracker" / "static"


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def running():
    """(swarm, job, dashboard): a 2-stage job RUNNING, held after step HELD_AT."""
    hold = threading.Event()
    x, y, _, _ = digits.load()

    def data():
        for i, batch in enumerate(digits.batches(x, y, 32)):  # endless
            if i == HELD_AT:
                hold.wait()
            yield batch

    with LocalSwarm(n_nodes=2) as swarm:
        client = swarm.client()
        job = client.submit(digits.make_model(hidden=32), nn.functional.cross_entropy,
                            fedpipe.optimizer(torch.optim.AdamW, lr=3e-3), data(), steps=50,
                            microbatches=2, stages=2)
        deadline = time.monotonic() + 120
        while job.status().step < HELD_AT:
            assert job.status().state in ("PENDING", "PLANNING", "DEPLOYING", "RUNNING"), \
                job.status()
            assert time.monotonic() < deadline, f"job did not reach step {HELD_AT}"
            time.sleep(0.2)
        time.sleep(1.0)  # nothing more can come: the feeder waits on `hold`
        store = Store(swarm.db)  # a second reader of the tracker's WAL database
        served = start_http(store, registry=tracker_registry(store))
        try:
            yield swarm, job, served
        finally:
            served.close()
            job.cancel("test over")
            hold.set()
            store.close()


def test_the_held_job_is_running_at_its_step(running):
    _, job, _ = running
    st = job.status()
    assert (st.state, st.step) == ("RUNNING", HELD_AT)


def test_api_nodes_match_the_trackers_list_nodes(running):
    swarm, _, served = running
    reply = swarm.client().stub.ListNodes(tracker_pb2.ListNodesRequest(include_lost=True),
                                          timeout=10)
    api = get(served.url + "/api/nodes")
    assert [(n["id"], n["name"], n["address"], n["alive"], n["flops"], n["memory_bytes"],
             n["device"]) for n in api["nodes"]] == \
        [(n.node_id, n.name, n.address, n.alive, n.resources.flops, n.resources.memory_bytes,
          n.resources.device) for n in reply.nodes]
    assert len(api["nodes"]) == 2 and api["totals"]["alive"] == 2
    assert api["totals"]["flops"] == pytest.approx(sum(n.resources.flops for n in reply.nodes))
    pairs = {(m.src_id, m.dst_id): m.bandwidth for m in reply.links}
    ids = api["matrix"]["ids"]
    for i, a in enumerate(ids):
        for j, b in enumerate(ids):
            assert api["matrix"]["bandwidth"][i][j] == pairs.get((a, b))
    assert len(pairs) == 2  # both directions measured


def test_api_job_matches_get_job_and_its_events(running):
    swarm, job, served = running
    info = swarm.client().stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=10)
    api = get(f"{served.url}/api/jobs/{job.id}")
    assert (api["id"], api["state"], api["reason"], api["step"], api["steps"]) == \
        (info.job_id, "RUNNING", info.reason, info.step, info.steps)
    assert api["loss"] == info.loss
    assert api["step_seconds"]["predicted"] == info.plan.predicted_step_seconds
    assert api["step_seconds"]["measured"] > 0
    stages = [s for g in api["plan"]["groups"] for s in g]
    assert [(s["replica"], s["stage"], s["node_id"], s["node_name"], s["layer_start"],
             s["layer_end"], s["activation_codec"], s["gradient_codec"]) for s in stages] == \
        [(a.replica, a.stage, a.node_id, a.node_name, a.layer_start, a.layer_end,
          a.activation_codec, a.gradient_codec)
         for a in sorted(info.plan.stages, key=lambda a: (a.replica, a.stage))]
    assert len(stages) == 2 and all(s["predicted_compute"] > 0 for s in stages)
    assert sum(s["bottleneck"] for s in stages) == 1
    assert api["config"]["batch_size"] == 32 and api["config"]["microbatches"] == 2
    # the history is the tracker's step events, one per step so far
    steps = [(h["step"], h["loss"], h["samples_per_second"]) for h in api["history"]]
    assert [s for s, _, _ in steps] == list(range(1, HELD_AT + 1))
    assert steps[-1][1] == info.loss and all(sps > 0 for _, _, sps in steps)
    assert [e["state"] for e in api["events"]] == ["PENDING", "PLANNING", "DEPLOYING", "RUNNING"]
    assert api["samples_per_second"] == steps[-1][2]
    listed = get(served.url + "/api/jobs")["jobs"]
    assert [(j["id"], j["state"], j["step"], j["loss"]) for j in listed] == \
        [(job.id, "RUNNING", info.step, info.loss)]
    newer = get(f"{served.url}/api/jobs/{job.id}?after_seq={api['history'][1]['seq']}")
    assert [h["step"] for h in newer["history"]] == list(range(3, HELD_AT + 1))


class _Ids(HTMLParser):
    """Text and attributes of the elements with an id, and counts of some tags."""

    def __init__(self):
        super().__init__()
        self.attrs: dict[str, dict] = {}
        self.text: dict[str, str] = {}
        self.stack: list[str | None] = []
        self.body: dict = {}
        self.tags: dict[str, int] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag == "body":
            self.body = a
        if "id" in a:
            self.attrs[a["id"]] = a
            self.text.setdefault(a["id"], "")
        if tag not in ("meta", "link", "br", "img", "input"):
            self.stack.append(a.get("id"))

    def handle_endtag(self, tag):
        if self.stack and tag not in ("meta", "link", "br", "img", "input"):
            self.stack.pop()

    def handle_data(self, data):
        for i in self.stack:
            if i:
                self.text[i] += data


def test_chromium_renders_the_running_job_with_the_apis_figures(running):
    _, job, served = running
    api = get(f"{served.url}/api/jobs/{job.id}")
    nodes = get(served.url + "/api/nodes")
    dom = browser.dump_dom(f"{served.url}/#job={job.id}", budget_ms=8000)
    page = _Ids()
    page.feed(dom)
    assert page.body.get("data-ready") == "1", (page.body, dom[-2000:])
    assert "data-error" not in page.body
    assert page.text["job-id"] == job.id
    assert page.attrs["job-state"]["data-value"] == api["state"] == "RUNNING"
    assert page.text["job-state"] == "RUNNING"
    assert page.attrs["job-step"]["data-value"] == str(api["step"]) == str(HELD_AT)
    assert page.text["job-step"] == f"{api['step']} / {api['steps']}"
    assert float(page.attrs["job-loss"]["data-value"]) == api["loss"]
    assert page.text["job-loss"] == f"{api['loss']:.4f}"
    assert float(page.attrs["job-sps"]["data-value"]) == api["samples_per_second"]
    assert page.text["job-reason"] == api["reason"]
    # the swarm table has a row per node, and the plan one box per stage
    assert len(re.findall(r'<tr data-node="', dom)) == len(nodes["nodes"]) == 2
    assert len(re.findall(r'data-stage="\d+-\d+"', dom)) == 2
    assert dom.count('class="box bottleneck"') == 1
    assert len(re.findall(r'<rect [^>]*fill="hsl', dom)) == 2  # two measured links
    assert re.search(r'<polyline class="curve" points="[^"]+"', dom)


def test_the_page_fetches_nothing_from_the_internet():
    for name in ("index.html", "app.js", "style.css"):
        text = (STATIC / name).read_text()
        urls = set(re.findall(r"https?://[^\s\"')]+", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)
        assert "@import" not in text and "cdn" not in text.lower()


def test_the_metrics_on_the_dashboard_port_agree_with_the_job(running):
    swarm, job, served = running
    info = swarm.client().stub.GetJob(tracker_pb2.GetJobRequest(job_id=job.id), timeout=10)
    text = urllib.request.urlopen(served.url + "/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("fedpipe_job_step", (("job", job.id),))] == info.step == HELD_AT
    assert samples[("fedpipe_job_loss", (("job", job.id),))] == info.loss
    assert samples[("fedpipe_job_step_seconds", (("job", job.id), ("kind", "predicted")))] == \
        info.plan.predicted_step_seconds
    alive = [v for (name, _), v in samples.items() if name == "fedpipe_node_alive"]
    assert alive == [1.0, 1.0]


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(running):
    _, job, served = running
    for path, code, pattern in (("/api/jobs/nosuchjob", 404, "no job 'nosuchjob'"),
                                ("/api/jobs/bad%20id!", 400, "a job id is"),
                                ("/api/jobs?limit=0", 400, "limit must be 1..1000"),
                                (f"/api/jobs/{job.id}?after_seq=x", 400, "after_seq must be"),
                                ("/static/../../etc/passwd", 404, "no such"),
                                ("/nowhere", 404, "no such path")):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(served.url + path, timeout=10)
        assert err.value.code == code, path
        assert pattern in json.loads(err.value.read())["error"], path
    assert get(f"{served.url}/api/jobs/{job.id}")["step"] == HELD_AT
