"""The client role: package, profile and submit a model; feed data; collect weights.

:mod:`.client` holds the session with a tracker (:class:`Client`, ``submit``),
:mod:`.job` the user's handle on a job (:class:`Job`), :mod:`.feed` what is sent each
step, :mod:`.watch` the feeder's watch of the job's state.
"""
from .client import Client
from .job import (CheckpointGone, Job, JobEnded, JobFailed, JobStatus, NotEnoughMemory,
                  TrackerBusy)

__all__ = ["CheckpointGone", "Client", "Job", "JobEnded", "JobFailed", "JobStatus",
           "NotEnoughMemory", "TrackerBusy"]
