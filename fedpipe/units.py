"""Sizes and ranges in words, one way everywhere a message or a table gives them (no imports)."""
from __future__ import annotations


def binary_bytes(n: float) -> str:
    """``n`` bytes, readable in binary units: "512 B", "3.2 KiB", "29.5 MiB", "1.20 GiB"."""
    for unit, size, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n:.0f} B"


def layer_range(start: int, end: int) -> str:
    """Layers ``[start, end)`` in words: "layer 3" for one, "layers 3-5" for several."""
    return f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
