"""TLS, mutual TLS and a bearer token, for both ends of the wire.

    token = load_token(config.auth_token_file, os.environ)          # file, else TFPS_AUTH_TOKEN
    server = grpc.server(pool, interceptors=[TokenAuthInterceptor(token)])
    server.add_secure_port(address, server_credentials(config))     # None: no TLS configured
    channel = client_channel(address, options, ca_file=..., token=token)

Guarantees:

* With a token configured, every RPC except the standard health check
  (``/grpc.health.v1.Health/Check``) must carry ``authorization: Bearer <token>``;
  gRPC server reflection (``grpc.reflection.v1alpha.ServerReflection``) is no
  exception: it describes every service and message, which is not for strangers.
  A call without it, or with another token, ends with ``UNAUTHENTICATED`` before
  any servicer code runs, so it changes nothing on the server. The health check is
  exempt because container and orchestrator probes usually carry no token; it tells
  an unauthenticated caller only SERVING or NOT_SERVING. The streaming
  ``Health/Watch`` is *not* exempt: an open stream holds a handler thread, and
  unauthenticated callers must not be able to hold threads.
* Tokens are compared in constant time (``hmac.compare_digest``; only the length
  can show in timing). The token is never logged, and never comes from a flag
  (flags show in ``ps``): it is read from a file or from ``TFPS_AUTH_TOKEN``.
* With TLS the token rides inside the encrypted channel (gRPC call credentials).
  Without TLS gRPC refuses call credentials, so a client interceptor adds the same
  header instead: the token then travels in clear text, which this module logs as
  a warning. That is meant for loopback tests only.
* With ``tls_client_ca_file`` the server requires a client certificate signed by
  that CA (mutual TLS); the TLS handshake fails without one, before any RPC.

grpc only, no TensorFlow.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import stat
from typing import Mapping, Sequence

import grpc

from ps_common.settings import ConfigError

log = logging.getLogger("ps_common.security")

TOKEN_ENV = "TFPS_AUTH_TOKEN"
# Methods callable without the token: the unary health check, for probes. Nothing else,
# server reflection included.
EXEMPT_METHODS = frozenset({"/grpc.health.v1.Health/Check"})


# -- secrets and certificates ------------------------------------------------------
def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path!r}: {e.strerror or e}") from None


def _read_pem(path: str, what: str) -> bytes:
    data = _read(path, what)
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what} {path!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def _check_token(token: str, source: str) -> str:
    if not token:
        raise ConfigError(f"the bearer token from {source} is empty")
    # It becomes the value of an HTTP/2 header: visible ASCII, no spaces.
    if not all("\x21" <= ch <= "\x7e" for ch in token):
        raise ConfigError(f"the bearer token from {source} must be printable ASCII without spaces")
    return token


def load_token(token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The bearer token: from ``token_file`` if given, else ``TFPS_AUTH_TOKEN``; None if neither.

    Surrounding whitespace (a trailing newline) is stripped. An empty token or an
    unreadable file is a ``ConfigError``. A file that other users may read is
    accepted with a warning (Kubernetes and Docker mount secrets 0644/0444).
    An empty ``TFPS_AUTH_TOKEN`` counts as unset, as for every ``TFPS_*`` variable.
    """
    if token_file:
        raw = _read(token_file, "--auth-token-file")
        try:
            mode = os.stat(token_file).st_mode
        except OSError:
            mode = 0
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("--auth-token-file %s can be read by other users (mode %o); chmod 600 it",
                        token_file, stat.S_IMODE(mode))
        if environ.get(TOKEN_ENV):
            log.info("%s is ignored: --auth-token-file is given", TOKEN_ENV)
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise ConfigError(f"the bearer token in {token_file!r} must be printable ASCII") from None
        return _check_token(text.strip(), repr(token_file))
    raw_env = environ.get(TOKEN_ENV)
    if not raw_env:
        return None
    return _check_token(raw_env.strip(), TOKEN_ENV)


def server_credentials(config) -> grpc.ServerCredentials | None:
    """TLS credentials from ``config.tls_cert_file``/``tls_key_file``; None without TLS.

    With ``config.tls_client_ca_file`` clients must present a certificate signed
    by that CA (``require_client_auth=True``).
    """
    if not config.tls_cert_file:
        return None
    cert = _read_pem(config.tls_cert_file, "--tls-cert-file")
    key = _read_pem(config.tls_key_file, "--tls-key-file")
    client_ca = _read_pem(config.tls_client_ca_file, "--tls-client-ca-file") if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


# -- server side -------------------------------------------------------------------
def _bearer(metadata) -> list[str]:
    """The tokens of every ``authorization: Bearer`` entry (scheme case-insensitive)."""
    out = []
    for key, value in metadata or ():
        if key != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, credentials = value.partition(" ")
        if scheme.lower() == "bearer":
            out.append(credentials.strip())
    return out


class _Denying(grpc.RpcMethodHandler):
    """A denying handler (the fields of the one it wraps) that says why it denies."""

    def __init__(self, handler: grpc.RpcMethodHandler, reason: str):
        for field in handler._fields:
            setattr(self, field, getattr(handler, field))
        self.reason = reason


def _denying(handler: grpc.RpcMethodHandler, method: str, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only aborts with UNAUTHENTICATED."""

    def deny(_request, context):
        log.warning("rejected %s from %s: %s", method, context.peer(), reason)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    # No request deserializer: an unauthenticated payload is never parsed.
    if handler.request_streaming and handler.response_streaming:
        denying = grpc.stream_stream_rpc_method_handler(deny)
    elif handler.request_streaming:
        denying = grpc.stream_unary_rpc_method_handler(deny)
    elif handler.response_streaming:
        denying = grpc.unary_stream_rpc_method_handler(deny)
    else:
        denying = grpc.unary_unary_rpc_method_handler(deny)
    return _Denying(denying, reason)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Require ``authorization: Bearer <token>`` on every RPC but ``EXEMPT_METHODS``.

    A missing or wrong token yields a handler that aborts with UNAUTHENTICATED,
    so the servicer never sees the call. Unknown methods stay UNIMPLEMENTED.
    """

    def __init__(self, token: str, exempt: frozenset[str] = EXEMPT_METHODS):
        self._expected = _check_token(token, "the server configuration").encode("ascii")
        self._exempt = exempt

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in self._exempt:
            return continuation(handler_call_details)
        tokens = _bearer(handler_call_details.invocation_metadata)
        if len(tokens) == 1 and hmac.compare_digest(tokens[0].encode("latin-1"), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)  # looks the method up; runs nothing
        if handler is None:
            return None
        if not tokens:
            reason = "this server requires a bearer token (authorization: Bearer ...); the call carried none"
        elif len(tokens) > 1:
            reason = "the call carried more than one bearer token"
        else:
            reason = "the bearer token does not match the server's"
        return _denying(handler, handler_call_details.method, reason)


class AsyncTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """``TokenAuthInterceptor`` for a ``grpc.aio`` server (``ps_server.aio``): the same rule."""

    def __init__(self, token: str, exempt: frozenset[str] = EXEMPT_METHODS):
        self._sync = TokenAuthInterceptor(token, exempt)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        checked = self._sync.intercept_service(lambda _: handler, handler_call_details)
        if checked is handler or checked is None:
            return checked
        return _denying_async(handler, handler_call_details.method, checked.reason)


def _denying_async(handler: grpc.RpcMethodHandler, method: str, reason: str) -> grpc.RpcMethodHandler:
    """``_denying`` for grpc.aio: handlers that await their abort (a plain function there would
    run on the event loop and wait for it)."""

    async def deny(_request, context):
        log.warning("rejected %s from %s: %s", method, context.peer(), reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def deny_stream(_request, context):
        await deny(_request, context)
        yield  # never reached: an async generator, for the streamed replies

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)


# -- client side -------------------------------------------------------------------
class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Add ``authorization: Bearer <token>`` to every call (plaintext channels only)."""

    def __init__(self, token: str):
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, d):
        metadata = list(d.metadata or ()) + [self._entry]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def client_channel(
    address: str,
    options: Sequence[tuple] = (),
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    server_name: str | None = None,
    token: str | None = None,
) -> grpc.Channel:
    """A channel to ``address``: TLS when ``ca_file`` is given, plaintext otherwise.

    ``cert_file``/``key_file`` add a client certificate (mutual TLS);
    ``server_name`` is the name checked against the server certificate instead of
    the host in ``address``. A ``token`` is sent on every call as
    ``authorization: Bearer <token>``: as call credentials under TLS, by an
    interceptor (in clear text, with a logged warning) without.
    """
    options = list(options)
    if bool(cert_file) != bool(key_file):
        raise ConfigError("a client certificate needs both --tls-cert-file and --tls-key-file")
    if not ca_file:
        if cert_file or server_name:
            raise ConfigError("--tls-cert-file and --tls-server-name need --tls-ca-file (TLS)")
        channel = grpc.insecure_channel(address, options=options)
        if token is None:
            return channel
        log.warning("sending the bearer token to %s without TLS, in clear text: anyone who can see "
                    "the traffic can read it (use --tls-ca-file except on loopback)", address)
        return grpc.intercept_channel(channel, _BearerInterceptor(_check_token(token, "the client configuration")))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_pem(ca_file, "--tls-ca-file"),
        private_key=_read_pem(key_file, "--tls-key-file") if key_file else None,
        certificate_chain=_read_pem(cert_file, "--tls-cert-file") if cert_file else None,
    )
    if token is not None:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(_check_token(token, "the client configuration"))
        )
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(address, credentials, options=options)
