"""The client role: package, profile and submit a model; feed data; collect weights.

:mod:`.client` holds the session with a tracker (:class:`Client`, ``submit``),
:mod:`.job` the user's handle on a job (:class:`Job`), :mod:`.errors` what it raises,
:mod:`.checkpoints` saves and checkpoints, :mod:`.feed` what is sent each step,
:mod:`.watch` the feeder's watch of the job's state.
"""
from .client import Client
from .errors import (CheckpointGone, JobEnded, JobFailed, JobNotFound, LayerInputError,
                     NotEnoughMemory, TrackerBusy)
from .job import Job
from .status import JobStatus

__all__ = ["CheckpointGone", "Client", "Job", "JobEnded", "JobFailed", "JobNotFound",
           "JobStatus", "LayerInputError", "NotEnoughMemory", "TrackerBusy"]
