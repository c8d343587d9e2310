"""`fedpipe` command line: tracker, node, submit, status, demo."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import grpc


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_tracker(args) -> int:
    import threading
    import signal

    from .net import timeouts
    from .tracker.service import serve

    srv, service, port = serve(args.host, args.port, args.db, args.lease, args.link_refresh)
    print(f"fedpipe tracker listening on {args.host}:{port} (db {args.db})", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    service.close()
    srv.stop(grace=timeouts.SERVER_GRACE).wait()
    service.store.close()
    return 0


def cmd_node(args) -> int:
    from .node.daemon import NodeDaemon

    daemon = NodeDaemon(args.tracker, args.host, args.port, advertise=args.advertise,
                        name=args.name, device=args.device, threads=args.threads,
                        trust_code=args.trust_code, memory_limit=args.memory_limit,
                        link_profile=args.link_profile)
    daemon.install_signal_handlers()
    print(f"fedpipe node {daemon.name} listening on {daemon.address}", flush=True)
    daemon.run()
    return 0


def cmd_status(args) -> int:
    from .client import Client

    with Client(args.tracker) as client:
        return _status(client, args)


def _status(client, args) -> int:
    """``fedpipe status``: one job's state and plan, or the nodes and measured links."""
    from google.protobuf import json_format

    from .net import timeouts
    from .proto import tracker_pb2

    if args.job:
        info = client.job(args.job).status()
        if args.json:
            print(json.dumps({"state": info.state, "reason": info.reason, "step": info.step,
                              "steps": info.steps, "loss": info.loss,
                              "plan": json_format.MessageToDict(info.plan)}, indent=1))
            return 0
        print(info)
        for a in info.plan.stages:
            print(f"  replica {a.replica} stage {a.stage}: {a.node_name} ({a.address}) layers "
                  f"{a.layer_start}-{a.layer_end - 1}")
        return 0
    reply = client.stub.ListNodes(tracker_pb2.ListNodesRequest(include_lost=True),
                                   timeout=timeouts.CONTROL_RPC)
    if args.json:
        print(json_format.MessageToJson(reply))
        return 0
    print(f"{'node':<14}{'name':<14}{'address':<22}{'state':<7}{'device':<8}"
          f"{'GFLOP/s':>9}{'GiB':>7}")
    for n in reply.nodes:
        r = n.resources
        print(f"{n.node_id:<14}{n.name:<14}{n.address:<22}{'alive' if n.alive else 'lost':<7}"
              f"{r.device:<8}{r.flops / 1e9:>9.1f}{r.memory_bytes / 2**30:>7.1f}")
    names = {n.node_id: n.name for n in reply.nodes}
    if reply.links:
        print(f"\n{'link':<30}{'Mbit/s':>10}{'latency ms':>12}{'measured':>10}")
        for m in reply.links:
            pair = f"{names.get(m.src_id, m.src_id)} -> {names.get(m.dst_id, m.dst_id)}"
            print(f"{pair:<30}{m.bandwidth * 8 / 1e6:>10.1f}{m.latency * 1e3:>12.2f}"
                  f"{time.strftime('%H:%M:%S', time.localtime(m.measured_at)):>10}")
    return 0


def cmd_plan(args) -> int:
    from . import planner
    from .planner import jsonio

    def load(path):
        with open(path) as f:
            return json.load(f)

    profile = jsonio.profile_from_json(load(args.model))
    if args.cluster:
        cluster = jsonio.cluster_from_json(load(args.cluster))
    else:
        from .client import Client
        from .net import timeouts
        from .proto import tracker_pb2
        from .tracker.service import cluster_view

        with Client(args.tracker) as client:
            reply = client.stub.ListNodes(tracker_pb2.ListNodesRequest(),
                                          timeout=timeouts.CONTROL_RPC)
        cluster = cluster_view(list(reply.nodes), list(reply.links))
    config = planner.TrainConfig(batch_size=args.batch, microbatches=args.microbatches,
                                 schedule=args.schedule, stages=args.stages or 0,
                                 compression=args.compression)
    plan = planner.make_plan(cluster, profile, config)
    if args.json:
        print(json.dumps(jsonio.plan_to_json(plan), indent=1))
    else:
        print(jsonio.format_plan(plan, cluster, profile, config))
    return 0


def cmd_cancel(args) -> int:
    from .client import Client

    with Client(args.tracker) as client:
        print(client.job(args.job).cancel(args.reason))
    return 0


def cmd_submit(args) -> int:
    from .client import Client
    from .examples import digits

    with Client(args.tracker) as client:
        digits.train(client, steps=args.steps, microbatches=args.microbatches,
                     schedule=args.schedule, stages=args.stages or 0,
                     compression=_compression(args))
    return 0


def _compression(args) -> dict[str, str]:
    return {"activations": args.compression,
            "gradients": args.gradient_compression or args.compression}


def cmd_demo(args) -> int:
    from .examples import digits
    from .testing import LocalSwarm

    print(f"starting a tracker and {args.nodes} nodes on 127.0.0.1 ...", flush=True)
    with LocalSwarm(args.nodes) as swarm:
        client = swarm.client()  # closed with the swarm
        print(f"tracker at {swarm.tracker}; nodes: "
              + ", ".join(f"{n.name} ({n.address})" for n in client.nodes()), flush=True)
        # the digits MLP is so small that one node would be fastest: the demo
        # pins one stage per node to show the pipeline
        acc = digits.train(client, steps=args.steps, microbatches=args.microbatches,
                           schedule=args.schedule, stages=args.stages or args.nodes,
                           compression=_compression(args))
    print("swarm stopped.")
    return 0 if acc >= 0.95 else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedpipe", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tracker", help="run the tracker (control plane)")
    t.add_argument("--host", default="0.0.0.0")
    t.add_argument("--port", type=int, default=7070)
    t.add_argument("--db", default="fedpipe-tracker.db", help="SQLite file for the tracker's state")
    t.add_argument("--lease", type=float, default=10.0,
                   help="seconds a node may go without a heartbeat before it is marked lost")
    t.add_argument("--link-refresh", type=float, default=300.0,
                   help="seconds between link re-measurements (0: only when nodes join)")
    t.set_defaults(func=cmd_tracker)

    n = sub.add_parser("node", help="run a node (compute)")
    n.add_argument("--tracker", required=True, help="tracker HOST:PORT")
    n.add_argument("--host", default="0.0.0.0", help="address to listen on")
    n.add_argument("--port", type=int, default=0, help="port (0: any free port)")
    n.add_argument("--advertise", help="host peers should dial (default: --host)")
    n.add_argument("--name", default="", help="node name (default: node-PORT)")
    n.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    n.add_argument("--threads", type=int, default=None, help="torch threads")
    n.add_argument("--trust-code", action="store_true",
                   help="accept pickled model code from non-loopback peers (code execution!)")
    n.add_argument("--memory-limit", type=int, default=None,
                   help="advertise at most this many bytes of memory")
    n.add_argument("--link-profile", default=None,
                   help="JSON file of emulated links to peers (bandwidth, latency); see README")
    n.set_defaults(func=cmd_node)

    s = sub.add_parser("status", help="list nodes and measured links, or show a job")
    s.add_argument("--tracker", required=True)
    s.add_argument("job", nargs="?", help="job id")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_status)

    def train_args(q):
        q.add_argument("--steps", type=int, default=300)
        q.add_argument("--microbatches", type=int, default=4)
        q.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
        q.add_argument("--compression", default="auto",
                       help="activation and gradient codec: auto, none or a codec spec")
        q.add_argument("--gradient-compression", default=None,
                       help="gradient codec, if not --compression's (e.g. topk:0.01)")
        q.add_argument("--stages", type=int, default=None,
                       help="pipeline depth (default: submit lets the planner choose; "
                            "demo uses every node)")

    pl = sub.add_parser("plan", help="plan a model over a cluster file or a live swarm")
    where = pl.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help="cluster JSON (nodes and links; see README)")
    where.add_argument("--tracker", help="plan over this tracker's live nodes and measured links")
    pl.add_argument("--model", required=True, help="model profile JSON (layers; see README)")
    pl.add_argument("--batch", type=int, default=64, help="samples per step")
    pl.add_argument("--microbatches", type=int, default=4)
    pl.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    pl.add_argument("--stages", type=int, default=None, help="pin the pipeline depth")
    pl.add_argument("--compression", default="auto", help="auto, none or a codec spec")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("--tracker", required=True)
    c.add_argument("job", help="job id")
    c.add_argument("--reason", default="cancelled from the command line")
    c.set_defaults(func=cmd_cancel)

    u = sub.add_parser("submit", help="train the built-in digits example on a swarm")
    u.add_argument("--tracker", required=True)
    train_args(u)
    u.set_defaults(func=cmd_submit)

    d = sub.add_parser("demo", help="start a local swarm and train the digits example")
    d.add_argument("--nodes", type=int, default=3)
    train_args(d)
    d.set_defaults(func=cmd_demo)

    from .security.certs import add_cli as add_certs_cli
    add_certs_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _logging(args.verbose)
    from .net import tune_malloc

    tune_malloc()
    if args.command in ("tracker", "node"):
        from .testing import die_with_parent

        die_with_parent()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except grpc.RpcError as e:  # a refusal or an unreachable peer, said in one line
        if args.verbose:
            raise
        print(f"fedpipe {args.command}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except Exception as e:  # the CLI's last word: one line, not a traceback
        if args.verbose:
            raise
        print(f"fedpipe {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
