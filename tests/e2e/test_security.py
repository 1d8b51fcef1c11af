"""A deployment with mutual TLS and a cluster token: the same greedy tokens as plaintext, and
no way into an internal service without the cluster credential (certificate and token).
Also the public port's message size cap, on the plaintext deployment."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy import client, zygote
from deploy.certs import CertFiles, make_certs
from deploy.launcher import Deployment
from kvferry.rpc import grpc_util, security
from kvferry.rpc.grpc_util import CHANNEL_OPTIONS
from kvferry.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import assert_alive, assert_pools_clean
from tests.doc_commands import find

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [3, 17, 40, 130]
MAX_TOKENS = 12



def _documented(prefix: str, folder: Path) -> list[str]:
    """docs/security.md's TLS command starting with `prefix`, as written, its `certs/`
    folder being `folder` (the docs' TLS commands run as shown)."""
    return [w.replace("certs/", f"{folder}/") if w.startswith("certs/") else
            (str(folder) if w == "certs" else w)
            for w in find("security.md", prefix).argv()]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """Made by docs/security.md's `kvferry make-certs` command, run as written."""
    from deploy.cli import main

    folder = tmp_path_factory.mktemp("documented") / "certs"
    assert main(_documented("kvferry make-certs", folder)) == 0
    return CertFiles(folder / "ca.crt", folder / "private" / "ca.key", folder / "tls.crt",
                     folder / "tls.key", folder / "token")


@pytest.fixture(scope="module")
def rogue_certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """Same names, another CA: not a cluster member."""
    return make_certs(tmp_path_factory.mktemp("rogue"))


@pytest.fixture(scope="module")
def health_port() -> int:
    return grpc_util.free_port()


@pytest.fixture(scope="module")
def secure_deployment(qwen3_checkpoint: Path, certs: CertFiles, health_port: int,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    flags = _documented("kvferry serve --tls-cert", certs.ca_cert.parent)[1:]  # as documented
    assert flags == ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key),
                     "--tls-ca", str(certs.ca_cert), "--cluster-token-file", str(certs.token)]
    deployment = Deployment(model=str(qwen3_checkpoint),
                            log_dir=tmp_path_factory.mktemp("secure-logs"), worker_args=flags,
                            role_args={"decode": ["--health-port", str(health_port)]},
                            router_args=flags).start()
    yield deployment
    deployment.stop()


def _ssl(certs: CertFiles, with_client_cert: bool = True) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=certs.ca_cert.read_bytes(),
        private_key=certs.key.read_bytes() if with_client_cert else None,
        certificate_chain=certs.cert.read_bytes() if with_client_cert else None)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Attach `authorization: Bearer <token>` to each call, in the calling thread, as the
    workers' own channels do. Not grpc.access_token_call_credentials: that metadata plugin
    runs Python on a gRPC Core thread, and closing a sync channel while it is pending
    deadlocks on the GIL (seen here: 1 close in ~20 after a refused TLS handshake)."""

    def __init__(self, token: str) -> None:
        self._entry = (security.TOKEN_METADATA_KEY, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout,
                            [*(details.metadata or ()), self._entry], details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # noqa: ANN001
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # noqa: ANN001
        return continuation(self._details(details), requests)


class _CallDetails(NamedTuple):  # grpc.ClientCallDetails has no public constructor
    method: str
    timeout: float | None
    metadata: list[tuple[str, str]]
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


def _with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    return channel if token is None else grpc.intercept_channel(channel, _BearerToken(token))


def _member_channel(certs: CertFiles, token: str | None):
    """A channel opener with the cluster's client certificate and `token` (None: no token)."""
    def open_channel(address: str) -> grpc.Channel:
        return _with_token(grpc.secure_channel(address, _ssl(certs), options=CHANNEL_OPTIONS),
                           token)
    return open_channel


def _token(certs: CertFiles) -> str:
    return security.read_token(certs.token)


def _assert_secure_pools_clean(deployment: Deployment, certs: CertFiles) -> None:
    assert_pools_clean(deployment, open_channel=_member_channel(certs, _token(certs)))


async def _generate(address: str, creds: security.Credentials,
                    requests: list[generation_pb2.GenerateRequest]) -> list[list[int]]:
    async def one(request: generation_pb2.GenerateRequest) -> list[int]:
        async with security.channel(address, creds) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            tokens: list[int] = []
            async for _, completion in client.stream(stub, request, 300):
                tokens = completion.token_ids
            return tokens
    return await asyncio.gather(*(one(r) for r in requests))


def test_mtls_deployment_is_token_exact(secure_deployment: Deployment, certs: CertFiles,
                                        qwen3_deployment: Deployment) -> None:
    """Same greedy tokens as the plaintext deployment; a public client needs only the CA."""
    gen = torch.Generator().manual_seed(7)
    requests = [client.make_request(torch.randint(1, 500, (n,), generator=gen).tolist(),
                                    temperature=0.0, max_tokens=MAX_TOKENS)
                for n in PROMPT_LENGTHS]
    public = security.Credentials(ca=certs.ca_cert.read_bytes())
    got = asyncio.run(_generate(secure_deployment.router_address, public, requests))
    expected = asyncio.run(_generate(qwen3_deployment.router_address, security.PLAINTEXT,
                                     requests))
    assert got == expected
    assert all(len(tokens) > 0 for tokens in got)
    _assert_secure_pools_clean(secure_deployment, certs)
    assert_alive(secure_deployment)


def test_plaintext_client_cannot_reach_workers_or_router(secure_deployment: Deployment) -> None:
    for address in [*secure_deployment.addresses("prefill"),
                    *secure_deployment.addresses("decode"), secure_deployment.router_address]:
        with grpc.insecure_channel(address) as chan:
            with pytest.raises(grpc.RpcError) as exc:
                health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, address


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return zygote.run(list(argv), dict(os.environ), Path(__file__).resolve().parents[2], 120)


def test_the_cli_client_needs_only_the_ca(secure_deployment: Deployment,
                                          certs: CertFiles) -> None:
    """`generate --tls-ca` alone (no client certificate: the public port
    does not ask for one) streams an answer; without it, the one line says to give it."""
    address = secure_deployment.router_address
    documented = _documented("kvferry generate --address 127.0.0.1:50051 --tls-ca",
                             certs.ca_cert.parent)  # as written
    documented[documented.index("--address") + 1] = address
    ok = _cli(*documented, "--max-tokens", "4", "--temperature", "0", "--ignore-eos")
    assert ok.returncode == 0, ok.stderr
    assert "[4 tokens, finish length]" in ok.stdout
    plain = _cli("generate", "--address", address, "--max-tokens", "4", "hello")
    assert plain.returncode == 1, plain.stderr
    lines = plain.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvferry: generate: UNAVAILABLE at "), lines
    assert "give --tls-ca" in lines[0]
    _assert_secure_pools_clean(secure_deployment, certs)


@pytest.mark.parametrize("who", ["no client certificate", "certificate of another CA"])
def test_tls_client_without_cluster_certificate_cannot_call_a_worker(
        who: str, secure_deployment: Deployment, certs: CertFiles,
        rogue_certs: CertFiles) -> None:
    if who == "no client certificate":
        creds = _ssl(certs, with_client_cert=False)
    else:  # trusts the cluster CA, but presents a certificate the workers do not trust
        creds = grpc.ssl_channel_credentials(certs.ca_cert.read_bytes(),
                                             rogue_certs.key.read_bytes(),
                                             rogue_certs.cert.read_bytes())
    for address in [*secure_deployment.addresses("prefill"),
                    *secure_deployment.addresses("decode")]:
        # even with the token
        with _with_token(grpc.secure_channel(address, creds), _token(certs)) as chan:
            with pytest.raises(grpc.RpcError) as exc:
                worker_pb2_grpc.DecodeServiceStub(chan).GetStats(worker_pb2.GetStatsRequest(),
                                                                 timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, (who, address)


def _internal_calls(prefill: grpc.Channel, decode: grpc.Channel) -> dict[str, object]:
    """Each internal RPC, called once; returns what raising it gives."""
    chunk = worker_pb2.KvChunk(request_id="victim", num_tokens=5, layer_start=0, layer_end=1,
                               num_blocks=1, data=b"\0" * 64)
    command = worker_pb2.DecodeCommand(start=worker_pb2.DecodeRequest(request_id="victim"))
    p_stub = worker_pb2_grpc.PrefillServiceStub(prefill)
    d_stub = worker_pb2_grpc.DecodeServiceStub(decode)
    local = worker_pb2_grpc.PrefillServiceStub(decode)
    kv = worker_pb2_grpc.KvTransferServiceStub(decode)
    prefill_request = worker_pb2.PrefillRequest(request_id="victim", prompt_token_ids=[1, 2])
    return {
        "PushKv": lambda: kv.PushKv(iter([chunk]), timeout=5),
        "Reserve": lambda: d_stub.Reserve(worker_pb2.ReserveRequest(
            request_id="victim", num_prompt_tokens=5, max_tokens=4, lease_s=30), timeout=5),
        "GetStats decode": lambda: d_stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5),
        "GetStats prefill": lambda: p_stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5),
        "Prefill": lambda: list(p_stub.Prefill(prefill_request, timeout=5)),
        "Prefill local": lambda: list(local.Prefill(prefill_request, timeout=5)),
        "Abort": lambda: d_stub.Abort(generation_pb2.AbortRequest(request_id="victim"),
                                      timeout=5),
        "DecodeStream": lambda: list(d_stub.DecodeStream(iter([command]), timeout=5)),
    }


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_internal_rpcs_without_the_token_are_unauthenticated(
        token: str | None, secure_deployment: Deployment, certs: CertFiles) -> None:
    """A valid client certificate is not enough: every internal RPC needs the token too."""
    open_channel = _member_channel(certs, token)
    with open_channel(secure_deployment.addresses("prefill")[0]) as prefill, \
            open_channel(secure_deployment.addresses("decode")[0]) as decode:
        for name, call in _internal_calls(prefill, decode).items():
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        # Health checks stay open to members without the token (Kubernetes probes).
        reply = health_pb2_grpc.HealthStub(decode).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    _assert_secure_pools_clean(secure_deployment, certs)  # nothing was reserved
    assert_alive(secure_deployment)


def test_plaintext_health_port_serves_only_health(secure_deployment: Deployment,
                                                  health_port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as chan:
        reply = health_pb2_grpc.HealthStub(chan).Check(
            health_pb2.HealthCheckRequest(service="kvferry.v1.DecodeService"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as exc:
            worker_pb2_grpc.DecodeServiceStub(chan).GetStats(worker_pb2.GetStatsRequest(),
                                                             timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_oversize_generate_is_resource_exhausted(qwen3_deployment: Deployment) -> None:
    """The public port caps incoming messages well below the internal 64 MiB; the router
    refuses before parsing and keeps serving."""
    huge = client.make_request("a" * (grpc_util.PUBLIC_MAX_RECEIVE_BYTES + 1024), max_tokens=2)

    async def send() -> grpc.aio.AioRpcError:
        async with grpc_util.channel(qwen3_deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in stub.Generate(huge, timeout=30):
                    pass
            return exc.value

    error = asyncio.run(send())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    got = asyncio.run(client.generate(qwen3_deployment.router_address,
                                      client.make_request([1, 2, 3], max_tokens=3,
                                                          ignore_eos=True), 60))
    assert len(got.token_ids) == 3
    assert_alive(qwen3_deployment)
    assert_pools_clean(qwen3_deployment)
