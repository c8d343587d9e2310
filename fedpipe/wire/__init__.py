"""The wire format: tensors <-> fedpipe.v1.Tensor messages, codecs, chunking."""
from .codecs import (CODECS, CodecSpec, ErrorFeedback, WireError, decode, encode, encode_payload,
                     parse_codec)

__all__ = ["CODECS", "CodecSpec", "ErrorFeedback", "WireError", "decode", "encode",
           "encode_payload", "parse_codec"]
