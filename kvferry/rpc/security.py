"""Transport security in one place: TLS credentials for servers and channels, and the cluster
token that internal RPCs carry.

Who checks what:
- Worker servers (prefill, decode, K/V transfer, stats, local prefill) are internal. With a CA
  they require a client certificate signed by it (mTLS); with a cluster token every RPC except
  grpc.health.v1 (Kubernetes probes) must carry `authorization: Bearer <token>`, else
  UNAUTHENTICATED before the handler runs or reads a message.
- The router's public port speaks TLS when it has a certificate; it requires client
  certificates only when asked (`--public-client-auth`) and never checks the token.
- Internal channels (router -> workers, prefill -> decode K/V pushes) verify the server with
  the CA, present this process's certificate as their client certificate, and attach the token.
Everything off (no files given) is plaintext without a token: tests and local development.
A token without TLS is refused (`refuse_plaintext_token`): it would cross the network in clear.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

import grpc

from kvferry.rpc.grpc_util import CHANNEL_OPTIONS
from kvferry.settings import SecuritySettings

TOKEN_METADATA_KEY = "authorization"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)  # probes carry no credentials


class Credentials(NamedTuple):
    """The PEM files and token of one process, read once at startup."""

    cert: bytes | None = None  # this process's certificate chain
    key: bytes | None = None
    ca: bytes | None = None  # verifies peers; None: system roots (client) / no check (server)
    server_name: str | None = None  # name expected in servers' certificates
    token: str | None = None

    @property
    def is_tls(self) -> bool:
        return self.cert is not None


PLAINTEXT = Credentials()


def read_token(path: str | Path) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"cluster_token_file: {path} is empty")
    return token


def refuse_plaintext_token(settings: SecuritySettings) -> None:
    """A cluster token on a plaintext channel is readable by anyone on the path, and then
    opens every internal service: refused, as a ValueError naming the flags."""
    if settings.cluster_token_file is not None and not settings.is_tls:
        raise ValueError("cluster_token_file: the token would travel in plaintext: give "
                         "--tls-cert and --tls-key (and --tls-ca) with --cluster-token-file")


def load(settings: SecuritySettings) -> Credentials:
    def read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    refuse_plaintext_token(settings)
    token = None if settings.cluster_token_file is None else read_token(
        settings.cluster_token_file)
    return Credentials(read(settings.tls_cert), read(settings.tls_key), read(settings.tls_ca),
                       settings.tls_server_name, token)


# ---- servers ---------------------------------------------------------------------------------
def add_port(server: grpc.aio.Server, address: str, creds: Credentials,
             require_client_auth: bool) -> int:
    """Bind `address`: TLS when `creds` has a certificate (client certificates required when
    `require_client_auth`, verified against the CA), plaintext otherwise. Returns the port."""
    if not creds.is_tls:
        return server.add_insecure_port(address)
    if require_client_auth and creds.ca is None:
        raise ValueError("tls_ca: needed to require client certificates")
    server_creds = grpc.ssl_server_credentials(
        [(creds.key, creds.cert)], root_certificates=creds.ca,
        require_client_auth=require_client_auth)
    return server.add_secure_port(address, server_creds)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuse internal RPCs without the cluster token (UNAUTHENTICATED). The refusal replaces
    the handler, so an unauthenticated caller's messages are never parsed or acted on."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def is_allowed(self, method: str, metadata: tuple[tuple[str, str | bytes], ...]) -> bool:
        if method.startswith(OPEN_METHOD_PREFIXES):
            return True
        given = next((v for k, v in metadata or () if k == TOKEN_METADATA_KEY), None)
        if given is None:
            return False
        given_bytes = given if isinstance(given, bytes) else given.encode()
        return hmac.compare_digest(given_bytes, self._expected)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or self.is_allowed(details.method, details.invocation_metadata):
            return handler
        return _refusal(handler)


async def _refuse(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "internal service: missing or wrong cluster token")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that refuses; requests stay raw
    bytes (no deserializer)."""
    serialize = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse, response_serializer=serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, response_serializer=serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, response_serializer=serialize)
    return grpc.unary_unary_rpc_method_handler(_refuse, response_serializer=serialize)


def server_interceptors(creds: Credentials) -> list[grpc.aio.ServerInterceptor]:
    """What an internal (worker) server adds: the token check, when there is a token."""
    return [] if creds.token is None else [TokenCheck(creds.token)]


def health_only_server(servicer: object, address: str) -> tuple[grpc.aio.Server, int]:
    """A plaintext server with nothing but grpc.health.v1 (the same servicer as the main
    port, so draining shows on both): Kubernetes gRPC probes cannot present certificates."""
    from grpc_health.v1 import health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return server, server.add_insecure_port(address)


# ---- channels --------------------------------------------------------------------------------
class _TokenMetadata:
    """Attach `authorization: Bearer <token>` to every call on the channel."""

    def __init__(self, token: str) -> None:
        self._entry = (TOKEN_METADATA_KEY, f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


# grpc.aio files each interceptor under the first call kind it implements, so one class per
# kind.
class _UnaryUnaryToken(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001
        return await continuation(self._details(details), request)


class _UnaryStreamToken(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001
        return await continuation(self._details(details), request)


class _StreamUnaryToken(_TokenMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):  # noqa: ANN001
        return await continuation(self._details(details), requests)


class _StreamStreamToken(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, requests):  # noqa: ANN001
        return await continuation(self._details(details), requests)


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    return [cls(token) for cls in (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken,
                                   _StreamStreamToken)]


def channel_credentials(creds: Credentials) -> grpc.ChannelCredentials:
    """Verify servers with the CA (system roots without one); present this process's
    certificate as the client certificate (mTLS)."""
    return grpc.ssl_channel_credentials(root_certificates=creds.ca, private_key=creds.key,
                                        certificate_chain=creds.cert)


def channel(address: str, creds: Credentials = PLAINTEXT) -> grpc.aio.Channel:
    """A channel with TLS when `creds` has a certificate or a CA (a public client may have
    only the CA), and the token when it has one."""
    options = list(CHANNEL_OPTIONS)
    if creds.server_name:
        options.append(("grpc.ssl_target_name_override", creds.server_name))
    interceptors = token_interceptors(creds.token) if creds.token is not None else None
    if creds.cert is None and creds.ca is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, channel_credentials(creds), options=options,
                                   interceptors=interceptors)
