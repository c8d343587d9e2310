"""Arguments and helpers shared by the ``fedpipe`` subcommands (:mod:`fedpipe.cli`,
:mod:`fedpipe.cli_node`): the tracker address (:func:`tracker_target`) and any other
``HOST:PORT`` (:func:`address_arg`), TLS, ``--insecure`` and metrics flags, and the
training flags' values (codecs, cuts, staleness)."""
from __future__ import annotations

import argparse

from .observe.serving import LOCALHOST

TRACKER_HELP = ("the tracker's HOST:PORT; several trackers sharing one database: "
                "HOST:PORT,HOST:PORT (calls follow whichever leads)")


def tracker_target(text: str) -> str:
    """``--tracker``'s value, checked as :func:`fedpipe.net.trackers.addresses` checks it,
    so a bad one is refused before any call (not with gRPC's UNAVAILABLE after one).

    Raises:
        argparse.ArgumentTypeError: an address that is not ``HOST:PORT``.
    """
    from .net.trackers import target_problem

    why = target_problem(text)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return text


def address_arg(text: str) -> str:
    """One ``HOST:PORT`` flag's value (the tracker's ``--advertise``), checked with the rule
    ``--tracker`` and ``--relay`` follow (:func:`fedpipe.net.address.problem`) and refused
    in the same words: ``"'127.0.0.1': expected HOST:PORT"``.

    Raises:
        argparse.ArgumentTypeError: an address that is not ``HOST:PORT``.
    """
    from .net.address import problem

    why = problem(text)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {why}")
    return text


def dashboard_arg(text: str) -> str:
    """``fedpipe status --dashboard``'s value: the dashboard's URL, ``http://HOST:PORT``
    (or ``https://``), checked at parse (it failed at the first request, as "unknown url
    type").

    Raises:
        argparse.ArgumentTypeError: no http(s) scheme, or no host.
    """
    import urllib.parse

    parts = urllib.parse.urlsplit(text)
    if parts.scheme in ("http", "https") and parts.hostname:
        return text
    hint = f"; did you mean http://{text}?" if "://" not in text else ""
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected the dashboard's URL, http://HOST:PORT (the tracker's "
        f"--http-port){hint}")


def relays_arg(text: str) -> list[str]:
    """``fedpipe node --relay``'s value, ``HOST:PORT[,HOST:PORT]``, checked at parse as
    :func:`fedpipe.net.relay.split_relays` checks it (it was only checked once the node
    started).

    Raises:
        argparse.ArgumentTypeError: an empty list, or an entry that is not ``HOST:PORT``.
    """
    from .net.relay import split_relays

    try:
        return split_relays(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def tls(args, name: str | None):
    """The TLS configuration of ``--tls-dir`` (or ``$FEDPIPE_TLS_DIR``) and certificate ``name``
    (None: the directory's only one); None without either (plaintext)."""
    from .security.tls import resolve

    return resolve(args.tls_dir, getattr(args, "tls_name", None) or name)


def tls_args(q: argparse.ArgumentParser, name_help: str | None) -> None:
    """Add ``--tls-dir`` (and ``--tls-name`` with ``name_help``, None: the certificate is
    named by another flag) to subcommand ``q``."""
    q.add_argument("--tls-dir", default=None,
                   help="mutual TLS with the certificates in this directory (its ca.crt, "
                        "NAME.crt, NAME.key; see `fedpipe certs`); default: "
                        "$FEDPIPE_TLS_DIR, else plaintext")
    if name_help:
        q.add_argument("--tls-name", default=None, help=name_help)


def insecure_arg(q: argparse.ArgumentParser) -> None:
    """Add ``--insecure`` to a serving subcommand ``q``."""
    q.add_argument("--insecure", action="store_true",
                   help="serve without TLS on a non-loopback --host (anyone who reaches "
                        "it may call every RPC; a warning is logged at each start)")


def metrics_args(q: argparse.ArgumentParser) -> None:
    """Add ``--metrics-port`` and ``--metrics-host`` to a serving subcommand ``q``."""
    q.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on this port (0: off); see docs/metrics.md")
    q.add_argument("--metrics-host", default=LOCALHOST,
                   help="address the metrics bind (they have no authentication)")


def compression_arg(text: str) -> str:
    """``--compression``'s value: "auto", "none" or a codec spec that may carry
    activations (it sets theirs too), with the codec grammar's reason if not; the hint for
    a gradients-only codec is in flags, not in Python's ``compression={...}``."""
    from .spec import SpecError, check_compression

    try:
        return check_compression(text, "activations")
    except SpecError as e:
        try:
            check_compression(text, "gradients")
        except SpecError:  # no codec at all: the reason, with what activations take
            raise argparse.ArgumentTypeError(str(e)) from None
        raise argparse.ArgumentTypeError(
            f"{text!r} drops most of each tensor, so it cannot carry activations: use it "
            f"for gradients only, e.g. --compression int8 --gradient-compression {text}"
        ) from e


def cut_indices(text: str) -> tuple[int, ...]:
    """``--cuts``' value: comma-separated child indices (``2,3,4``); the rule they follow
    with the depth and the model is :func:`fedpipe.spec.cuts_problem`'s, checked by
    :func:`fedpipe.cli._pinned` once the model is known."""
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected child indices separated by commas, e.g. 2,3,4; got {text!r}") from None


def non_negative(text: str) -> int:
    """An integer >= 0 (``--max-staleness``)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def settle_staleness(args: argparse.Namespace) -> str:
    """Settle ``--max-staleness`` (a command without it: nothing): submit()'s default
    when not given; a problem when given without ``--schedule async``, which alone uses
    it (else "")."""
    if not hasattr(args, "max_staleness"):
        return ""
    if args.max_staleness is None:
        from .spec import Training

        args.max_staleness = Training.max_staleness
        return ""
    if args.schedule != "async":
        return (f"--max-staleness applies to --schedule async only (this is "
                f"--schedule {args.schedule}, which flushes every step)")
    return ""


def gradient_compression_arg(text: str) -> str:
    """``--gradient-compression``'s value: "auto", "none" or a codec spec."""
    from .spec import SpecError, check_compression

    try:
        return check_compression(text, "gradients")
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
