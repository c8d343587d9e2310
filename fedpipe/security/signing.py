"""Signed jobs: a client signs the code it submits; the tracker and every node check it before
they unpickle anything.

A job's code is its layers (cloudpickled modules) and the code-carrying fields of
its :class:`JobConfig` (``optimizer``, ``loss_fn``, ``lr_scheduler``, also
cloudpickled). The client signs, with the key of its certificate (ECDSA P-256,
SHA-256; FIPS 186-5), the digest of::

    DOMAIN, owner, the number of layers, SHA-256 of each layer,
    SHA-256 of each code-carrying config field,
    SHA-256 of the config's ``weights`` (seed and init_fn, or each layer's weight digest)

A job whose weights do not travel with its code (issue 22: a meta-device job, or
weights streamed or read from files) thus has what every node loads signed: its code
and, per layer, the digest its node checks the tensors against.
(each part length-prefixed, so no two jobs share a message). The per-layer
digests travel with the job (``layer_digests``), so a node that receives only its
stage's layers can check the signature over the whole job and that its own
layers are the signed ones. The fields the tracker fills in when it plans
(codecs, checkpoint interval, the plan itself) are not signed: the plan reaches a
node over mutual TLS from a tracker-role peer.

:func:`verify_job` refuses a job unless its certificate chains to the swarm CA,
is valid now, is not revoked, has role client and names the owner, and the
signature and digests match.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..proto import node_pb2
from . import certs
from .certs import CertError, Identity, Role
from .errors import PermissionDenied, Unauthenticated
from .tls import Authenticator, TlsConfig

DOMAIN = b"fedpipe job signature v1"
"""Separates job signatures from anything else a client key might sign."""
CODE_FIELDS = ("optimizer", "loss_fn", "lr_scheduler")
"""The :class:`JobConfig` fields that carry pickled code, and so are signed."""


def layer_digests(layers: Sequence[bytes]) -> list[bytes]:
    """SHA-256 of each layer's bytes, in order (32 bytes each)."""
    return [hashlib.sha256(b).digest() for b in layers]


def _part(h, data: bytes) -> None:
    h.update(struct.pack(">Q", len(data)))
    h.update(data)


def job_message(owner: str, digests: Sequence[bytes], config: node_pb2.JobConfig) -> bytes:
    """The 32-byte digest a job's signature covers (see the module docstring)."""
    h = hashlib.sha256()
    _part(h, DOMAIN)
    _part(h, owner.encode())
    h.update(struct.pack(">Q", len(digests)))
    for d in digests:
        _part(h, d)
    for name in CODE_FIELDS:
        _part(h, hashlib.sha256(getattr(config, name)).digest())
    # where the weights come from: the seed and init_fn, or each layer's weight digest
    _part(h, hashlib.sha256(config.weights.SerializeToString(deterministic=True)).digest())
    return h.digest()


@dataclass(frozen=True)
class SignedJob:
    """What a client adds to a job it submits (the fields of ``SubmitJobRequest``)."""

    owner: str
    job_signature: bytes
    client_cert: bytes
    layer_digests: list[bytes]


def sign_job(tls: TlsConfig, layers: Sequence[bytes], config: node_pb2.JobConfig) -> SignedJob:
    """Sign a job with the client's key; the owner is the certificate's name.

    Raises:
        CertError: the key is not an ECDSA key.
    """
    key = serialization.load_pem_private_key(tls.key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{tls.directory / (tls.name + '.key')} is not an ECDSA key")
    digests = layer_digests(layers)
    signature = key.sign(job_message(tls.name, digests, config), ec.ECDSA(hashes.SHA256()))
    return SignedJob(tls.name, signature, tls.cert_pem, digests)


MAX_LAYERS = 1 << 20
"""The most layer digests a signed job may carry (a bound on what a check reads)."""


def verify_job(authenticator: Authenticator, *, owner: str, client_cert: bytes,
               job_signature: bytes, digests: Sequence[bytes], config: node_pb2.JobConfig,
               layers: Sequence[bytes], first_layer: int = 0) -> Identity:
    """Check a job's signature before anything of it is unpickled; return the signer.

    Args:
        authenticator: the swarm CA and deny list of this server.
        owner, client_cert, job_signature, digests: as the job carries them.
        config: the job's config (its code-carrying fields are checked).
        layers: the layers this process received: all of them (tracker) or one
            stage's (node), the job's layers ``first_layer, first_layer + 1, ...``.

    Raises:
        Unauthenticated: no signature or certificate, a certificate of another CA,
            expired, not yet valid or revoked.
        PermissionDenied: a certificate whose role is not client or whose name is
            not the owner, a signature that does not match, or layers whose
            digests are not the signed ones.
    """
    if not job_signature or not client_cert:
        raise Unauthenticated("the job is not signed: a client certificate must sign every job "
                              "(Client(tls=...))")
    if len(digests) > MAX_LAYERS or any(len(d) != 32 for d in digests):
        raise PermissionDenied("the job's layer digests are malformed")
    try:
        cert = certs.load_cert(client_cert)
        certs.verify_issued_by(cert, authenticator.ca)
        signer = certs.read_identity(cert)
    except CertError as e:
        raise Unauthenticated(f"the job's signing certificate is refused: {e}") from None
    if signer.serial in authenticator.revoked_serials():
        raise Unauthenticated(f"the job's signing certificate ({signer}) is revoked")
    if signer.role is not Role.CLIENT:
        raise PermissionDenied(f"the job is signed by {signer}: only a client certificate may "
                               f"sign code")
    if signer.name != owner:
        raise PermissionDenied(f"the job is signed by {signer} but its owner is {owner!r}")
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise PermissionDenied(f"the job's signing certificate ({signer}) has no ECDSA key")
    try:
        public.verify(job_signature, job_message(owner, digests, config),
                      ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise PermissionDenied(f"the job's signature does not match its code and owner "
                               f"(signed by {signer}): refused before unpickling") from None
    if not 0 <= first_layer <= len(digests) - len(layers):
        raise PermissionDenied(f"layers {first_layer}..{first_layer + len(layers)} are not "
                               f"among the job's {len(digests)} signed layers")
    for i, d in enumerate(layer_digests(layers)):
        if d != digests[first_layer + i]:
            raise PermissionDenied(f"layer {first_layer + i} is not the one the client signed")
    return signer
