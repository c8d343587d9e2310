"""Security: the swarm's certificates, mutual TLS, and who may call which RPC.

- :mod:`.certs`: a swarm CA and per-role certificates (``fedpipe certs``), the deny list.
- :mod:`.tls`: gRPC credentials from a TLS directory, the caller's identity, clear errors.
- :mod:`.policy`: the per-method policy table (default deny) and the identity checks.
- :mod:`.interceptor`: the one server interceptor that enforces them on every call.

This package sits at the bottom of fedpipe with ``spec``, ``proto`` and ``net``:
it imports nothing of fedpipe but ``proto``, and not torch.
"""
from .certs import CertError, DenyList, Identity, Role
from .errors import PermissionDenied, SecurityError, Unauthenticated
from .interceptor import AuthInterceptor, identity_of
from .tls import Authenticator, TlsConfig

__all__ = ["AuthInterceptor", "Authenticator", "CertError", "DenyList", "Identity",
           "PermissionDenied", "Role", "SecurityError", "TlsConfig", "Unauthenticated",
           "identity_of"]
