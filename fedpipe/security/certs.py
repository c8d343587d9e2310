"""A swarm's certificates: one CA, one certificate per process, and a deny list.

Layout of a TLS directory (``fedpipe certs init/issue/revoke`` write it; the same
directory, copied to every machine without the other processes' keys, is what
``--tls-dir`` and ``FEDPIPE_TLS_DIR`` name)::

    D/ca.crt         the swarm CA's certificate (ECDSA P-256, self-signed)
    D/ca.key         the CA's private key (mode 0600; keep it on the operator's machine)
    D/NAME.crt       a process's certificate, signed by the CA
    D/NAME.key       its private key (mode 0600)
    D/revoked.json   the deny list: {"revoked": [{"serial": "...", "name": ..., ...}]}

A certificate says who its holder is in one SAN URI, ``fedpipe://ROLE/NAME``
(the SPIFFE convention of putting a workload's identity in a URI SAN, with
fedpipe's own scheme), so identity never depends on parsing the subject. Its
DNS and IP SANs are the hosts a server answers on; every certificate carries
both the serverAuth and clientAuth extended key usages, since nodes are both.

Nothing is ever overwritten: issuing a name twice, or a second ``init``, raises
:class:`FileExistsError`. Revocation is by serial number (a re-issued name gets a
new serial and is accepted); the deny list also keeps the name for people.
"""
from __future__ import annotations

import datetime as dt
import enum
import ipaddress
import json
import os
import pathlib
import re
import secrets
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..proto import tracker_pb2

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
REVOKED = "revoked.json"
URI_SCHEME = "fedpipe"
CA_DAYS = 3650
"""Default lifetime of a swarm CA, days."""
CERT_DAYS = 365
"""Default lifetime of an issued certificate, days."""
CLOCK_SKEW = dt.timedelta(minutes=5)
"""A new certificate is valid from this long before now, so a peer whose clock is behind
accepts it."""
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
"""Hosts a tracker or node certificate answers on when ``hosts`` is not given."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class CertError(ValueError):
    """A certificate, key or TLS directory is missing, malformed or unusable (see the message)."""


class Role(str, enum.Enum):
    """What a certificate's holder is; the policy table is written in these."""

    TRACKER = "tracker"
    NODE = "node"
    CLIENT = "client"
    ADMIN = "admin"  # the operator: may drain nodes and cancel any job
    RELAY = "relay"  # forwards outbound-only nodes' streams (fedpipe relay); calls no RPC


SERVING_ROLES = frozenset({Role.TRACKER, Role.NODE, Role.RELAY})
"""Roles that run a gRPC server, so their certificates get host SANs by default."""


@dataclass(frozen=True)
class Identity:
    """Who a certificate says its holder is.

    Attributes:
        role: the holder's role.
        name: the holder's name, unique in the swarm (a node's name, a client's user name).
        serial: the certificate's serial number, as issued by the CA.
    """

    role: Role
    name: str
    serial: int

    @property
    def uri(self) -> str:
        """The SAN URI that carries this identity: ``fedpipe://ROLE/NAME``."""
        return f"{URI_SCHEME}://{self.role.value}/{self.name}"

    def __str__(self) -> str:
        return f"{self.role.value} {self.name!r}"


@dataclass(frozen=True)
class RevokedEntry:
    """One certificate on the deny list: its serial, and the name and time for people."""

    serial: int
    name: str
    revoked_at: float  # seconds since the epoch


@dataclass(frozen=True)
class DenyList:
    """The revoked certificates of a swarm (``D/revoked.json``), looked up by serial."""

    entries: tuple[RevokedEntry, ...] = ()

    @property
    def serials(self) -> frozenset[int]:
        return frozenset(e.serial for e in self.entries)

    def is_revoked(self, identity: Identity) -> bool:
        """Whether the certificate that carries ``identity`` is on the list."""
        return identity.serial in self.serials

    def to_json(self) -> dict:
        """The file's JSON form; serials are strings, since they exceed JSON's safe integers."""
        return {"revoked": [{"serial": str(e.serial), "name": e.name,
                             "revoked_at": e.revoked_at} for e in self.entries]}

    def to_proto(self) -> list[tracker_pb2.RevokedCert]:
        """The list as the tracker serves it in each ``HeartbeatReply.revoked``."""
        return [tracker_pb2.RevokedCert(serial=str(e.serial), name=e.name,
                                        revoked_at=e.revoked_at) for e in self.entries]

    @classmethod
    def from_proto(cls, revoked: Iterable[tracker_pb2.RevokedCert]) -> "DenyList":
        """Parse :meth:`to_proto`'s form. Raises :class:`CertError` naming a bad serial."""
        entries = []
        for r in revoked:
            if not r.serial.isdigit() or len(r.serial) > 50:  # X.509: at most 20 bytes
                raise CertError(f"malformed deny list: serial {r.serial[:60]!r} of {r.name!r} "
                                "is not a decimal certificate serial")
            entries.append(RevokedEntry(int(r.serial), r.name, r.revoked_at))
        return cls(tuple(entries))

    @classmethod
    def from_json(cls, obj: dict) -> "DenyList":
        """Parse :meth:`to_json`'s form. Raises :class:`CertError` naming a bad entry."""
        try:
            return cls(tuple(RevokedEntry(int(e["serial"]), str(e["name"]), float(e["revoked_at"]))
                             for e in obj["revoked"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CertError(f"malformed deny list: {type(e).__name__}: {e}") from None


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def check_name(name: str) -> str:
    """Return ``name`` if it can name a certificate (1-64 of ``A-Za-z0-9._-``, not ``ca``).

    The name becomes a file name and a URI path, hence the narrow alphabet.

    Raises:
        CertError: the name is empty, too long, has other characters, or is reserved.
    """
    if not _NAME.fullmatch(name) or name in ("ca", "revoked"):
        raise CertError(f"bad certificate name {name!r}: use 1-64 letters, digits, '.', '_' "
                        "or '-', starting with a letter or digit, and not 'ca' or 'revoked'")
    return name


def _write_new(path: pathlib.Path, data: bytes, mode: int) -> None:
    # O_EXCL makes "refuse to overwrite" atomic; the mode is set at creation so a
    # key is never readable by others, not even for an instant
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, mode)  # the umask may have narrowed a certificate's 0644; keys stay 0600


def _refuse_existing(*paths: pathlib.Path) -> None:
    for p in paths:
        if p.exists():
            raise FileExistsError(f"{p} exists; fedpipe certs never overwrites a certificate "
                                  "or key (remove it first if you mean to replace it)")


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(directory: str | os.PathLike, *, days: float = CA_DAYS) -> pathlib.Path:
    """Make a swarm CA in ``directory`` (created if missing): ``ca.crt`` and ``ca.key`` (0600).

    The CA's key is ECDSA on P-256 (NIST SP 800-186; what TLS 1.3 peers all
    support) and it signs with SHA-256. Its subject carries a random tag, so two
    swarms' CAs have different names and an error can say which one a peer used.

    Args:
        days: lifetime of the CA certificate, days.

    Returns:
        The path of ``ca.crt``.

    Raises:
        FileExistsError: the directory already has a CA.
    """
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _refuse_existing(d / CA_CERT, d / CA_KEY)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpipe"),
                      x509.NameAttribute(NameOID.COMMON_NAME,
                                         f"fedpipe swarm CA {secrets.token_hex(4)}")])
    start = _now() - CLOCK_SKEW
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write_new(d / CA_KEY, _key_pem(key), 0o600)
    _write_new(d / CA_CERT, _cert_pem(cert), 0o644)
    return d / CA_CERT


def _san_entries(identity_uri: str, hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity_uri)]
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", h):
                raise CertError(f"bad host {h!r}: give a DNS name or an IP address") from None
            names.append(x509.DNSName(h))
    return names


def issue(directory: str | os.PathLike, role: Role | str, name: str, *,
          hosts: Iterable[str] | None = None, days: float = CERT_DAYS,
          not_before: dt.datetime | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """Issue a certificate for ``name`` in ``role``, signed by the CA in ``directory``.

    Writes ``NAME.crt`` and ``NAME.key`` (ECDSA P-256, mode 0600). The identity
    travels in the SAN URI ``fedpipe://ROLE/NAME``; ``hosts`` become DNS or IP SANs.

    Args:
        role: tracker, node, client or admin.
        name: the holder's name (see :func:`check_name`).
        hosts: the names and addresses a server answers on; None gives tracker and
            node certificates ``localhost`` and ``127.0.0.1`` and others none.
        days: lifetime, days (fractions allowed).
        not_before: start of validity (default: now less :data:`CLOCK_SKEW`); a
            start in the past with a short lifetime issues an expired certificate,
            which tests use.

    Returns:
        ``(cert_path, key_path)``.

    Raises:
        CertError: bad role, name or host, or no CA in ``directory``.
        FileExistsError: ``NAME.crt`` or ``NAME.key`` exists.
    """
    d = pathlib.Path(directory)
    try:
        role = Role(role)
    except ValueError:
        raise CertError(f"bad role {role!r}: one of "
                        + ", ".join(r.value for r in Role)) from None
    check_name(name)
    if hosts is None:
        hosts = DEFAULT_HOSTS if role in SERVING_ROLES else ()
    ca_cert, ca_key = load_ca(d, with_key=True)
    cert_path, key_path = d / f"{name}.crt", d / f"{name}.key"
    _refuse_existing(cert_path, key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before if not_before is not None else _now() - CLOCK_SKEW
    identity_uri = f"{URI_SCHEME}://{role.value}/{name}"
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedpipe"),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
                x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(_san_entries(identity_uri, hosts)),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_new(key_path, _key_pem(key), 0o600)
    _write_new(cert_path, _cert_pem(cert), 0o644)
    return cert_path, key_path


def load_cert(source: str | os.PathLike | bytes | x509.Certificate) -> x509.Certificate:
    """A certificate from a PEM file path, PEM bytes, or a certificate (returned as is).

    Raises:
        CertError: the file is missing or is not a PEM certificate.
    """
    if isinstance(source, x509.Certificate):
        return source
    if isinstance(source, bytes):
        return _parse_pem(source)
    try:
        data = pathlib.Path(source).read_bytes()
    except OSError as e:
        raise CertError(f"cannot read certificate {source}: {e.strerror}") from None
    try:
        return _parse_pem(data)
    except CertError as e:
        raise CertError(f"{source}: {e}") from None


@lru_cache(maxsize=256)
def _parse_pem(data: bytes) -> x509.Certificate:
    # cached: a server parses the same few peer certificates on every call
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise CertError(f"not a PEM certificate ({e})") from None


def load_ca(directory: str | os.PathLike, *, with_key: bool = False):
    """The CA certificate of a TLS directory, and with ``with_key`` its private key too.

    Returns:
        the CA certificate, or ``(certificate, key)`` when ``with_key``.

    Raises:
        CertError: no CA in the directory (run ``fedpipe certs init``) or a bad file.
    """
    d = pathlib.Path(directory)
    if not (d / CA_CERT).exists():
        raise CertError(f"no CA in {d} (no {CA_CERT}); run `fedpipe certs init --dir {d}`")
    cert = load_cert(d / CA_CERT)
    if not with_key:
        return cert
    try:
        key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError:
        raise CertError(f"{d / CA_KEY} is missing: certificates are issued where the CA's key "
                        "is kept") from None
    except ValueError as e:
        raise CertError(f"{d / CA_KEY}: not a PEM private key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{d / CA_KEY}: not an elliptic-curve key")
    return cert, key


def read_identity(cert: str | os.PathLike | bytes | x509.Certificate) -> Identity:
    """The :class:`Identity` in a certificate's ``fedpipe://ROLE/NAME`` SAN URI.

    Args:
        cert: a certificate, its PEM bytes, or the path of a PEM file.

    Raises:
        CertError: no fedpipe URI, more than one, or a bad role or name in it.
    """
    c = load_cert(cert)
    try:
        san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertError("certificate has no subject alternative names, so no fedpipe "
                        "identity (was it issued by `fedpipe certs issue`?)") from None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith(f"{URI_SCHEME}://")]
    if len(uris) != 1:
        raise CertError(f"certificate has {len(uris)} {URI_SCHEME}:// URIs; it needs exactly one")
    role, _, name = uris[0][len(URI_SCHEME) + 3:].partition("/")
    try:
        return Identity(Role(role), check_name(name), c.serial_number)
    except ValueError as e:  # Role's ValueError or check_name's CertError
        raise CertError(f"bad identity {uris[0]!r}: {e}") from None


def verify_issued_by(cert: x509.Certificate, ca: x509.Certificate, *,
                     at: dt.datetime | None = None) -> None:
    """Check that ``cert`` was signed by ``ca`` and is valid at ``at`` (default: now).

    The TLS handshake already does this for a peer; this repeats it where a
    certificate arrives outside a handshake, and names the failure for people.

    Raises:
        CertError: "from another CA" (issuer or signature), "expired", or "not yet valid",
            each with the dates or names involved.
    """
    if cert.issuer != ca.subject:
        raise CertError(f"certificate from another CA: issued by "
                        f"{cert.issuer.rfc4514_string()!r}, not {ca.subject.rfc4514_string()!r}")
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as e:
        raise CertError(f"certificate from another CA: its signature does not verify "
                        f"against {ca.subject.rfc4514_string()!r} ({type(e).__name__})") from None
    now = at or _now()
    if now > cert.not_valid_after_utc:
        raise CertError(f"certificate expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC")
    if now < cert.not_valid_before_utc:
        raise CertError("certificate not yet valid: from "
                        f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC")


def load_revoked(directory: str | os.PathLike) -> DenyList:
    """The deny list of a TLS directory; an empty list when there is no ``revoked.json``.

    Raises:
        CertError: the file exists but is not a deny list.
    """
    path = pathlib.Path(directory) / REVOKED
    try:
        text = path.read_text()
    except FileNotFoundError:
        return DenyList()
    try:
        return DenyList.from_json(json.loads(text))
    except json.JSONDecodeError as e:
        raise CertError(f"{path}: not JSON ({e})") from None
    except CertError as e:
        raise CertError(f"{path}: {e}") from None


def revoke(directory: str | os.PathLike, name: str) -> RevokedEntry:
    """Add the certificate ``NAME.crt`` of ``directory`` to its deny list.

    The list is rewritten through a temporary file and a rename, so a reader
    never sees half of it. Revoking a certificate twice changes nothing.

    Returns:
        The entry for the certificate.

    Raises:
        CertError: no such certificate, or a malformed deny list.
    """
    d = pathlib.Path(directory)
    identity = read_identity(d / f"{check_name(name)}.crt")
    deny = load_revoked(d)
    for e in deny.entries:
        if e.serial == identity.serial:
            return e
    entry = RevokedEntry(identity.serial, name, _now().timestamp())
    tmp = d / f".{REVOKED}.{secrets.token_hex(4)}"
    tmp.write_text(json.dumps(DenyList(deny.entries + (entry,)).to_json(), indent=1) + "\n")
    os.replace(tmp, d / REVOKED)
    return entry


def describe(cert: str | os.PathLike | bytes | x509.Certificate) -> dict[str, str]:
    """What ``fedpipe certs show`` prints: subject, issuer, role, name, serial, validity, SANs.

    A certificate without a fedpipe identity (a CA, or a foreign one) is
    described with role and name ``-``.

    Raises:
        CertError: not a certificate.
    """
    c = load_cert(cert)
    try:
        ident = read_identity(c)
        role, name = ident.role.value, ident.name
    except CertError:
        role = name = "-"
    try:
        san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = [str(v) for v in san.get_values_for_type(x509.DNSName)
                 + san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        hosts = []
    now = _now()
    state = ("EXPIRED" if now > c.not_valid_after_utc else
             "not yet valid" if now < c.not_valid_before_utc else "valid")
    return {"subject": c.subject.rfc4514_string(), "issuer": c.issuer.rfc4514_string(),
            "role": role, "name": name, "serial": str(c.serial_number),
            "not_before": f"{c.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC",
            "not_after": f"{c.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC ({state})",
            "hosts": ", ".join(hosts) or "-"}


# ---------------------------------------------------------------------------
# `fedpipe certs`


def _cmd_init(args) -> int:
    path = make_ca(args.dir, days=args.days)
    print(f"made a swarm CA: {path} (key {path.with_name(CA_KEY)}, mode 0600; keep it on "
          "the operator's machine)")
    return 0


def _cmd_issue(args) -> int:
    cert, key = issue(args.dir, args.role, args.name, hosts=args.host, days=args.days)
    ident = read_identity(cert)
    print(f"issued {ident.uri} (serial {ident.serial}): {cert}, key {key} (mode 0600)")
    return 0


def _cmd_revoke(args) -> int:
    entry = revoke(args.dir, args.name)
    print(f"revoked {entry.name} (serial {entry.serial}) in {pathlib.Path(args.dir) / REVOKED}")
    return 0


def _cmd_show(args) -> int:
    for key, value in describe(args.file).items():
        print(f"{key + ':':<12}{value}")
    return 0


def add_cli(subparsers) -> None:
    """Add ``fedpipe certs init|issue|revoke|show`` to the CLI's subparsers.

    Each subcommand sets ``func(args) -> int``, as the other commands do; errors
    are :class:`CertError` and :class:`FileExistsError`, which the CLI prints in one line.
    """
    c = subparsers.add_parser("certs", help="make a swarm CA and certificates (mutual TLS)")
    sub = c.add_subparsers(dest="certs_command", required=True)

    i = sub.add_parser("init", help="make a swarm CA in a directory")
    i.add_argument("--dir", required=True, help="TLS directory (created if missing)")
    i.add_argument("--days", type=float, default=CA_DAYS, help="CA lifetime, days")
    i.set_defaults(func=_cmd_init)

    s = sub.add_parser("issue", help="issue a certificate signed by the directory's CA")
    s.add_argument("--dir", required=True, help="TLS directory with the CA")
    s.add_argument("--role", required=True, choices=[r.value for r in Role])
    s.add_argument("--name", required=True, help="the holder's name (a node's --name, a user)")
    s.add_argument("--host", action="append", default=None,
                   help="a DNS name or IP address the holder serves on (repeat; default for "
                        "tracker and node: " + " and ".join(DEFAULT_HOSTS) + ")")
    s.add_argument("--days", type=float, default=CERT_DAYS, help="lifetime, days")
    s.set_defaults(func=_cmd_issue)

    r = sub.add_parser("revoke", help="add a certificate to the directory's deny list")
    r.add_argument("--dir", required=True, help="TLS directory with the certificate")
    r.add_argument("name", help="the certificate's name")
    r.set_defaults(func=_cmd_revoke)

    w = sub.add_parser("show", help="print a certificate's subject, role, name and expiry")
    w.add_argument("file", help="a PEM certificate (e.g. D/NAME.crt)")
    w.set_defaults(func=_cmd_show)
