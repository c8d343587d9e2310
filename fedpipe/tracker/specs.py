"""Each job's spec, decoded once and kept while the job lives.

The store keeps a job's submission as a proto (``SubmitJobRequest``, its layers
apart). The tracker's parts read a job's settings many times per job (its
``client_timeout`` every scheduler round, its profile at every recovery and
rebalance); :class:`JobSpecs` decodes the stored proto once per job into a
:class:`Spec` (the :class:`~fedpipe.spec.JobSpec`, the planner's
:class:`~fedpipe.planner.ModelProfile` and :class:`~fedpipe.planner.TrainConfig`)
and keeps it until the job ends (:meth:`JobSpecs.forget`, called by
:meth:`~.jobs.Jobs.move`) or falls out of the :data:`KEPT` most recent.

The one write of a job's config after its submission (the planner resolves its
"auto" settings, :meth:`~.deploy.Deployer.plan_ready`) goes through
:meth:`JobSpecs.set_config`, so what is kept is never older than the store.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from .. import planner
from ..planner.protoio import model_profile, train_config
from ..proto import tracker_pb2
from ..spec import JobSpec
from .store import Store

KEPT = 1024
"""Jobs whose decoded spec is kept (the least recently read go first)."""


@dataclass(frozen=True)
class Spec:
    """One job's submission, decoded.

    ``request`` is the stored proto (no layers): the signature fields nodes check
    travel from it as they are. Shared: callers must not change it.
    """

    request: tracker_pb2.SubmitJobRequest
    job: JobSpec
    profile: planner.ModelProfile
    config: planner.TrainConfig


class JobSpecs:
    """A read-through cache of decoded specs, keyed by job id; thread-safe.

    Args:
        store: where specs are stored.
        kept: see :data:`KEPT`.
    """

    def __init__(self, store: Store, kept: int = KEPT):
        self.store, self.kept = store, kept
        self._lock = threading.Lock()
        self._specs: OrderedDict[str, Spec] = OrderedDict()

    def get(self, job_id: str) -> Spec:
        """The job's decoded spec.

        Raises:
            KeyError: no such job.
        """
        with self._lock:
            found = self._specs.get(job_id)
            if found is not None:
                self._specs.move_to_end(job_id)
                return found
        request = self.store.spec(job_id)
        job = JobSpec.from_proto(request.config)
        found = Spec(request, job, model_profile(request.profile), train_config(job))
        with self._lock:
            self._specs[job_id] = found
            while len(self._specs) > self.kept:
                self._specs.popitem(last=False)
        return found

    def request(self, job_id: str) -> tracker_pb2.SubmitJobRequest:
        """The job's stored submission (no layers); see :class:`Spec`.

        Raises:
            KeyError: no such job.
        """
        return self.get(job_id).request

    def job(self, job_id: str) -> JobSpec:
        """The job's :class:`~fedpipe.spec.JobSpec` (its "auto" settings resolved once
        planned).

        Raises:
            KeyError: no such job.
        """
        return self.get(job_id).job

    def set_config(self, job_id: str, job: JobSpec) -> None:
        """Store the job's config as its stages run it (resolved), and keep it."""
        self.store.set_config(job_id, job.to_proto())
        with self._lock:  # after the write: a read in between cached what it read, dropped here
            self._specs.pop(job_id, None)

    def forget(self, job_id: str) -> None:
        """Drop the job's spec (it ended); a later read decodes it again."""
        with self._lock:
            self._specs.pop(job_id, None)
