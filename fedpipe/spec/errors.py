"""The job vocabulary's errors: a name or setting outside it (:mod:`fedpipe.spec`)."""
from __future__ import annotations


class SpecError(ValueError):
    """A name or setting outside the vocabulary: the message says which and why."""



class JobSpecError(SpecError):
    """A job setting is invalid; ``field`` names it.

    Attributes:
        field: the :class:`JobSpec` field (or submission part) that is wrong.
    """

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
