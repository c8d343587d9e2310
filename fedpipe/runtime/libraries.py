"""The libraries a job's layers are made of, and the check that a node runs the same ones.

A layer pickled by cloudpickle refers to its library's classes by name (a ``transformers``
``LlamaDecoderLayer``): unpickled with another version of that library it may load, and
then compute something else, or fail in the middle of a step. So the client records the
version of each library in :data:`TRACKED` that the layers use (any submodule whose class
comes from it), and a node whose version differs refuses the job's stages, naming both,
as the tracker refuses a node whose torch differs from the swarm's
(:func:`fedpipe.tracker.registration.check_versions`).

Versions are read from the installed distribution's metadata
(``importlib.metadata``), without importing the library.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from importlib import metadata

from torch import nn

TRACKED = ("transformers",)
"""Libraries whose version a job records when its layers use them."""


class LibraryMismatch(ValueError):
    """This node's version of a library the job's layers use differs from the client's;
    the message names both."""


def installed(name: str) -> str | None:
    """The installed version of distribution ``name``, or None if it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def used_by(layers: Iterable[nn.Module]) -> tuple[tuple[str, str], ...]:
    """``(library, version)`` of each :data:`TRACKED` library some submodule of ``layers``
    is an instance of a class of (by its ``__module__``), with this process's version;
    sorted by name. ``()`` for plain torch layers."""
    found = set()
    for layer in layers:
        for module in layer.modules():
            top = type(module).__module__.split(".", 1)[0]
            if top in TRACKED:
                found.add(top)
    return tuple((name, installed(name) or "unknown") for name in sorted(found))


def check(libraries: Sequence[tuple[str, str]], job_id: str = "") -> None:
    """Refuse a job whose recorded ``libraries`` (``(name, version)``) are not the ones
    installed here.

    Raises:
        LibraryMismatch: a library of another version here, or not installed here;
            the message names the library and both versions.
    """
    job = f"job {job_id!r}" if job_id else "the job"
    for name, version in libraries:
        here = installed(name)
        if here != version:
            raise LibraryMismatch(
                f"{job}'s layers were built with {name} {version} on its client but this "
                f"node {'runs ' + name + ' ' + here if here else 'does not have ' + name}; "
                f"pickled layers need the same {name} on the client and every node")
