"""JSON bodies of the connection records (the data plane's PREFACE, the relay's HELLO,
ALLOCATED and OPEN): a flat dataclass of strings and non-negative integers, read back
with every field checked before anything trusts it.

The errors are raised as the caller's own exception type (``error``), so each protocol
keeps its one error family (:class:`~fedpipe.wire.format.WireError`,
:class:`~fedpipe.net.relay.RelayError`).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

T = TypeVar("T")


def dump(obj: Any) -> bytes:
    """A dataclass instance as compact JSON."""
    return json.dumps(dataclasses.asdict(obj), separators=(",", ":")).encode()


def json_object(body: bytes, what: str, error: type[Exception]) -> dict[str, Any]:
    """``body`` parsed as a JSON object.

    Raises:
        error: not UTF-8 JSON, or not an object (the message starts with ``what``).
    """
    try:
        fields = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{what} is not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise error(f"{what} is not a JSON object")
    return fields


def dataclass_of(cls: type[T], fields: dict[str, Any], what: str,
                 error: type[Exception], max_int: int | None = None) -> T:
    """``cls(**fields)``, each of ``cls``'s fields present and of its declared type
    (``int`` fields non-negative integers, at most ``max_int`` if given; the others
    strings).

    Raises:
        error: unknown or missing fields, or a field of the wrong type or negative.
    """
    known = {f.name: f.type for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise error(f"{what} has unknown fields {unknown}")
    missing = sorted(set(known) - set(fields))
    if missing:
        raise error(f"{what} is missing fields {missing}")
    for name, value in fields.items():
        if known[name] in (int, "int"):
            if type(value) is not int or value < 0 or (max_int is not None and value > max_int):
                bound = "non-negative" if max_int is None else f"in [0, {max_int}]"
                raise error(f"{what} field {name!r} is {value!r}, not an integer {bound}")
        elif type(value) is not str:
            raise error(f"{what} field {name!r} is {value!r}, not a string")
    return cls(**fields)
