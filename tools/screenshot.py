#!/usr/bin/env python3
"""Take a screenshot of fedpipe's dashboard with headless chromium.

Either of a running dashboard::

    python tools/screenshot.py --url http://127.0.0.1:8080/ -o docs/dashboard.png

or of a demo of its own: a LocalSwarm of ``--nodes`` node processes trains the
digits MLP one stage per node, the dashboard serves the swarm's tracker
database, and the picture is taken once ``--steps-before`` steps are done::

    python tools/screenshot.py -o docs/dashboard.png

Needs chromium (tools/setup-test-deps.sh installs it).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedpipe.observe import browser  # noqa: E402


def demo_shot(out: Path, nodes: int, steps_before: int, size: tuple[int, int]) -> None:
    import torch
    from torch import nn

    import fedpipe
    from fedpipe.examples import digits
    from fedpipe.observe.metrics import tracker_registry
    from fedpipe.testing import LocalSwarm
    from fedpipe.tracker.http import start_http
    from fedpipe.tracker.store import Store

    x, y, _, _ = digits.load()
    print(f"starting a tracker and {nodes} nodes ...", flush=True)
    with LocalSwarm(n_nodes=nodes) as swarm:
        job = swarm.client().submit(digits.make_model(), nn.functional.cross_entropy,
                                    fedpipe.optimizer(torch.optim.AdamW, lr=3e-3),
                                    digits.batches(x, y, 64), steps=400, microbatches=4,
                                    schedule="1f1b", stages=nodes, name="digits-mlp")
        while (st := job.status()).step < steps_before:
            if st.state in ("FAILED", "CANCELLED", "SUCCEEDED"):
                raise SystemExit(f"job {job.id} ended before the picture: {st}")
            time.sleep(0.5)
        store = Store(swarm.db)
        served = start_http(store, registry=tracker_registry(store))
        try:
            print(f"dashboard at {served.url}/ ; job {job.id} at step {job.status().step}")
            browser.screenshot(f"{served.url}/#job={job.id}", out, size=size, budget_ms=8000)
        finally:
            served.close()
            job.cancel("screenshot taken")
            store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", default="docs/dashboard.png", help="PNG to write")
    p.add_argument("--url", help="a running dashboard (default: start a demo swarm)")
    p.add_argument("--nodes", type=int, default=3, help="demo: node processes")
    p.add_argument("--steps-before", type=int, default=60,
                   help="demo: steps done before the picture")
    p.add_argument("--size", default="1280x1700", help="window WIDTHxHEIGHT in pixels")
    args = p.parse_args(argv)
    w, h = (int(v) for v in args.size.lower().split("x"))
    out = Path(args.output)
    if args.url:
        browser.screenshot(args.url, out, size=(w, h), budget_ms=8000)
    else:
        demo_shot(out, args.nodes, args.steps_before, (w, h))
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
