#!/usr/bin/env python3
"""Take a screenshot of fedpipe's dashboard with headless chromium.

Either of a running dashboard::

    python tools/screenshot.py --url http://127.0.0.1:8080/ -o docs/dashboard.png

or of the demo: ``fedpipe demo --keep`` starts a tracker with its dashboard and
``--nodes`` node processes and trains the digits MLP one stage per node; the
picture is taken once ``--steps-before`` steps are done, while it trains. With
``--plot`` and ``--plan`` the demo job's curves (``fedpipe plot``) and a drawing
of the plan the swarm gives the digits MLP (``fedpipe plan --draw``) are made too,
once the job is over::

    python tools/screenshot.py -o docs/dashboard.png --plot docs/demo-job.png \
        --plan docs/demo-plan.png

Needs chromium (tools/setup-test-deps.sh installs it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedpipe.observe import browser  # noqa: E402
from fedpipe.proc import child_env, free_port  # noqa: E402

DEMO_SECONDS = 900.0
"""How long the demo may take to reach each point, seconds (a loaded 2-core machine is slow)."""


def _api(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def _fedpipe(*args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "fedpipe", *args], capture_output=True,
                         text=True, timeout=300, env=child_env(), cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"fedpipe {args[0]} failed: {out.stderr}")
    print(out.stdout.strip(), flush=True)


def demo_shot(out: Path, nodes: int, steps_before: int, size: tuple[int, int],
              steps: int, plot: Path | None, plan: Path | None) -> None:
    """Run ``fedpipe demo --keep``, screenshot its dashboard mid-training, then draw the
    job's curves and the plan, and stop the demo."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile(mode="w+")
    demo = subprocess.Popen([sys.executable, "-m", "fedpipe", "demo", "--keep", "--nodes",
                             str(nodes), "--steps", str(steps), "--http-port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)

    def output() -> str:
        log.seek(0)
        return log.read()

    def wait_for(what: str, ready) -> object:
        deadline = time.monotonic() + DEMO_SECONDS
        while time.monotonic() < deadline:
            if demo.poll() is not None:
                raise SystemExit(f"the demo exited ({demo.returncode}) before {what}:\n"
                                 f"{output()}")
            try:
                got = ready()
            except OSError:  # the dashboard is not up yet
                got = None
            if got:
                return got
            time.sleep(0.5)
        raise SystemExit(f"no {what} within {DEMO_SECONDS} s:\n{output()}")

    try:
        print(f"starting fedpipe demo --keep with {nodes} nodes ...", flush=True)

        def running_job():
            jobs = _api(url, "/api/jobs")["jobs"]
            if jobs and jobs[0]["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                raise SystemExit(f"job {jobs[0]['id']} ended before the picture: {jobs[0]}")
            return jobs[0] if jobs and jobs[0]["step"] >= steps_before else None

        job = wait_for(f"a job at step {steps_before}", running_job)["id"]
        step = _api(url, "/api/jobs")["jobs"][0]["step"]
        print(f"dashboard at {url}/ ; job {job} at step {step}", flush=True)
        browser.screenshot(f"{url}/#job={job}", out, size=size, budget_ms=8000)
        print(f"wrote {out} ({out.stat().st_size} bytes)", flush=True)
        if plot is None and plan is None:
            return
        wait_for("the end of the demo's training",
                 lambda: "the swarm stays up until Ctrl-C" in output())
        tracker = re.search(r"tracker at (\S+);", output()).group(1)
        _draw(tracker, job, nodes, plot, plan)
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)  # the demo stops its swarm on Ctrl-C
            try:
                demo.wait(60)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait()


def _draw(tracker: str, job: str, nodes: int, plot: Path | None, plan: Path | None) -> None:
    """Draw ``job``'s curves to ``plot`` and the digits model's plan over ``nodes`` stages to
    ``plan`` (each when not None), with ``fedpipe plot`` and ``fedpipe plan --draw``."""
    if plot is not None:
        _fedpipe("plot", "--tracker", tracker, job, "-o", str(plot))
    if plan is not None:
        from fedpipe.client.profile import profile_json
        from fedpipe.examples import digits

        x, _, _, _ = digits.load()
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(profile_json(digits.make_model(), x[:64]), f)
        try:
            _fedpipe("plan", "--tracker", tracker, "--model", f.name, "--stages",
                     str(nodes), "--draw", str(plan))
        finally:
            os.unlink(f.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", default="docs/dashboard.png", help="PNG to write")
    p.add_argument("--url", help="a running dashboard (default: start a demo swarm)")
    p.add_argument("--nodes", type=int, default=3, help="demo: node processes")
    p.add_argument("--steps-before", type=int, default=60,
                   help="demo: steps done before the picture")
    p.add_argument("--steps", type=int, default=600, help="demo: steps the job trains for")
    p.add_argument("--plot", type=Path, help="demo: also draw the job's curves here")
    p.add_argument("--plan", type=Path, help="demo: also draw the swarm's plan here")
    p.add_argument("--size", default="1280x1700", help="window WIDTHxHEIGHT in pixels")
    args = p.parse_args(argv)
    w, h = (int(v) for v in args.size.lower().split("x"))
    out = Path(args.output)
    if args.url:
        browser.screenshot(args.url, out, size=(w, h), budget_ms=8000)
        print(f"wrote {out} ({out.stat().st_size} bytes)")
    else:
        demo_shot(out, args.nodes, args.steps_before, (w, h), args.steps, args.plot, args.plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
