"""Make a private CA, one cluster certificate and a cluster token (`kvferry make-certs`, tests).

The cluster certificate serves as every process's server certificate and as the client
certificate of internal calls, so it carries both serverAuth and clientAuth usages. Keys are
ECDSA P-256. Needs the `cryptography` package (test extra); production sites usually issue
certificates with their own PKI (cert-manager) and only need the flags.

Every process gets ca.crt, tls.crt, tls.key and token from the output directory; the CA key
signs certificates and nothing else, so it goes apart, into `private/` (mode 0700), to be kept
offline or deleted. Secret files are created owner-only (0600) before a byte is written.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from pathlib import Path
from typing import NamedTuple

DEFAULT_NAMES = ("localhost", "127.0.0.1")


class CertFiles(NamedTuple):
    ca_cert: Path
    ca_key: Path  # in a subdirectory of its own: no process needs it
    cert: Path  # the cluster certificate (server and client)
    key: Path
    token: Path

    def summary(self) -> str:
        """What `kvferry make-certs` prints: each file and who gets it."""
        return "\n".join([
            f"{self.ca_cert}: CA certificate, --tls-ca of every process and client",
            f"{self.cert}: cluster certificate, --tls-cert of the router and every worker",
            f"{self.key}: its key (secret), --tls-key of the router and every worker",
            f"{self.token}: cluster token (secret), --cluster-token-file of the same",
            f"{self.ca_key}: CA key (secret), for no process: keep it offline or delete it",
        ])


def _write(path: Path, data: bytes, is_secret: bool) -> Path:
    if not is_secret:
        path.write_bytes(data)
        return path
    # Owner-only from the start: a chmod after writing leaves a window where the key is
    # readable by others. O_CREAT's mode does not apply to a file left by an earlier run, so
    # that one is narrowed (while empty, after O_TRUNC) before the write.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        f.write(data)
    return path


def _sans(names: tuple[str, ...]) -> list:
    """Subject alternative names: IP addresses as IP SANs, the rest as DNS names."""
    from cryptography import x509

    sans: list[x509.GeneralName] = []
    for entry in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(entry)))
        except ValueError:
            sans.append(x509.DNSName(entry))
    return sans


def make_certs(out_dir: Path, names: tuple[str, ...] = DEFAULT_NAMES,
               valid_days: int = 365) -> CertFiles:
    """Write ca.crt, tls.crt, tls.key and token into `out_dir`, and the CA key into
    `out_dir/private/ca.key`. `names` become the certificate's subject alternative names (IP
    addresses as IP SANs, the rest as DNS)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out_dir.mkdir(parents=True, exist_ok=True)
    private = out_dir / "private"
    private.mkdir(mode=0o700, exist_ok=True)
    os.chmod(private, 0o700)  # mkdir's mode does not apply to a directory already there
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=valid_days)

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder().subject_name(name("kvferry CA")).issuer_name(name("kvferry CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(name("kvferry cluster")).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_sans(names)), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    pem = serialization.Encoding.PEM
    return CertFiles(
        ca_cert=_write(out_dir / "ca.crt", ca_cert.public_bytes(pem), is_secret=False),
        ca_key=_write(private / "ca.key", pem_key(ca_key), is_secret=True),
        cert=_write(out_dir / "tls.crt", cert.public_bytes(pem), is_secret=False),
        key=_write(out_dir / "tls.key", pem_key(key), is_secret=True),
        token=_write(out_dir / "token", secrets.token_hex(32).encode() + b"\n", is_secret=True),
    )
