"""``fedpipe node`` and ``fedpipe relay``: the subcommands that run a compute node and a relay
for nodes behind NAT (:func:`add_cli` adds them to :mod:`fedpipe.cli`'s subparsers)."""
from __future__ import annotations

import argparse
import sys

from .cli_args import (TRACKER_HELP, insecure_arg, metrics_args, relays_arg, tls as _tls,
                       tls_args, tracker_target)


def _positive_bytes(text: str) -> int:
    """A byte count of at least 1 (``--memory-limit``: 0 would read as "no limit" to the
    node's check, a negative one cannot be advertised)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes, got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return value


def cmd_node(args) -> int:
    from .node.daemon import NodeDaemon

    daemon = NodeDaemon(args.tracker, args.host, args.port, advertise=args.advertise,
                        name=args.name, device=args.device, threads=args.threads,
                        trust_code=args.trust_code, memory_limit=args.memory_limit,
                        link_profile=args.link_profile, metrics_port=args.metrics_port,
                        metrics_host=args.metrics_host, tls=_tls(args, args.name or None),
                        insecure=args.insecure, drain_timeout=args.drain_timeout,
                        host_id=args.host_id,
                        data_port=None if args.no_data_port else args.data_port,
                        relays=args.relay,
                        snapshot_dir=args.snapshot_dir)
    daemon.install_signal_handlers()
    if daemon.homing is None:
        bound = f"{args.host}:{daemon.port}"
        print(f"fedpipe node {daemon.name} listening on {bound}"
              + (f", advertised as {daemon.address}" if daemon.address != bound else "")
              + (f", data plane on {daemon.data_address}" if daemon.data_address else ""),
              flush=True)
    else:
        print(f"fedpipe node {daemon.name} listening on {args.host}:{daemon.port}; "
              f"outbound-only: reachable at {daemon.address}"
              + (f", data plane at {daemon.data_address}" if daemon.data_address else "")
              + f" through relay {daemon.homing.relay}", flush=True)
    if daemon.metrics_server is not None:
        print(f"fedpipe node {daemon.name} metrics at {daemon.metrics_server.url}/metrics",
              flush=True)
    daemon.run()
    if daemon.homing is not None and daemon.homing.displaced:
        print(f"fedpipe node: {daemon.homing.displaced}", file=sys.stderr)
        return 1
    return 0


def cmd_relay(args) -> int:
    """``fedpipe relay``: home outbound-only nodes and splice their peers' connections
    (:mod:`fedpipe.net.relay`) until SIGTERM/SIGINT."""
    import signal
    import threading

    from . import net
    from .net.relay import Relay

    tls = _tls(args, args.name or None)
    net.check_plaintext(args.host, tls, args.insecure, "this relay")
    relay = Relay(args.host, args.port, advertise=args.advertise, tls=tls,
                  max_nodes=args.max_nodes, max_streams=args.max_streams,
                  job_streams=args.job_streams,
                  **({"job_window": args.job_bytes} if args.job_bytes is not None else {}))
    print(f"fedpipe relay listening on {args.host}:{relay.port}, allocating at "
          f"{relay.advertise}"
          f"{', mutual TLS as ' + str(tls.identity) if tls else ', plaintext'}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    relay.close()
    return 0


def add_cli(sub) -> None:
    """Add ``fedpipe node`` and ``fedpipe relay`` to the CLI's subparsers ``sub``; each sets
    ``func(args) -> int``, as the other commands do."""
    n = sub.add_parser("node", help="run a node (compute)")
    n.add_argument("--tracker", type=tracker_target, required=True, help=TRACKER_HELP)
    n.add_argument("--host", default="0.0.0.0", help="address to listen on")
    n.add_argument("--port", type=int, default=0, help="port (0: any free port)")
    n.add_argument("--advertise", help="host peers should dial (default: --host)")
    data = n.add_mutually_exclusive_group()
    data.add_argument("--data-port", type=int, default=0,
                      help="port of the socket data plane, where peers send tensors (0: any "
                           "free port; one in use is an error)")
    data.add_argument("--no-data-port", action="store_true",
                      help="no socket data plane: peers send this node tensors over gRPC")
    n.add_argument("--name", default="", help="node name (default: node-PORT)")
    n.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    n.add_argument("--threads", type=int, default=None, help="torch threads")
    n.add_argument("--trust-code", action="store_true",
                   help="without TLS: accept pickled model code from non-loopback peers (code "
                        "execution!); ignored with --tls-dir, where only jobs signed by a "
                        "client certificate load")
    n.add_argument("--memory-limit", type=_positive_bytes, default=None,
                   help="advertise at most this many bytes of memory; a LoadStage predicted "
                        "to need more, with this node's other stages, is refused")
    n.add_argument("--snapshot-dir", default=None, metavar="DIR",
                   help="keep checkpoint snapshots (this node's stages' and those it keeps "
                        "as a buddy) as files in DIR, not in memory: the planner then counts "
                        "none in this node's memory. DIR is this node's alone (a second live "
                        "node is refused); files left there by an earlier node are removed")
    n.add_argument("--host-id", default=None,
                   help="the machine whose cores and memory this node shares with other nodes "
                        "(default: "
                        "this kernel's boot id; '' for none, e.g. containers with cores of "
                        "their own)")
    n.add_argument("--link-profile", default=None,
                   help="JSON file of emulated links to peers (bandwidth, latency); see README")
    n.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to hand this node's stages over to other nodes "
                        "before it exits anyway (0: exit at once; SIGINT always exits at "
                        "once); node/fedpipe-node.service's TimeoutStopSec matches it")
    n.add_argument("--relay", type=relays_arg, default=None,
                   help="outbound-only (behind NAT): home at the first of these relays "
                        "(HOST:PORT[,HOST:PORT], each a `fedpipe relay`) that answers and "
                        "advertise the addresses it opens for this node; re-home at the same "
                        "or the next one when it is lost. Under TLS peers check this node's "
                        "certificate against the relay's host: issue it with --host RELAYHOST")
    metrics_args(n)
    tls_args(n, None)  # a node's certificate is its --name
    insecure_arg(n)
    n.set_defaults(func=cmd_node)

    r = sub.add_parser("relay", help="run a relay for nodes that cannot be reached (behind "
                                      "NAT): they home here with `fedpipe node --relay`")
    r.add_argument("--host", default="0.0.0.0", help="address to listen on (nodes home here; "
                                                     "their allocated ports listen here too)")
    r.add_argument("--port", type=int, default=7071, help="port nodes home at (0: any free)")
    r.add_argument("--advertise", default=None,
                   help="host the allocated addresses name (default: --host)")
    r.add_argument("--name", default="", help="this relay's certificate in --tls-dir "
                                              "(role relay; default: the directory's only one)")
    r.add_argument("--max-nodes", type=int, default=64, help="nodes homed at once")
    r.add_argument("--max-streams", type=int, default=256,
                   help="connections spliced at once per homed node")
    r.add_argument("--job-streams", type=int, default=0,
                   help="streams one job (its dialers name it: a TAG record) may have spliced "
                        "at once per homed node; its next is refused naming it (0: a quarter "
                        "of --max-streams)")
    r.add_argument("--job-bytes", type=int, default=None,
                   help="bytes one job's streams may have in flight through the relay per "
                        "homed node and direction, all together (its senders wait beyond; "
                        "default: two streams' windows)")
    tls_args(r, None)  # the relay's certificate is its --name
    insecure_arg(r)
    r.set_defaults(func=cmd_relay)
