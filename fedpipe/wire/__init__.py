"""The wire format: tensors <-> fedpipe.v1.Tensor messages, codecs, chunking."""
from .codecs import WireError, decode, encode

__all__ = ["WireError", "decode", "encode"]
