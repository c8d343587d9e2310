"""Who may submit what: a submission's owner, signature and bounds; who a node is.

:class:`Admission` checks a submission before the life cycle stores it: its owner is
the caller's identity, its signature verifies against the swarm's CA (under TLS),
its layers fit :data:`MAX_JOB_BYTES` and its owner has fewer than
:data:`MAX_JOBS_PER_OWNER` jobs pending or running. :class:`NodeNames` tells the
servicer which name a node id was registered under, so a node speaks only for
itself.
"""
from __future__ import annotations

import threading

from ..proto import tracker_pb2
from ..security.signing import verify_job
from ..spec import ACTIVE
from .errors import InvalidArgument, PermissionDenied, ResourceExhausted
from .jobs import Jobs
from .store import Store

S = tracker_pb2

MAX_JOB_BYTES = 128 * 2**20
"""The most bytes of layers a submitted job may carry (they are stored in the tracker's
database and sent to nodes); ``fedpipe tracker --max-job-bytes`` changes it."""
MAX_JOBS_PER_OWNER = 8
"""The most jobs one client (certificate) may have pending or running at once; more are
refused with RESOURCE_EXHAUSTED and the count, so one client cannot flood the tracker."""


class Admission:
    """Checks and stores submissions (see the module docstring); thread-safe.

    Args:
        store: the tracker's state (the owner's jobs).
        jobs: the life cycle that stores an admitted job.
        verifier: checks job signatures against the swarm CA and deny list (None: no TLS).
        max_job_bytes: see :data:`MAX_JOB_BYTES`.
        max_jobs_per_owner: see :data:`MAX_JOBS_PER_OWNER`.
    """

    def __init__(self, store: Store, jobs: Jobs, verifier=None, *,
                 max_job_bytes: int = MAX_JOB_BYTES,
                 max_jobs_per_owner: int = MAX_JOBS_PER_OWNER):
        self.store, self.jobs, self.verifier = store, jobs, verifier
        self.max_job_bytes, self.max_jobs_per_owner = max_job_bytes, max_jobs_per_owner
        self._lock = threading.Lock()  # the per-owner count and the insert, as one

    def submit(self, request: tracker_pb2.SubmitJobRequest, owner: str, caller: str) -> str:
        """Store ``request`` as ``owner``'s job (``caller`` names the caller in refusals);
        return its id.

        Raises:
            PermissionDenied: the request names another owner.
            InvalidArgument: layers and digests do not match, the layers are larger
                than ``max_job_bytes``, or as :meth:`~.jobs.Jobs.submit`.
            ResourceExhausted: the owner has ``max_jobs_per_owner`` jobs not ended, or
                as :meth:`~.jobs.Jobs.submit`.
            SecurityError: the signature does not verify.
        """
        if request.owner and request.owner != owner:
            raise PermissionDenied(f"the job says its owner is {request.owner!r} but "
                                   f"it comes from {caller}")
        request.owner = owner
        if self.verifier is not None:
            if len(request.layer_digests) != len(request.layers):
                raise InvalidArgument(f"the job has {len(request.layers)} layers but "
                                      f"{len(request.layer_digests)} layer digests")
            verify_job(self.verifier, owner=owner, client_cert=request.client_cert,
                       job_signature=request.job_signature, digests=request.layer_digests,
                       config=request.config, layers=request.layers)
        with self._lock:
            self._bounds(request)
            return self.jobs.submit(request)

    def _bounds(self, request: tracker_pb2.SubmitJobRequest) -> None:
        """Bounds on a submission: its size, and its owner's jobs not yet ended.

        Raises:
            InvalidArgument: the layers are larger than ``max_job_bytes`` in all.
            ResourceExhausted: the owner already has ``max_jobs_per_owner`` jobs
                pending or running (only with TLS, where owners are known).
        """
        size = sum(len(b) for b in request.layers)
        if size > self.max_job_bytes:
            raise InvalidArgument(
                f"the job's layers are {size / 2**20:.1f} MiB, more than this tracker's limit "
                f"of {self.max_job_bytes / 2**20:.1f} MiB (fedpipe tracker --max-job-bytes)")
        if not request.owner:
            return
        live = [j for j in self.store.jobs_in(S.JOB_STATE_PENDING, *ACTIVE)
                if self.store.job(j).owner == request.owner]
        if len(live) >= self.max_jobs_per_owner:
            raise ResourceExhausted(
                f"client {request.owner!r} already has {len(live)} jobs pending or running, "
                f"the most one client may have at once ({self.max_jobs_per_owner}); submit "
                f"again when one ends")


class NodeNames:
    """Node id -> the name it registered under; ids are never reused. Thread-safe."""

    def __init__(self, store: Store):
        self.store = store
        self._names: dict[str, str] = {}
        self._lock = threading.Lock()

    def add(self, node_id: str, name: str) -> None:
        """``node_id`` just registered as ``name``."""
        with self._lock:
            self._names[node_id] = name

    def name(self, node_id: str) -> str | None:
        """The registered name of ``node_id`` (None: no such node)."""
        with self._lock:
            name = self._names.get(node_id)
        if name is None:  # registered before a restart: look it up once
            for rec in self.store.node_records(include_lost=True):
                if rec.info.node_id == node_id:
                    name = rec.info.name
                    self.add(node_id, name)
                    break
        return name
