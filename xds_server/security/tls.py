"""TLS and mTLS credentials for the xDS port: files checked at startup (a message naming the
file and the problem), and re-read when they rotate (`CertificateWatcher`).

See docs/security.md, "TLS and mTLS on the xDS port".
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import grpc

log = logging.getLogger("trimtab.security")


class TlsConfigError(ValueError):
    """A TLS file that cannot be used; the message names the file and the problem."""


def _read_pem(path: str, what: str, marker: bytes) -> bytes:
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise TlsConfigError(f"{what} file {path!r} does not exist") from None
    except IsADirectoryError:
        raise TlsConfigError(f"{what} file {path!r} is a directory") from None
    except OSError as exc:
        raise TlsConfigError(f"{what} file {path!r} cannot be read: {exc.strerror}") from None
    if b"-----BEGIN " not in data or marker not in data:
        raise TlsConfigError(f"{what} file {path!r} holds no PEM {marker.decode()} block")
    return data


def _no_passphrase() -> str:
    raise TlsConfigError("encrypted private keys are not supported")


def _check_pair(cert_file: str, key_file: str, client_ca_file: str | None) -> None:
    """Let OpenSSL (stdlib ssl) parse the files: a bad PEM or a key that does not belong to
    the certificate fails here, at startup, instead of in every later handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except TlsConfigError as exc:
        raise TlsConfigError(f"private key file {key_file!r}: {exc}") from None
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise TlsConfigError(f"private key file {key_file!r} does not match certificate "
                                 f"file {cert_file!r}") from None
        raise TlsConfigError(f"certificate file {cert_file!r} or private key file "
                             f"{key_file!r} is invalid: {exc.reason or exc}") from None
    if client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=client_ca_file)
        except ssl.SSLError as exc:
            raise TlsConfigError(f"client CA file {client_ca_file!r} is invalid: "
                                 f"{exc.reason or exc}") from None


def _load_tls(cert_file: str, key_file: str, client_ca_file: str | None
              ) -> tuple[bytes, bytes, bytes | None]:
    """(key, certificate chain, client CA) PEM bytes, checked. Raises TlsConfigError."""
    cert = _read_pem(cert_file, "certificate", b"CERTIFICATE")
    key = _read_pem(key_file, "private key", b"PRIVATE KEY")
    ca = _read_pem(client_ca_file, "client CA", b"CERTIFICATE") if client_ca_file else None
    _check_pair(cert_file, key_file, client_ca_file)
    return key, cert, ca


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None,
                       require_client_cert: bool = False, *,
                       reload: bool = False) -> grpc.ServerCredentials:
    """TLS, or with `require_client_cert` mTLS, credentials for the xDS gRPC port.

    mTLS refuses, in the handshake, a client without a certificate signed by
    `client_ca_file`. grpcio cannot ask for an *optional* client certificate: without
    `require_client_cert` none is requested (so no peer identities), hence `client_ca_file`
    alone is refused as a likely mistake. Raises TlsConfigError naming the file and the
    problem.

    With `reload`, the files are re-read when they change (checked at each new TLS
    handshake), so a rotated certificate or CA applies to new connections without a restart;
    a broken rotation is logged and the previous files stay in use."""
    if require_client_cert != (client_ca_file is not None):
        raise TlsConfigError("require_client_cert and client_ca_file (the CA that signs the "
                             "Envoys' certificates) go together: grpcio cannot request an "
                             "optional client certificate")
    key, cert, ca = _load_tls(cert_file, key_file, client_ca_file)
    if not reload:
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_cert)
    watcher = CertificateWatcher(cert_file, key_file, client_ca_file)
    initial = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
    return grpc.dynamic_ssl_server_credentials(initial, watcher,
                                               require_client_authentication=require_client_cert)


def _file_state(path: str) -> tuple[int, int, int]:
    info = Path(path).stat()  # follows symlinks: a Kubernetes secret swap changes the inode
    return info.st_ino, info.st_mtime_ns, info.st_size


class CertificateWatcher:
    """grpc's certificate-configuration fetcher: called (on a gRPC thread) at each new
    handshake; returns a new configuration once the files changed and load cleanly."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None) -> None:
        self.files = (cert_file, key_file, client_ca_file)
        self.loaded = self._state()
        self.failed: tuple | None = None
        self.reloads = 0

    def _state(self) -> tuple:
        return tuple(_file_state(f) for f in self.files if f is not None)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        state: tuple | None = None  # None: a file is missing (mid-rotation)
        try:
            state = self._state()
            if state == self.loaded:
                return None
            key, cert, ca = _load_tls(*self.files)
        except (OSError, TlsConfigError) as exc:
            if state != self.failed:  # log a broken rotation once, keep serving the old files
                log.error("TLS files changed but cannot be used, keeping the previous ones: %s",
                          exc)
                self.failed = state
            return None
        self.loaded, self.failed, self.reloads = state, None, self.reloads + 1
        log.info("reloaded TLS certificate %s", self.files[0])
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
