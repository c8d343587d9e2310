"""Fuzz every RPC of a real swarm (or its nodes' socket data ports), then train a job on it.

Starts a LocalSwarm (a tracker and ``--nodes`` node processes on 127.0.0.1),
makes ``--calls`` malformed calls with :mod:`fedpipe.testing.fuzz` (random
bytes, random field values, truncated and oversized messages, hostile wire
frames) to the tracker and every node, then trains the digits MLP across the
same processes and prints its final loss. Prints the calls, the count of
each outcome and status code, each crash and hang, and the load average.

``--data-port``: instead, ``--calls`` hostile record sequences
(:mod:`fedpipe.testing.fuzzdata`) to every node's socket data port, each node
probed after each (alive, gRPC Ping, a probe tensor over a good connection);
``--tls``: the swarm over mutual TLS, the sequences from a node's and a
client's certificate. The nodes' first-record deadline is ``--first-record``
seconds (``FEDPIPE_DATA_FIRST_RECORD``), so stalled connections end quickly.

Exit status: 0 when there were no crashes and no hangs and the job succeeded,
1 otherwise.

    python benchmarks/fuzz.py --calls 10000
    python benchmarks/fuzz.py --data-port --calls 10000 [--tls]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import torch
from torch import nn

import fedpipe
from fedpipe.examples import digits
from fedpipe.security import certs
from fedpipe.testing import LocalSwarm, fuzz, fuzzdata


def logged_errors(log: str) -> collections.Counter:
    """ERROR lines of a process's log, by logger and message (numbers and quoted values
    replaced, so the same error counts once)."""
    out: collections.Counter = collections.Counter()
    for m in re.finditer(r" ERROR (\S+): (.*)", log):
        text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", m.group(2))
        out[f"{m.group(1)}: {re.sub(r'-?[0-9][0-9.e+-]*', 'N', text)[:110]}"] += 1
    return out


def train(swarm: LocalSwarm, steps: int) -> fedpipe.client.job.JobStatus:
    """Train the digits MLP over every node of ``swarm`` for ``steps`` steps; its final status."""
    x, y, _, _ = digits.load()
    torch.manual_seed(0)
    client = swarm.client()
    job = client.submit(digits.make_model(hidden=32), nn.functional.cross_entropy,
                        fedpipe.optimizer(torch.optim.AdamW, lr=3e-3),
                        digits.batches(x, y, 32), steps=steps, microbatches=2,
                        stages=swarm.n_nodes, replicas=1)
    return job.wait(timeout=300, progress=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=4, help="calls in flight at once")
    ap.add_argument("--deadline", type=float, default=10.0, help="each call's deadline, s")
    ap.add_argument("--steps", type=int, default=30, help="steps of the job trained afterwards")
    ap.add_argument("--data-port", action="store_true",
                    help="fuzz the nodes' socket data ports instead of the RPCs")
    ap.add_argument("--tls", action="store_true", help="the swarm over mutual TLS")
    ap.add_argument("--first-record", type=float, default=1.0,
                    help="--data-port: the nodes' first-record deadline, s")
    args = ap.parse_args()

    if args.data_port:
        os.environ["FEDPIPE_DATA_FIRST_RECORD"] = str(args.first_record)
    with LocalSwarm(n_nodes=args.nodes, tls=args.tls) as swarm:
        def progress(r: fuzz.Report) -> None:
            if r.calls % 1000 < 100:
                print(f"  {r.calls} calls, {r.seconds:.0f} s, crashes {len(r.crashes)}, "
                      f"hangs {len(r.hangs)}, load {os.getloadavg()[0]:.1f}", flush=True)

        if args.data_port:
            report, left = fuzz_data_ports(swarm, args, progress), []
        else:
            report, left = fuzz_rpcs(swarm, args, progress)
        print(report.summary())
        print("calls by method and mutation:")
        for line in fuzz.iter_lines(report):
            print("  " + line)
        print("one answer per method and status code:")
        for (name, code), details in sorted(report.examples.items()):
            print(f"  {name:14} {code:20} {details!r}")
        for what, proc in [("tracker", swarm.tracker_proc),
                           *((f"node{i}", p) for i, p in enumerate(swarm.nodes))]:
            log = swarm.log(proc)
            errors = logged_errors(log)
            print(f"{what}'s log: {log.count('Traceback')} tracebacks, "
                  f"{sum(errors.values())} ERROR lines:")
            for line, n in errors.most_common(12):
                print(f"  {n:5}  {line}")
        for job in left:
            print(f"could not cancel fuzzed job {job}")
        t0 = time.monotonic()
        status = train(swarm, args.steps)
        print(f"after fuzzing, a {args.steps}-step digits job: {status.state} "
              f"({status.reason}), final loss {status.loss:.4f}, "
              f"{time.monotonic() - t0:.1f} s")
    load = os.getloadavg()
    print(f"calls {report.calls}, crashes {len(report.crashes)}, hangs {len(report.hangs)}, "
          f"slow calls {len(report.deadlines)}; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} on {os.cpu_count()} CPUs")
    ok = not report.crashes and not report.hangs and status.state == "SUCCEEDED"
    return 0 if ok else 1


def fuzz_rpcs(swarm: LocalSwarm, args, progress) -> tuple[fuzz.Report, list[str]]:
    """``args.calls`` malformed calls to every RPC of the swarm; the report, and the fuzzed
    jobs that could not be cancelled."""
    targets = fuzz.swarm_targets(swarm)
    print(f"fuzzing {', '.join(t.name for t in targets)}: "
          f"{sum(len(t.methods) for t in targets)} RPCs, seed {args.seed}", flush=True)
    with fuzz.Fuzzer(targets, seed=args.seed, deadline=args.deadline) as fz:
        report = fz.run(args.calls, workers=args.workers, progress=progress)
        return report, fz.cleanup()


def fuzz_data_ports(swarm: LocalSwarm, args, progress) -> fuzz.Report:
    """``args.calls`` hostile record sequences to the nodes' socket data ports."""
    hostile, probe = [], None
    if args.tls:
        hostile = [swarm.issue(certs.Role.NODE, "fuzz-node"),
                   swarm.issue(certs.Role.CLIENT, "fuzz-client")]
        probe = swarm.issue(certs.Role.NODE, fuzzdata.PROBE_NAME)
    targets = fuzzdata.data_targets(swarm, hostile, probe)
    print(f"fuzzing the data ports of {', '.join(f'{t.name} ({t.address})' for t in targets)}"
          f"{' over mutual TLS' if args.tls else ''}: {len(fuzzdata.Records.CASES)} kinds of "
          f"hostile sequence, seed {args.seed}, first-record deadline {args.first_record} s",
          flush=True)
    with fuzzdata.DataFuzzer(targets, seed=args.seed, deadline=args.deadline) as fz:
        return fz.run(args.calls, workers=args.workers, progress=progress)


if __name__ == "__main__":
    sys.exit(main())
