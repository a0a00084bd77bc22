"""TLS for dsec's listeners and their callers: the files a service is given, the SSL
contexts made from them, and the local CA `dsec up --tls` runs a pool on.

A service serves TLS when it has a certificate and its key (`--tls-cert`, `--tls-key`)
and verifies the others against a CA bundle (`--ca`, DSEC_CA; unset: the system's
roots). The local CA (`make_local_pool_tls`) is made with `cryptography`: an EC P-256
CA that signs one server certificate naming every address of the pool (IP SANs), the
one certificate every service of that pool serves. The CA's key is never written: it
signs that certificate and is dropped, so nothing on disk can sign another, and a new
start makes a new CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dsec.statedir import private_dir, write_private

# long enough for a pool left running, short enough to be replaced by a restart
VALIDITY = dt.timedelta(days=365)
# a certificate dated from a little before now is valid on a host whose clock is behind
CLOCK_SKEW = dt.timedelta(minutes=5)
CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "server.pem", "server-key.pem"


@dataclass(frozen=True)
class TlsFiles:
    """A service's TLS files: the certificate (PEM, its chain after it) and key it serves
    with, both or neither; and the CA bundle that verifies the services it calls
    (None: the system's roots)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a TLS certificate needs its key, and a key its certificate")

    @property
    def serving(self) -> bool:
        return self.cert is not None

    def server_context(self) -> ssl.SSLContext | None:
        """What the listener serves with; None: plain HTTP. Raises OSError or
        ssl.SSLError for a file that is missing or is not a certificate and its key."""
        if self.cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        return context

    def client_ssl(self) -> ssl.SSLContext | Literal[True]:
        return client_ssl(self.ca)

    def args(self) -> list[str]:
        """The flags of `dsec controlplane` and `dsec agent` that give a child these files."""
        args = []
        if self.cert is not None:
            args += ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]
        if self.ca is not None:
            args += ["--ca", str(self.ca)]
        return args


def client_ssl(ca: str | Path | None) -> ssl.SSLContext | Literal[True]:
    """What an aiohttp connector verifies servers with: the CA bundle `ca`, alone, or
    (None) the system's roots, aiohttp's default. Host names and addresses are checked."""
    if ca is None:
        return True
    return ssl.create_default_context(cafile=str(ca))


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # fast to make, and every TLS stack has it


def _builder(subject: str, issuer: x509.Name, public_key, now: dt.datetime):
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _key_usage(*, digital_signature: bool = False, cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA that may sign server certificates and no other CA."""
    key = _new_key()
    subject = f"dsec local CA {name}"
    issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    cert = (
        _builder(subject, issuer, key.public_key(), dt.datetime.now(dt.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue_server_cert(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    name: str,
    addresses: Iterable[str],
    dns_names: Iterable[str] = ("localhost",),
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for a TLS server at any of `addresses` (IPs) and `dns_names`,
    signed by the CA."""
    key = _new_key()
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    sans += [x509.DNSName(d) for d in dns_names]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        _builder(f"dsec {name}", ca_cert.subject, key.public_key(), dt.datetime.now(dt.UTC))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def make_local_pool_tls(directory: Path, name: str, addresses: Iterable[str]) -> TlsFiles:
    """A new CA and one server certificate for `addresses`, written to `directory`
    (0700, every file 0600): the CA's certificate, the server's and its key."""
    private_dir(directory)
    ca_cert, ca_key = make_ca(name)
    cert, key = issue_server_cert(ca_cert, ca_key, name, addresses)
    files = TlsFiles(directory / CERT_FILE, directory / KEY_FILE, directory / CA_FILE)
    pem = serialization.Encoding.PEM
    write_private(files.ca, ca_cert.public_bytes(pem))
    write_private(files.cert, cert.public_bytes(pem))
    write_private(
        files.key,
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return files
