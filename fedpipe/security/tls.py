"""Mutual TLS for gRPC: credentials from a TLS directory, the caller's identity, clear errors.

How a server and a channel use this module (``fedpipe.net`` makes every channel
and server, so this is the one place they are wired)::

    tls = TlsConfig.load(tls_dir, name)          # this process's own certificate
    srv = grpc.server(pool, interceptors=[AuthInterceptor(tls.authenticator())])
    srv.add_secure_port(f"{host}:{port}", tls.server_credentials())
    ch = grpc.secure_channel(address, tls.channel_credentials())

The server requires a client certificate signed by the swarm CA, so gRPC's TLS
handshake already refuses a caller with no certificate, one from another CA, or
an expired one; :class:`Authenticator` checks the same again from the peer's
certificate (a server made without ``require_client_auth`` stays safe) and adds
what TLS cannot know: the fedpipe identity and the deny list.

A refused handshake reaches the caller only as gRPC's bare
``UNAVAILABLE: Socket closed``: the server closes the connection without a TLS
alert. :func:`diagnose` finds the likely cause on the caller's side, best
effort, by checking the caller's own certificate and then doing one TLS
handshake of its own with the server (see its docstring for what it can and
cannot tell apart); :func:`explain` turns a failed call into that one line.

A server's certificate must name the host its callers dial (``fedpipe certs
issue --host``): channels verify it like any TLS client.
"""
from __future__ import annotations

import ipaddress
import os
import pathlib
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from . import certs
from .certs import CertError, DenyList, Identity
from .errors import DenyListUnreadable, Unauthenticated

TLS_DIR_ENV = "FEDPIPE_TLS_DIR"
"""Environment variable naming the TLS directory when ``--tls-dir`` / ``tls=`` is not given."""
DENY_RELOAD_SECONDS = 1.0
"""How often a server looks at ``revoked.json`` again, seconds: a revocation takes effect
within this."""
PROBE_SECONDS = 3.0
"""Deadline of :func:`diagnose`'s own TCP connect, handshake and first read, seconds each."""

# HTTP/2's client preface and an empty SETTINGS frame (RFC 9113 §3.4): a gRPC
# server that accepted our certificate answers with its own SETTINGS.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")


def tls_dir(explicit: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The TLS directory to use: ``explicit`` (``--tls-dir``, ``tls=``), else ``$FEDPIPE_TLS_DIR``;
    a leading ``~`` is the user's home, as a shell would expand it (``tls="~/.fedpipe"``).

    Returns None when neither is set: plaintext, with the loopback rules.

    Raises:
        CertError: a ``~user`` whose home is unknown.
    """
    value = explicit if explicit is not None else os.environ.get(TLS_DIR_ENV) or None
    if value is None:
        return None
    try:
        return pathlib.Path(value).expanduser()
    except RuntimeError as e:  # ~nobody: no such user, or no home
        raise CertError(f"TLS directory {value}: cannot expand its ~ ({e})") from None


def resolve(tls: "TlsConfig | str | os.PathLike | None", name: str | None = None
            ) -> "TlsConfig | None":
    """This process's TLS configuration from what a caller gave (``tls=``, ``--tls-dir``).

    Args:
        tls: a :class:`TlsConfig` (returned as it is), a TLS directory, or None
            for ``$FEDPIPE_TLS_DIR``.
        name: the certificate's name in the directory (None: its only one).

    Returns:
        None when no directory is given or set: plaintext.

    Raises:
        CertError: see :meth:`TlsConfig.load`.
    """
    if isinstance(tls, TlsConfig):
        return tls
    d = tls_dir(tls)
    return TlsConfig.load(d, name) if d is not None else None


def _pem(path: pathlib.Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CertError(f"{what} {path} is missing") from None
    except OSError as e:
        raise CertError(f"cannot read {what} {path}: {e.strerror}") from None


@dataclass(frozen=True)
class TlsConfig:
    """One process's view of a TLS directory: the CA it trusts and its own certificate and key.

    Build it with :meth:`load`. Attributes are the PEM bytes gRPC wants.
    """

    directory: pathlib.Path
    identity: Identity
    ca_pem: bytes = field(repr=False)
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)
    # the one Authenticator of this configuration, made on first use (see authenticator())
    _shared: list = field(default_factory=list, repr=False, compare=False, hash=False)

    @property
    def name(self) -> str:
        return self.identity.name

    @classmethod
    def load(cls, directory: str | os.PathLike, name: str | None = None, *,
             check: bool = True) -> "TlsConfig":
        """Read ``ca.crt``, ``NAME.crt`` and ``NAME.key`` from ``directory``.

        Args:
            name: this process's certificate name; None takes the directory's only
                certificate (a machine's directory holds the CA and its own pair).
            check: verify that the key matches the certificate and that the CA
                signed it and it is valid now, so a process with a bad certificate
                fails at start with the reason instead of at every peer's handshake.
                Tests pass False to make callers with bad certificates.

        Raises:
            CertError: a missing or malformed file, several certificates and no
                name, a key of another certificate, another CA's or an expired
                certificate; the message names the file.
        """
        d = pathlib.Path(directory)
        if not d.is_dir():
            raise CertError(f"TLS directory {d} does not exist; make one with "
                            f"`fedpipe certs init --dir {d}`")
        if name is None:
            names = sorted(p.stem for p in d.glob("*.crt")
                           if p.name != certs.CA_CERT and p.with_suffix(".key").exists())
            if len(names) != 1:
                raise CertError(f"{d} holds {len(names)} certificates with keys "
                                f"({', '.join(names) or 'none'}); say which is this process's")
            name = names[0]
        certs.check_name(name)
        ca_pem = _pem(d / certs.CA_CERT, "CA certificate")
        try:
            cert_pem = _pem(d / f"{name}.crt", "certificate")
        except CertError as e:
            raise CertError(f"{e}: a process uses the certificate named after it (a node's "
                            f"--name; the tracker's 'tracker', or --tls-name NAME)") from None
        key_pem = _pem(d / f"{name}.key", "private key")
        identity = certs.read_identity(cert_pem)
        if check:
            cert = certs.load_cert(cert_pem)
            try:
                key = serialization.load_pem_private_key(key_pem, password=None)
            except ValueError as e:
                raise CertError(f"{d / (name + '.key')}: not a PEM private key ({e})") from None
            if key.public_key() != cert.public_key():
                raise CertError(f"{d / (name + '.key')} is not the key of {d / (name + '.crt')}")
            try:
                certs.verify_issued_by(cert, certs.load_cert(ca_pem))
            except CertError as e:
                raise CertError(f"{d / (name + '.crt')}: {e}") from None
        return cls(d, identity, ca_pem, cert_pem, key_pem)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``add_secure_port``: this certificate; callers must show the CA's."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)],
                                           root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for ``secure_channel``: trust only the swarm CA; show this certificate."""
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)

    def authenticator(self) -> "Authenticator":
        """The :class:`Authenticator` for this directory's CA and deny list: one per
        configuration, shared by this process's server and signature checks, so a deny list
        the tracker serves (:meth:`Authenticator.set_deny_list`) applies to all of them."""
        with _SHARED_LOCK:
            if not self._shared:
                self._shared.append(Authenticator(certs.load_cert(self.ca_pem),
                                                  deny_file=self.directory / certs.REVOKED))
            return self._shared[0]


_SHARED_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Verified:
    identity: Identity
    not_before: float  # seconds since the epoch
    not_after: float


class Authenticator:
    """Turns a TLS peer into an :class:`Identity`, or refuses it with the reason.

    The deny list is the union of ``deny_file`` (re-read within
    :data:`DENY_RELOAD_SECONDS` of a change) and the list last given to
    :meth:`set_deny_list` (the one the tracker serves). Thread-safe.

    Args:
        ca: the swarm CA's certificate.
        deny_file: a ``revoked.json`` to follow, or None.

    Raises:
        CertError: ``deny_file`` exists and is malformed.
    """

    def __init__(self, ca: x509.Certificate, *, deny_file: pathlib.Path | None = None):
        self.ca = ca
        self._deny_file = deny_file
        self._file_list = DenyList()
        self._file_version: tuple[int, int, int] | None = None
        self._file_error: str | None = None
        self._next_look = 0.0
        self._pushed = DenyList()
        self._verified: dict[bytes, _Verified] = {}
        self._lock = threading.Lock()
        self._reload()
        if self._file_error is not None:  # at a server's start: fail it, with the reason
            raise CertError(self._file_error)

    def set_deny_list(self, deny: DenyList) -> None:
        """Refuse these certificates too (replaces the list given before, not the file's).

        A node calls it with the list each heartbeat reply carries, so a certificate
        revoked at the tracker is refused on every server of the swarm.
        """
        self._pushed = deny

    def deny_list(self) -> DenyList:
        """Every certificate refused now: the file's and the one last given, the file's first.

        Raises:
            DenyListUnreadable: as :meth:`revoked_serials`.
        """
        self.revoked_serials()
        pushed = [e for e in self._pushed.entries if e.serial not in self._file_list.serials]
        return DenyList(self._file_list.entries + tuple(pushed))

    def revoked_serials(self) -> frozenset[int]:
        """Serial numbers refused now.

        Raises:
            DenyListUnreadable: the deny file became malformed; every call is
                refused until it is fixed, since forgetting a revocation is worse.
        """
        if self._deny_file is not None and time.monotonic() >= self._next_look:
            self._reload()
        if self._file_error is not None:
            raise DenyListUnreadable(self._file_error)
        return self._file_list.serials | self._pushed.serials

    def _reload(self) -> None:
        with self._lock:
            self._next_look = time.monotonic() + DENY_RELOAD_SECONDS
            if self._deny_file is None:
                return
            try:
                st = self._deny_file.stat()
                # the inode too: `fedpipe certs revoke` replaces the file, and a
                # coarse clock can give the new one the old mtime
                version = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                version = None
            if version == self._file_version:
                return
            try:
                self._file_list = certs.load_revoked(self._deny_file.parent)
                self._file_error = None
            except CertError as e:
                self._file_error = f"this server cannot read its deny list: {e}"
            self._file_version = version

    def _verify(self, pem: bytes) -> _Verified:
        hit = self._verified.get(pem)
        if hit is not None:
            return hit
        try:
            cert = certs.load_cert(pem)
            certs.verify_issued_by(cert, self.ca, at=cert.not_valid_before_utc)
            identity = certs.read_identity(cert)
        except CertError as e:
            raise Unauthenticated(str(e)) from None
        v = _Verified(identity, cert.not_valid_before_utc.timestamp(),
                      cert.not_valid_after_utc.timestamp())
        if len(self._verified) >= 4096:  # a bound, not a cache policy: certificates are few
            self._verified.clear()
        self._verified[pem] = v
        return v

    def authenticate(self, auth_context: Mapping[str, Sequence[bytes]]) -> Identity:
        """The caller's identity from ``context.auth_context()``.

        Reads the peer's certificate (``x509_pem_cert``), checks it against the
        CA (signature cached per certificate; validity and revocation checked on
        every call), and reads its ``fedpipe://ROLE/NAME`` URI.

        Raises:
            Unauthenticated: no TLS or no certificate, a certificate from another
                CA, expired or not yet valid, without a fedpipe identity, or revoked.
            DenyListUnreadable: this server's deny file is malformed.
        """
        if auth_context.get("transport_security_type") != [b"ssl"]:
            raise Unauthenticated("no TLS: this server requires mutual TLS with a certificate "
                                  "of the swarm CA (give --tls-dir or set FEDPIPE_TLS_DIR)")
        pems = auth_context.get("x509_pem_cert")
        if not pems:
            raise Unauthenticated("no client certificate: this server requires one signed by "
                                  "the swarm CA")
        v = self._verify(pems[0])
        now = time.time()
        if now > v.not_after:
            raise Unauthenticated(f"certificate of {v.identity} expired at "
                                  f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(v.not_after))}"
                                  " UTC")
        if now < v.not_before:
            raise Unauthenticated(f"certificate of {v.identity} is not valid yet")
        if v.identity.serial in self.revoked_serials():
            raise Unauthenticated(f"certificate of {v.identity} (serial {v.identity.serial}) "
                                  "is revoked")
        return v.identity


def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """A TLS server context for a plain socket: this process's certificate; peers must show one
    of the swarm CA (the socket data plane's listener, a relay's)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.directory / f"{tls.name}.crt", tls.directory / f"{tls.name}.key")
    ctx.load_verify_locations(cadata=tls.ca_pem.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    """A TLS client context for a plain socket: trust only the swarm CA, check the host name,
    show this process's certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=tls.ca_pem.decode())
    ctx.load_cert_chain(tls.directory / f"{tls.name}.crt", tls.directory / f"{tls.name}.key")
    return ctx


def socket_identity(sock: ssl.SSLSocket, authenticator: Authenticator) -> Identity:
    """The identity of a TLS socket's peer, checked as a gRPC caller's is (CA, validity,
    deny list). See :meth:`Authenticator.authenticate`.

    Raises:
        Unauthenticated: no certificate, or one that does not prove who the peer is.
    """
    der = sock.getpeercert(binary_form=True)
    pem = ssl.DER_cert_to_PEM_cert(der).encode() if der else b""
    return authenticator.authenticate({"transport_security_type": [b"ssl"],
                                       "x509_pem_cert": [pem] if pem else []})


def peer_identity(context: grpc.ServicerContext, authenticator: Authenticator) -> Identity:
    """The identity of the caller of a servicer method. See :meth:`Authenticator.authenticate`.

    Raises:
        Unauthenticated: the caller's certificate does not prove who it is.
    """
    return authenticator.authenticate(context.auth_context())


# ---------------------------------------------------------------------------
# Clear errors on the caller's side


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def _own_certificate_problem(tls: TlsConfig) -> str | None:
    cert = certs.load_cert(tls.cert_pem)
    try:
        certs.verify_issued_by(cert, certs.load_cert(tls.ca_pem))
    except CertError as e:
        return f"this caller's certificate {tls.name!r} is unusable: {e}"
    return None


def _names_host(cert: x509.Certificate, host: str) -> bool:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    try:
        return ipaddress.ip_address(host) in san.get_values_for_type(x509.IPAddress)
    except ValueError:
        dns = [d.lower() for d in san.get_values_for_type(x509.DNSName)]
        return host.lower() in dns or any(
            d.startswith("*.") and host.lower().partition(".")[2] == d[2:] for d in dns)


_UNRESOLVED = re.compile(r"(?:errors resolving|DNS resolution failed for(?: service:)?) (\S+):")
"""gRPC core's wording of a target its resolver could not turn into addresses
(``errors resolving 127.0.01:7070: [... Domain name not found]``; older cores say
``DNS resolution failed for 127.0.01:7070: ...``), up to the target dialled."""


def unresolved(details: str) -> str | None:
    """A failed call's details, when gRPC could not resolve the host dialled, in one line:
    ``cannot resolve host '127.0.01' (127.0.01:7070): neither an IP address nor a name
    DNS knows``; None for any other failure.

    gRPC's resolver is stricter than the operating system's (``socket`` takes
    ``127.0.01`` as 127.0.0.1), so its own verdict is read here, not probed again.
    """
    m = _UNRESOLVED.search(details)
    if m is None:
        return None
    target = m.group(1)
    host = target.rpartition(":")[0] if ":" in target else target
    host = host.removeprefix("[").removesuffix("]")
    return (f"cannot resolve host {host!r} ({target}): neither an IP address nor a name "
            f"DNS knows")


def diagnose(address: str, tls: TlsConfig | None, *, timeout: float = PROBE_SECONDS) -> str | None:
    """Why a call to ``address`` failed to connect, in one line; None if TLS is not the cause.

    Best effort, in this order:

    1. this caller's own certificate: not from its ``ca.crt``, expired or not yet valid;
    2. TCP: nothing listens at ``address``;
    3. one TLS 1.3 handshake of our own (``ssl``, presenting our certificate,
       verifying nothing) to see what the server presents:
       - no TLS at all, while we speak TLS: the server runs without certificates;
       - TLS, while we have no certificate: the server requires mutual TLS;
       - a server certificate not from our CA, expired, or not naming the host;
    4. then an HTTP/2 preface: a server that closes the connection instead of
       answering refused our certificate. It does not say why (gRPC sends no TLS
       alert); the likely cause, with our certificate's own checks passed, is
       that the server trusts another CA, and the line says so.

    Args:
        address: ``HOST:PORT`` as dialled.
        tls: this caller's TLS configuration, or None for a plaintext caller.
        timeout: seconds for each of connect, handshake and read.

    Returns:
        A one-line reason, or None when TLS is not the cause (or the server
        accepted our handshake, so the failure lies elsewhere).
    """
    if tls is not None:
        problem = _own_certificate_problem(tls)
        if problem:
            return problem
    try:
        host, port = _split(address)
        sock = socket.create_connection((host, port), timeout=timeout)
    except (OSError, ValueError) as e:
        return f"cannot reach {address}: {getattr(e, 'strerror', None) or e}"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # we only look at what the server presents
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # so the server checks our certificate after
    ctx.set_alpn_protocols(["h2"])                # the handshake and we can read its verdict
    if tls is not None:
        _load_chain(ctx, tls)
    with sock:
        try:
            conn = ctx.wrap_socket(sock, server_hostname=host)
        except (ssl.SSLError, OSError):
            if tls is not None:
                return (f"{address} does not speak TLS (was it started without --tls-dir?), "
                        "but this caller uses mutual TLS")
            return None
        with conn:
            if tls is None:
                return (f"{address} requires mutual TLS and this caller has no certificate: "
                        f"give --tls-dir, tls= or set {TLS_DIR_ENV}")
            return _server_verdict(conn, address, host, tls)


def _server_verdict(conn: ssl.SSLSocket, address: str, host: str, tls: TlsConfig) -> str | None:
    """Steps 3 (the server's certificate) and 4 (its answer to an HTTP/2 preface) of
    :func:`diagnose`, on a handshake that succeeded with our certificate."""
    der = conn.getpeercert(binary_form=True)
    if der is None:  # TLS 1.3 without a certificate (a pre-shared key): not ours
        return f"{address} speaks TLS but presents no certificate"
    server = x509.load_der_x509_certificate(der)
    try:
        certs.verify_issued_by(server, certs.load_cert(tls.ca_pem))
    except CertError as e:
        trust = (f"; this caller trusts only {tls.directory / certs.CA_CERT}"
                 if "another CA" in str(e) else "")
        return f"{address} presents a {e}{trust}"
    if not _names_host(server, host):
        return (f"{address}'s certificate does not name the host {host!r}; issue the "
                f"server's certificate with --host {host}")
    try:
        conn.sendall(_H2_PREFACE)
        answer = conn.recv(9)
    except (ssl.SSLError, OSError):
        answer = b""
    if answer:
        return None
    ca = certs.load_cert(tls.ca_pem).subject.rfc4514_string()
    return (f"{address} refused this caller's certificate {tls.name!r} in the TLS "
            f"handshake: the server probably trusts another CA (ours: {ca!r})")

def _load_chain(ctx: ssl.SSLContext, tls: TlsConfig) -> None:
    # ssl wants files; the key is written nowhere else: the directory's own files are used
    ctx.load_cert_chain(tls.directory / f"{tls.name}.crt", tls.directory / f"{tls.name}.key")


def explain(error: grpc.RpcError, address: str, tls: TlsConfig | None) -> str:
    """A one-line message for a failed call: a host gRPC could not resolve
    (:func:`unresolved`), or the TLS cause when :func:`diagnose` finds one.

    gRPC reports every failed connection, a refused handshake included, as
    UNAVAILABLE; only then is the server probed. Returns ``"CODE: details"``
    from gRPC for other codes, or when no TLS cause is found.
    """
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        reason = unresolved(details) or diagnose(address, tls)
        if reason:
            return reason
    return f"{code.name}: {details}"
