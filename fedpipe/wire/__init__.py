"""The wire format: tensors <-> fedpipe.v1.Tensor messages, codecs, chunking."""
from .codecs import CODECS, ErrorFeedback, WireError, decode, encode, encode_payload

__all__ = ["CODECS", "ErrorFeedback", "WireError", "decode", "encode", "encode_payload"]
