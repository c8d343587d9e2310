"""The tracker's domain errors: what a caller did wrong, in words, without gRPC.

The domain layer (:mod:`~fedpipe.tracker.registry`, :mod:`~fedpipe.tracker.jobs`)
raises these; :mod:`~fedpipe.tracker.service` maps each class to one gRPC
status code, in one table. The message is shown to the caller as is.
"""
from __future__ import annotations


class TrackerError(Exception):
    """Base of the errors a tracker call can answer with."""


class InvalidArgument(TrackerError):
    """The request itself is malformed (a bad address, a bad job setting)."""


class NotFound(TrackerError):
    """The request names a job (or node) the tracker does not know."""


class AlreadyExists(TrackerError):
    """The request claims something another live party holds (a node's address)."""


class PermissionDenied(TrackerError):
    """The caller speaks for something it does not own (a stage it does not run)."""


class FailedPrecondition(TrackerError):
    """The request is well formed but the system is not in a state to take it
    (an incompatible node version, a report about a job that is not running)."""


class ResourceExhausted(TrackerError):
    """The swarm cannot hold what is asked (a job larger than all nodes' memory)."""


class Unavailable(TrackerError):
    """The tracker cannot take the request now but will soon: the caller retries with
    backoff (too many registrations at once)."""
