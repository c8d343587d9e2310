"""Model packaging: split an nn.Sequential into per-layer pickles a node can load.

Layer code defined in the user's own script, notebook or test file is shipped
by value (cloudpickle), so nodes need not have it installed; library code
(torch, fedpipe, installed packages, the standard library) is shipped by
reference. Loading a pickle runs code: nodes accept them only from trusted peers.
"""
from __future__ import annotations

import contextlib
import sys
import sysconfig
import types
from typing import Any, Iterator

import cloudpickle
from torch import nn

_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                           "platlib")})


def _user_module(name: str) -> types.ModuleType | None:
    """The module ``name`` if it is the user's own code (not installed, not stdlib)."""
    mod = sys.modules.get(name)
    root = name.split(".")[0]
    if mod is None or name == "__main__" or root in ("torch", "fedpipe") \
            or root in sys.stdlib_module_names:
        return None
    path = getattr(mod, "__file__", None)
    if path is None or path.startswith(_LIBRARY_DIRS):
        return None
    return mod


def _modules_of(obj: Any) -> set[str]:
    names = set()
    if isinstance(obj, nn.Module):
        names |= {type(m).__module__ for m in obj.modules()}
    for attr in ("__module__",):
        mod = getattr(obj, attr, None) or getattr(type(obj), attr, None)
        if isinstance(mod, str):
            names.add(mod)
    return names


@contextlib.contextmanager
def _by_value(objs: list[Any]) -> Iterator[None]:
    mods = {m for o in objs for name in _modules_of(o) if (m := _user_module(name))}
    for m in mods:
        cloudpickle.register_pickle_by_value(m)
    try:
        yield
    finally:
        for m in mods:
            cloudpickle.unregister_pickle_by_value(m)


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` with the user's own code by value."""
    with _by_value([obj]):
        return cloudpickle.dumps(obj)


def pack_layers(model: nn.Module) -> list[bytes]:
    """One pickle per child of an ``nn.Sequential``, in order.

    Parameters shared between children are copied into each (tied weights
    are not kept tied across stages).

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential`` or has no children.
    """
    return [dumps(layer) for layer in check_sequential(model)]


def check_sequential(model: nn.Module) -> nn.Sequential:
    """``model``, if it is a non-empty ``nn.Sequential`` (its children are the layers).

    Raises:
        TypeError: it is not, or it has no children.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be a torch.nn.Sequential whose children are the pipeline's "
                        f"layers, got {type(model).__name__}")
    if len(model) == 0:
        raise TypeError("model is an empty nn.Sequential")
    return model
