"""The wire format: tensors <-> frames (:mod:`.format`, :mod:`.frames`), codecs, data-plane RPCs.

Names are imported on first use (PEP 562), so ``fedpipe.wire.format`` (the
frame prefix and header) and ``fedpipe.wire.codecmodel`` (each codec's sizes
and costs, which the planner reads) load without torch, for the tracker and the
security layer; ``fedpipe.wire.WireError`` and the codec names load
:mod:`.codecs` (and torch) when first asked for.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .codecs import CODECS, decode, encode, encode_payload
    from .feedback import ErrorFeedback
    from .format import WireError

__all__ = ["CODECS", "ErrorFeedback", "WireError", "decode", "encode", "encode_payload"]
_HOME = {"WireError": ".format", "CODECS": ".codecs", "ErrorFeedback": ".feedback",
         "decode": ".codecs", "encode": ".codecs", "encode_payload": ".codecs"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
