"""A throwaway CA and leaf certificates for TLS/mTLS tests (the `cryptography` package).

`TestCA.create(directory)` writes `ca.pem`; `ca.issue(name, ...)` writes `<name>.pem` and
`<name>-key.pem` signed by it, with the SANs given. EC P-256 keys: fast to generate, and both
grpcio (BoringSSL) and Envoy accept them.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=1)


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key.read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _sans(dns: Sequence[str], uris: Sequence[str], ips: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    names += [x509.UniformResourceIdentifier(u) for u in uris]
    names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    return names


@dataclass
class TestCA:
    directory: Path
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    path: Path  # ca.pem

    __test__ = False  # not a pytest test class

    @classmethod
    def create(cls, directory: Path, common_name: str = "trimtab test CA") -> TestCA:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(_name(common_name)).issuer_name(_name(common_name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + _VALID)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                             False, False), critical=True)
                .sign(key, hashes.SHA256()))
        path = directory / "ca.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(directory, key, cert, path)

    def issue(self, name: str, *, common_name: str | None = None, dns: Sequence[str] = (),
              uris: Sequence[str] = (), ips: Sequence[str] = ()) -> CertFiles:
        """A leaf certificate usable as both a TLS server and a TLS client certificate."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder()
                   .subject_name(_name(common_name or name)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + _VALID)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), False))
        sans = _sans(dns, uris, ips)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        files = CertFiles(self.directory / f"{name}.pem", self.directory / f"{name}-key.pem")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, files.key)
        return files

    def server(self, name: str = "server") -> CertFiles:
        """A server certificate for 127.0.0.1 and localhost."""
        return self.issue(name, dns=["localhost"], ips=["127.0.0.1"])
