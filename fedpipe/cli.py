"""`fedpipe` command line: tracker, node, relay, submit, status, plot, plan, demo."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import grpc

from .cli_args import (TRACKER_HELP, address_arg, compression_arg, cut_indices, dashboard_arg,
                       gradient_compression_arg, insecure_arg, metrics_args, non_negative,
                       settle_staleness, tls as _tls, tls_args, tracker_target)
from .cli_node import add_cli as add_node_cli
from .observe.serving import LOCALHOST


DEMO_MICROBATCHES, DEMO_SCHEDULE = 4, "1f1b"
"""``fedpipe demo``'s own defaults: its stages, one per node, overlap on several
microbatches. ``fedpipe submit`` and ``fedpipe plan`` take ``submit()``'s
(:data:`fedpipe.spec.MICROBATCHES`, :attr:`fedpipe.spec.Training.schedule`)."""


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _client(args):
    """A :class:`~fedpipe.client.Client` of ``--tracker`` with ``--tls-dir``/``--tls-name``."""
    from .client import Client

    return Client(args.tracker, tls=_tls(args, None))


def cmd_tracker(args) -> int:
    import threading
    import signal

    from .net import timeouts
    from .tracker.leader import LEASE as LEADER_LEASE
    from .tracker.service import serve
    from .tracker.store import StoreError

    tls = _tls(args, "tracker")
    store = args.store or args.db
    leader_lease = args.leader_lease
    if leader_lease is None:  # several trackers share a PostgreSQL database, not a file
        leader_lease = LEADER_LEASE if store.startswith(("postgresql:", "postgres:")) else 0.0
    try:
        srv, service, port = serve(args.host, args.port, store, args.lease,
                                   args.link_refresh, tls=tls, insecure=args.insecure,
                                   max_job_bytes=args.max_job_bytes,
                                   heartbeat_rate=args.heartbeat_rate, freeze_heap=True,
                                   retention=args.retention,
                                   rebalance_threshold=args.rebalance_threshold,
                                   leader_lease=leader_lease, advertise=args.advertise)
    except StoreError as e:
        print(f"fedpipe tracker: {e}", file=sys.stderr)
        return 2
    print(f"fedpipe tracker listening on {args.host}:{port} ({service.store.where}"
          f"{', mutual TLS as ' + str(tls.identity) if tls else ', plaintext'})", flush=True)
    if leader_lease:
        print(f"fedpipe tracker {'leads' if service.tracker else 'stands by'} (leader lease "
              f"{leader_lease:g} s)", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    _observe_while_leading(service, args, done)
    service.close()
    srv.stop(grace=timeouts.SERVER_GRACE).wait()
    service.store.close()
    return 0


def _observe_while_leading(service, args, done) -> None:
    """Serve the dashboard and metrics (:func:`_observe_tracker`) while this tracker
    leads, from its start or from a takeover, closing them when it is deposed (a
    standby's would show a stale state); look every ``OBSERVE_LEADER`` seconds until
    ``done`` is set. A port that cannot be bound at a takeover is logged, not raised (the
    tracker leads on without them); at the start it is raised, as a bad argument is."""
    from .net import timeouts

    observed, served, first = None, [], True
    while True:
        tracker = service.tracker
        if tracker is not observed:
            for http in served:
                http.close()
            served, observed = [], tracker
            if tracker is not None:
                tracker.freeze_heap(force=True)  # imports and the state loaded: long-lived
                try:
                    served = _observe_tracker(tracker, args)
                except OSError as e:
                    if first:
                        raise
                    logging.getLogger("fedpipe.tracker").error(
                        "the dashboard or metrics port cannot be bound after the takeover: "
                        "%s", e)
        first = False
        if done.wait(timeouts.OBSERVE_LEADER):
            break
    for http in served:
        http.close()


def _observe_tracker(tracker, args) -> list:
    """Serve the dashboard (``--http-port``) and the Prometheus metrics
    (``--metrics-port``) of a running tracker, each when its port is not 0; print
    where. Returns the servers, for the caller to close."""
    if not (args.http_port or args.metrics_port):
        return []
    from .observe.metrics import start_metrics, tracker_registry
    from .observe.source import Histories
    from .tracker.http import TrackerSource, start_http

    source = TrackerSource(tracker.store, tracker.stage_times,
                           tracker.feeders, tracker.registry)
    histories = Histories(source)  # shared, so each event is read once
    registry = tracker_registry(source, histories)
    served = []
    if args.http_port:
        served.append(start_http(source, args.http_host, args.http_port, registry=registry,
                                 histories=histories))
        print(f"fedpipe tracker dashboard at {served[-1].url}/", flush=True)
    if args.metrics_port:
        served.append(start_metrics(registry, args.metrics_port, args.metrics_host))
        print(f"fedpipe tracker metrics at {served[-1].url}/metrics", flush=True)
    return served


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text}")
    return value


def cmd_status(args) -> int:
    """``fedpipe status [JOB] [--watch]``: the swarm, or one job with its plan, per-stage
    timings and event log, in the terminal (``--json``: once, machine-readable: the same
    views from a tracker as from its dashboard's API)."""
    import contextlib

    from .observe import status
    from .observe.source import GrpcSource

    with contextlib.ExitStack() as stack:
        views: status.Views
        if args.dashboard:
            views = status.HttpSource(args.dashboard)
        else:
            client = stack.enter_context(_client(args))
            views = status.SourceViews(GrpcSource(client.stub, tracker=args.tracker))
        if args.json:
            print(json.dumps(views.job_dict(args.job) if args.job else views.swarm_dict(),
                             indent=1))
        else:
            status.run_status(views, args.job, watch=args.watch, interval=args.interval)
    return 0


def cmd_plot(args) -> int:
    """``fedpipe plot JOB -o FILE``: the job's loss and throughput curves."""
    from .observe.plots import plot_job
    from .observe.source import GrpcSource

    with _client(args) as client:
        plot_job(GrpcSource(client.stub, tracker=args.tracker), args.job, args.output)
    print(f"wrote {args.output}")
    return 0


def cmd_plan(args) -> int:
    """``fedpipe plan``: the plan a job would get over a cluster file or a live swarm, its
    predicted step time and samples/s; ``--cuts`` pins its stage boundaries (and, without
    ``--stages``, its depth)."""
    from . import planner
    from .planner import jsonio

    def load(path):
        with open(path) as f:
            return json.load(f)

    profile = jsonio.profile_from_json(load(args.model))
    stages, problem = _pinned(args, len(profile.layers))
    if problem:
        print(f"fedpipe plan: {problem}", file=sys.stderr)
        return 2
    if args.cluster:
        cluster = jsonio.cluster_from_json(load(args.cluster))
    else:
        from .net import timeouts
        from .proto import tracker_pb2
        from .planner.protoio import cluster_view

        with _client(args) as client:
            reply = client.stub.ListNodes(tracker_pb2.ListNodesRequest(),
                                          timeout=timeouts.CONTROL_RPC)
        cluster = cluster_view(list(reply.nodes), list(reply.links))
    config = planner.TrainConfig(batch_size=args.batch, microbatches=args.microbatches,
                                 schedule=args.schedule, max_staleness=args.max_staleness,
                                 stages=stages, cuts=args.cuts, compression=args.compression,
                                 gradient_compression=args.gradient_compression,
                                 recompute=args.recompute, precision=args.precision)
    plan = planner.make_plan(cluster, profile, config)
    if args.json:  # with the settings it was planned for, as the table's first line says
        print(json.dumps({**jsonio.plan_to_json(plan), "precision": config.precision,
                          "recompute": config.recompute}, indent=1))
    else:
        print(jsonio.format_plan(plan, cluster, profile, config))
    if args.draw:
        from .observe.plots import draw_plan
        from .observe.views import plan_layout

        draw_plan(plan_layout(plan, cluster=cluster, profile=profile, config=config), args.draw)
        print(f"wrote {args.draw}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _pinned(args, n_layers: int) -> tuple[int, str | None]:
    """``(stages, problem)``: the depth ``--stages`` and ``--cuts`` pin (the cuts' count
    plus one unless ``--stages`` is given; 0: the planner chooses), and what is wrong with
    the cuts for a model of ``n_layers`` top-level children, naming the flag
    (:func:`fedpipe.spec.cuts_problem`, Placement's rule), or None."""
    from .spec import cuts_problem

    stages = args.stages or (len(args.cuts) + 1 if args.cuts else 0)
    problem = cuts_problem(args.cuts, stages, n_layers)
    return stages, (f"--cuts {','.join(map(str, args.cuts))}: {problem}" if problem else None)


def cmd_cancel(args) -> int:
    with _client(args) as client:
        print(client.job(args.job).cancel(args.reason))
    return 0


def cmd_drain(args) -> int:
    """``fedpipe drain NODE``: the node's stages move away at the next step boundary and it
    exits once no job needs it (under TLS, an admin certificate's call)."""
    with _client(args) as client:
        reply = client.drain(args.node)
    jobs = ", ".join(reply.jobs) or "none"
    print(f"draining {reply.node.name} ({reply.node.node_id}); jobs handing over: {jobs}")
    return 0


def cmd_submit(args) -> int:
    """``fedpipe submit``: train the digits example on a swarm; ``--cuts`` pins its stage
    boundaries as ``fedpipe plan --cuts`` does (refused before any call if they break
    Placement's rule for its model)."""
    from .examples import digits

    stages, problem = _pinned(args, len(digits.make_model()))
    if problem:
        print(f"fedpipe submit: {problem}", file=sys.stderr)
        return 2
    with _client(args) as client:
        digits.train(client, steps=args.steps, microbatches=args.microbatches,
                     schedule=args.schedule, max_staleness=args.max_staleness,
                     stages=stages, cuts=args.cuts,
                     compression=_compression(args), precision=args.precision,
                     recompute={"off": False, "on": True}.get(args.recompute, args.recompute))
    return 0


def _compression(args) -> dict[str, str]:
    return {"activations": args.compression,
            "gradients": args.gradient_compression or args.compression}


def cmd_demo(args) -> int:
    from .examples import digits
    from .proc import free_port
    from .swarm import LocalSwarm

    http_port = args.http_port or free_port()
    print(f"starting a tracker and {args.nodes} nodes on 127.0.0.1"
          f"{' over mutual TLS (a CA and certificates in a temp dir)' if args.tls else ''} ...",
          flush=True)
    with LocalSwarm(args.nodes, tracker_args=["--http-port", str(http_port)],
                    tls=args.tls) as swarm:
        client = swarm.client()  # closed with the swarm
        print(f"tracker at {swarm.tracker}; nodes: "
              + ", ".join(f"{n.name} ({n.address})" for n in client.nodes()), flush=True)
        print(f"dashboard at http://127.0.0.1:{http_port}/", flush=True)
        # the digits MLP is so small that one node would be fastest: the demo
        # pins one stage per node to show the pipeline
        acc = digits.train(client, steps=args.steps, microbatches=args.microbatches,
                           schedule=args.schedule, max_staleness=args.max_staleness,
                           stages=args.stages or args.nodes,
                           compression=_compression(args))
        if args.keep:
            _keep(swarm.tracker, http_port)
    print("swarm stopped.")
    return 0 if acc >= 0.95 else 1


def _keep(tracker: str, http_port: int) -> None:
    """``fedpipe demo --keep``: say how to look at the swarm, then wait for Ctrl-C."""
    import signal
    import threading
    import urllib.request

    url = f"http://127.0.0.1:{http_port}"
    with urllib.request.urlopen(f"{url}/api/jobs?limit=1", timeout=10) as r:
        jobs = json.loads(r.read())["jobs"]
    job = jobs[0]["id"] if jobs else "JOB"
    print(f"\nthe swarm stays up until Ctrl-C. Look at it:\n"
          f"  dashboard:  {url}/#job={job}\n"
          f"  terminal:   fedpipe status --tracker {tracker} {job}\n"
          f"  curves:     fedpipe plot --tracker {tracker} {job} -o {job}.png\n"
          f"  the plan:   fedpipe plan --tracker {tracker} --model PROFILE.json --draw plan.png",
          flush=True)
    done = threading.Event()
    # the swarm's processes are stopped by the caller; SIGTERM ends the wait like Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass


def parser() -> argparse.ArgumentParser:
    from .spec import PRECISIONS, RECOMPUTE, SCHEDULES, Training

    p = argparse.ArgumentParser(prog="fedpipe", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    client_name = "this client's certificate in --tls-dir (default: its only one)"

    t = sub.add_parser("tracker", help="run the tracker (control plane)")
    t.add_argument("--host", default="0.0.0.0")
    t.add_argument("--port", type=int, default=7070)
    where = t.add_mutually_exclusive_group()
    where.add_argument("--db", default="fedpipe-tracker.db",
                       help="SQLite file for the tracker's state")
    where.add_argument("--store", default=None, metavar="URL",
                       help="the tracker's state elsewhere: postgresql://USER@HOST:PORT/DBNAME "
                            "(the database must exist; its tables are made and migrated), "
                            "or memory: (lost at exit)")
    t.add_argument("--leader-lease", type=float, default=None, metavar="SECONDS",
                   help="share --store with other trackers: one leads through a lease of "
                        "this many seconds, the others stand by and take over when it "
                        "lapses (default: fedpipe.tracker.leader.LEASE, 5, for a "
                        "postgresql:// store; 0, the only tracker, otherwise)")
    t.add_argument("--advertise", type=address_arg, default=None, metavar="HOST:PORT",
                   help="the address standbys name to callers when this tracker leads "
                        "(default: --host:--port, 127.0.0.1 for 0.0.0.0)")
    t.add_argument("--lease", type=float, default=10.0,
                   help="seconds a node may go without a heartbeat before it is marked lost, "
                        "in a swarm below --heartbeat-rate * lease / 4 nodes (longer above)")
    t.add_argument("--heartbeat-rate", type=float, default=None,
                   help="most heartbeats per second asked of all nodes together; a larger "
                        "swarm is told to heartbeat less often (default: "
                        "fedpipe.tracker.registry.HEARTBEAT_RATE, 250)")
    t.add_argument("--retention", type=float, default=None,
                   help="seconds an ended job's stages keep their weights on the nodes "
                        "(for state_dict()) unless released sooner (default: "
                        "fedpipe.tracker.retention.RETENTION, 10 minutes)")
    t.add_argument("--rebalance-threshold", type=_fraction, default=0.10,
                   help="least fall of a running job's predicted step time (a fraction, "
                        "default 0.10) for which it migrates to a better assignment of "
                        "nodes; the time to move the state counts against the gain")
    t.add_argument("--link-refresh", type=float, default=300.0,
                   help="seconds between link re-measurements (0: only when nodes join)")
    t.add_argument("--http-port", type=int, default=0,
                   help="serve the dashboard and its JSON API on this port (0: off)")
    t.add_argument("--max-job-bytes", type=int, default=128 * 2**20,
                   help="the most bytes of layer code a submitted job may carry (weights "
                        "never pass through the tracker)")
    t.add_argument("--http-host", default=LOCALHOST,
                   help="address the dashboard binds (it has no authentication)")
    metrics_args(t)
    tls_args(t, "the tracker's certificate in --tls-dir (default: tracker)")
    insecure_arg(t)
    t.set_defaults(func=cmd_tracker)
    add_node_cli(sub)  # node and relay

    s = sub.add_parser("status", help="the swarm (nodes, links), or one job: its plan, "
                                      "per-stage timings and event log")
    where = s.add_mutually_exclusive_group(required=True)
    where.add_argument("--tracker", type=tracker_target, help=TRACKER_HELP)
    where.add_argument("--dashboard", type=dashboard_arg,
                       help="the tracker's dashboard URL (http://HOST:PORT, its --http-port), "
                            "instead of --tracker")
    s.add_argument("job", nargs="?", help="job id")
    s.add_argument("--watch", action="store_true", help="keep it live until Ctrl-C")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between redraws")
    s.add_argument("--json", action="store_true", help="machine-readable output, once")
    tls_args(s, client_name)
    s.set_defaults(func=cmd_status)

    o = sub.add_parser("plot", help="draw a job's loss and throughput curves")
    o.add_argument("--tracker", type=tracker_target, required=True, help=TRACKER_HELP)
    o.add_argument("job", help="job id")
    o.add_argument("-o", "--output", required=True, help="picture file (.png, .svg, .pdf)")
    tls_args(o, client_name)
    o.set_defaults(func=cmd_plot)

    def compression_args(q):
        q.add_argument("--compression", type=compression_arg, default="auto",
                       help="activation and gradient codec: auto, none or a codec spec")
        q.add_argument("--gradient-compression", type=gradient_compression_arg, default=None,
                       help="gradient codec, if not --compression's (e.g. topk:0.01)")

    def cuts_arg(q):
        q.add_argument("--cuts", type=cut_indices, default=(), metavar="C,C,...",
                       help="pin the stage boundaries: the child indices at which a stage "
                            "begins, as Placement(cuts=...) (e.g. 2,3,4: four stages, "
                            "children 0-1, 2, 3, 4-); --stages, if given, must be one more "
                            "than their count")

    def pipeline_args(q, microbatches: int, schedule: str, whose: str):
        """``--microbatches`` and ``--schedule``, defaulting to ``whose`` defaults."""
        q.add_argument("--microbatches", type=int, default=microbatches,
                       help=f"microbatches per step (default: %(default)s, {whose})")
        q.add_argument("--schedule", default=schedule, choices=SCHEDULES,
                       help=f"pipeline schedule (default: %(default)s, {whose}); async: "
                            "PipeDream-style, no flush, weight stashing")
        q.add_argument("--max-staleness", type=non_negative, default=None,
                       help="with --schedule async only: steps a forward may run ahead of "
                            f"the updates (default: {Training.max_staleness}, as submit()'s)")

    def memory_args(q):
        """``--recompute`` and ``--precision``, as ``submit()``'s ``recompute`` and
        ``precision`` (the planner prices both: memory, and compute and bytes)."""
        q.add_argument("--recompute", default="off", choices=RECOMPUTE,
                       help="activation recomputation: off, on (every stage keeps only its "
                            "inputs and re-runs its forward in backward), auto (the planner "
                            "turns it on where a stage would not fit otherwise); default off")
        q.add_argument("--precision", default="fp32", choices=PRECISIONS,
                       help="compute precision: fp32, or bf16-mixed (forward under autocast "
                            "to bfloat16; activations of half the bytes); default fp32")

    def train_args(q, microbatches: int, schedule: str, whose: str):
        q.add_argument("--steps", type=int, default=300)
        pipeline_args(q, microbatches, schedule, whose)
        compression_args(q)
        q.add_argument("--stages", type=int, default=None,
                       help="pipeline depth (default: submit lets the planner choose; "
                            "demo uses every node)")

    pl = sub.add_parser("plan", help="plan a model over a cluster file or a live swarm")
    where = pl.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help="cluster JSON (nodes and links; see README)")
    where.add_argument("--tracker", type=tracker_target,
                       help="plan over this tracker's live nodes and measured links ("
                            + TRACKER_HELP + ")")
    pl.add_argument("--model", required=True, help="model profile JSON (layers; see README)")
    pl.add_argument("--batch", type=int, default=64, help="samples per step")
    pipeline_args(pl, Training.microbatches, Training.schedule, "as submit()'s")
    pl.add_argument("--stages", type=int, default=None, help="pin the pipeline depth")
    cuts_arg(pl)
    compression_args(pl)
    memory_args(pl)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--draw", metavar="FILE", help="also draw the plan (.png, .svg, .pdf)")
    tls_args(pl, client_name)
    pl.set_defaults(func=cmd_plan)

    dr = sub.add_parser("drain", help="drain a node: its stages move to other nodes at the "
                                      "next step boundary, then it exits (admin)")
    dr.add_argument("--tracker", type=tracker_target, required=True, help=TRACKER_HELP)
    dr.add_argument("node", help="the node's name or id")
    tls_args(dr, "the admin certificate in --tls-dir (default: its only one)")
    dr.set_defaults(func=cmd_drain)

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("--tracker", type=tracker_target, required=True, help=TRACKER_HELP)
    c.add_argument("job", help="job id")
    c.add_argument("--reason", default="cancelled from the command line")
    tls_args(c, client_name)
    c.set_defaults(func=cmd_cancel)

    u = sub.add_parser("submit", help="train the built-in digits example on a swarm")
    u.add_argument("--tracker", type=tracker_target, required=True, help=TRACKER_HELP)
    train_args(u, Training.microbatches, Training.schedule,
               "as submit()'s and fedpipe plan's")
    cuts_arg(u)
    memory_args(u)
    tls_args(u, client_name)
    u.set_defaults(func=cmd_submit)

    d = sub.add_parser("demo", help="start a local swarm and train the digits example")
    d.add_argument("--nodes", type=int, default=3)
    d.add_argument("--keep", action="store_true",
                   help="keep the swarm up after training, for a look, until Ctrl-C")
    d.add_argument("--http-port", type=int, default=0,
                   help="the dashboard's port (0: any free one)")
    d.add_argument("--tls", action="store_true",
                   help="run the whole swarm over mutual TLS, with a CA made in a temp dir")
    train_args(d, DEMO_MICROBATCHES, DEMO_SCHEDULE, "the demo's, to show the pipeline at work")
    d.set_defaults(func=cmd_demo)

    from .security.certs import add_cli as add_certs_cli
    add_certs_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    problem = settle_staleness(args)
    if problem:
        print(f"fedpipe {args.command}: {problem}", file=sys.stderr)
        return 2
    _logging(args.verbose)
    from .net import tune_malloc

    tune_malloc()
    if args.command in ("tracker", "node", "relay"):
        from .proc import die_with_parent

        die_with_parent()
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, so a closed pipe is caught below, not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `fedpipe status --json | head`: the reader left, say nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except grpc.RpcError as e:  # a refusal or an unreachable peer, said in one line
        if args.verbose:
            raise
        from .net import reason

        print(f"fedpipe {args.command}: {reason(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # the CLI's last word: one line, not a traceback
        if args.verbose:
            raise
        print(f"fedpipe {args.command}: {_last_word(e)}", file=sys.stderr)
        return 1


def _last_word(e: Exception) -> str:
    """The one line :func:`main` prints for ``e``: the words of an error that names what is
    at fault itself (an unknown job and where it was asked, a dashboard that cannot be
    reached), else its type and message, with memory remedies in flags."""
    from .observe.source import JobNotFound
    from .observe.status import DashboardError

    if isinstance(e, (JobNotFound, DashboardError)):
        return str(e)
    from .planner.memfit import for_command_line  # remedies in flags, not in Python's

    return f"{type(e).__name__}: {for_command_line(str(e))}"
