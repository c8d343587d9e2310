"""The errors a client raises about a job (re-exported by :mod:`fedpipe.client`)."""
from __future__ import annotations

from ..observe.source import JobNotFound
from ..runtime.layercall import LayerInputError

__all__ = ["CheckpointGone", "JobEnded", "JobFailed", "JobNotFound", "LayerInputError",
           "NotEnoughMemory", "TrackerBusy"]


class JobFailed(RuntimeError):
    """The job ended FAILED or CANCELLED; the message is the tracker's reason."""


class NotEnoughMemory(JobFailed):
    """The job does not fit the swarm's memory: refused at ``submit`` (no job was made), or
    it FAILED at planning or when a node refused to load a stage. The message (the
    tracker's or the node's) gives what is needed and what there is, in binary units, and
    what to change (:data:`fedpipe.planner.memfit.MEMORY_REMEDIES`)."""


class JobEnded(RuntimeError):
    """:meth:`Job.resume` of a job that has ended (SUCCEEDED, FAILED or CANCELLED); the
    message names its state and the tracker's reason."""


class TrackerBusy(RuntimeError):
    """The tracker refused a call with RESOURCE_EXHAUSTED; the message says which limit."""


class CheckpointGone(RuntimeError):
    """No node holds a stage's snapshot of the step asked for any more (``Job.save``), or a
    stage's trained weights (``Job.state_dict``, ``Job.model``): the job was cancelled or
    failed and its nodes dropped them, or its weights were released, or its nodes
    restarted. The message names the job, the stage (and the step of a snapshot), why,
    and for weights what to do (:func:`fedpipe.client.checkpoints.gone_message`)."""
