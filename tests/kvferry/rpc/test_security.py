"""Security settings validate their files; TLS ports require client certificates exactly when
asked (the router's --public-client-auth path), in-process on a health-only server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deploy.certs import CertFiles, make_certs
from kvferry.rpc import security
from kvferry.settings import RouterSettings, SecuritySettings


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_settings_name_the_bad_field(certs: CertFiles, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls_cert/tls_key"):
        SecuritySettings(tls_cert=str(certs.cert))
    with pytest.raises(ValueError, match="tls_ca"):
        SecuritySettings(tls_ca=str(certs.ca_cert))
    with pytest.raises(ValueError, match="cluster_token_file"):
        SecuritySettings(cluster_token_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is_public_client_auth"):
        RouterSettings(model="m", colocated=("a:1",), is_public_client_auth=True)
    ok = SecuritySettings(str(certs.cert), str(certs.key), str(certs.ca_cert),
                          cluster_token_file=str(certs.token))
    assert ok.is_tls and not SecuritySettings().is_tls


def test_a_token_without_tls_is_refused(certs: CertFiles) -> None:
    """It would be sent in plaintext; with TLS it loads."""
    with pytest.raises(ValueError, match="--tls-cert"):
        security.load(SecuritySettings(cluster_token_file=str(certs.token)))
    creds = security.load(SecuritySettings(str(certs.cert), str(certs.key),
                                           cluster_token_file=str(certs.token)))
    assert creds.is_tls and creds.token


def test_empty_token_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        security.read_token(tmp_path / "token")


async def _check(address: str, creds: security.Credentials) -> grpc.StatusCode:
    async with security.channel(address, creds) as chan:
        try:
            await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("require_client_auth", [False, True])
def test_client_certificates_are_required_only_when_asked(
        certs: CertFiles, require_client_auth: bool) -> None:
    server_creds = security.load(SecuritySettings(str(certs.cert), str(certs.key),
                                                  str(certs.ca_cert)))
    ca_only = security.Credentials(ca=certs.ca_cert.read_bytes())

    async def run() -> tuple[grpc.StatusCode, grpc.StatusCode, grpc.StatusCode]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = security.add_port(server, "127.0.0.1:0", server_creds, require_client_auth)
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            return (await _check(address, server_creds), await _check(address, ca_only),
                    await _check(address, security.PLAINTEXT))
        finally:
            await server.stop(None)

    with_cert, without_cert, plaintext = asyncio.run(run())
    assert with_cert == grpc.StatusCode.OK
    assert without_cert == (grpc.StatusCode.UNAVAILABLE if require_client_auth
                            else grpc.StatusCode.OK)
    assert plaintext == grpc.StatusCode.UNAVAILABLE
