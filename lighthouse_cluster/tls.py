"""TLS for the gRPC client ports: server credentials, client credentials and channel creation.

One place decides how a node serves and how anything of ours dials a node:

* ``ServerTLS``: the node's certificate and key, and optionally a CA whose signed client
  certificates it then requires (mutual TLS). ``None`` everywhere means plaintext, as torchft.
* ``ClientTLS``: the CA that signs the nodes' certificates (None = the system's roots) and
  optionally a client certificate and key (for a node that requires client certificates).
* ``channel`` / ``aio_channel``: an insecure channel when ``tls`` is None, else a secure one.

Environment variables (the CLI's flags default to them; ftclient reads them):
``LIGHTHOUSE_CLUSTER_TLS_CA``, ``LIGHTHOUSE_CLUSTER_TLS_CLIENT_CERT``,
``LIGHTHOUSE_CLUSTER_TLS_CLIENT_KEY`` (client side, file paths) and, on ``serve``,
``LIGHTHOUSE_CLUSTER_TLS_CERT``, ``LIGHTHOUSE_CLUSTER_TLS_KEY``,
``LIGHTHOUSE_CLUSTER_TLS_CLIENT_CA``. An endpoint written ``https://`` or ``grpcs://`` means
TLS; ``http://`` or a bare ``host:port`` means plaintext unless a CA is configured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import grpc

from lighthouse_cluster.durable_files import make_directory_durably, write_durably

ENV_CA = "LIGHTHOUSE_CLUSTER_TLS_CA"
ENV_CLIENT_CERT = "LIGHTHOUSE_CLUSTER_TLS_CLIENT_CERT"
ENV_CLIENT_KEY = "LIGHTHOUSE_CLUSTER_TLS_CLIENT_KEY"
TLS_SCHEMES = ("https://", "grpcs://")


class TLSConfigError(ValueError):
    """A TLS file that cannot be read or a combination that cannot work."""


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None or str(path) == "":
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TLSConfigError(f"cannot read {what} {path}: {e.strerror}") from None


@dataclass(frozen=True)
class ServerTLS:
    """A node's server side: PEM bytes of its certificate chain and key, and the client CA."""

    cert_chain: bytes
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: str | Path | None, key: str | Path | None,
                   client_ca: str | Path | None = None) -> "ServerTLS | None":
        if not cert and not key:
            if client_ca:
                raise TLSConfigError("--tls-client-ca needs --tls-cert and --tls-key (client certificates "
                                     "are only checked on a TLS port)")
            return None
        if not cert or not key:
            raise TLSConfigError("TLS needs both --tls-cert and --tls-key")
        return cls(cert_chain=_read(cert, "--tls-cert") or b"", private_key=_read(key, "--tls-key") or b"",
                   client_ca=_read(client_ca, "--tls-client-ca"))

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)],
                                           root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    """How to dial a TLS node: trusted roots (None = system roots), optional client cert."""

    root_ca: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_files(cls, ca: str | Path | None = None, cert: str | Path | None = None,
                   key: str | Path | None = None) -> "ClientTLS":
        if bool(cert) != bool(key):
            raise TLSConfigError("a client certificate needs both its certificate and its key file")
        return cls(root_ca=_read(ca, "TLS CA"), client_cert=_read(cert, "client certificate"),
                   client_key=_read(key, "client key"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ClientTLS | None":
        """The client TLS settings in the environment, or None when none is set."""
        env = os.environ if env is None else env
        ca, cert, key = env.get(ENV_CA), env.get(ENV_CLIENT_CERT), env.get(ENV_CLIENT_KEY)
        if not (ca or cert or key):
            return None
        return cls.from_files(ca, cert, key)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_ca, private_key=self.client_key,
                                            certificate_chain=self.client_cert)


def wants_tls(endpoints: str | Sequence[str] | None) -> bool:
    """True when any endpoint is written with a TLS scheme (``https://`` or ``grpcs://``)."""
    if not endpoints:
        return False
    items = endpoints.replace(",", " ").split() if isinstance(endpoints, str) else list(endpoints)
    return any(e.strip().lower().startswith(TLS_SCHEMES) for e in items)


def client_tls_for(endpoints: str | Sequence[str] | None, ca: str | Path | None = None,
                   cert: str | Path | None = None, key: str | Path | None = None,
                   env: Mapping[str, str] | None = None) -> ClientTLS | None:
    """Client TLS for dialing ``endpoints``: explicit files first, then the environment;
    an ``https://``/``grpcs://`` endpoint with nothing configured uses the system's roots."""
    if ca or cert or key:
        return ClientTLS.from_files(ca, cert, key)
    from_env = ClientTLS.from_env(env)
    if from_env is not None:
        return from_env
    return ClientTLS() if wants_tls(endpoints) else None


def channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A blocking channel to ``address``: plaintext when ``tls`` is None."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.credentials(), options=options)


def aio_channel(address: str, tls: ClientTLS | None,
                options: Sequence[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``address``: plaintext when ``tls`` is None."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


# -- a throw-away PKI for `lighthouse-cluster up --tls` and the tests -----------------------------


@dataclass(frozen=True)
class PKIFiles:
    """Paths of a generated CA, a server certificate and a client certificate."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_tls(self, with_cert: bool = True) -> ClientTLS:
        return ClientTLS.from_files(self.ca_cert, self.client_cert if with_cert else None,
                                    self.client_key if with_cert else None)


def generate_pki(directory: str | Path, hosts: Sequence[str] = ("127.0.0.1", "localhost", "::1"),
                 days: int = 30) -> PKIFiles:
    """Write a fresh CA (ca.pem; its key is not kept), a server certificate for ``hosts``
    (server.pem/server.key, also usable as a client certificate between nodes) and a client
    certificate (client.pem/client.key) into ``directory``. Keys are written mode 0600."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    make_directory_durably(out)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("lighthouse-cluster test CA")).issuer_name(
        name("lighthouse-cluster test CA")).public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256()))

    def issue(cn: str, sans: list[x509.GeneralName], usages: list[x509.ObjectIdentifier]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))

    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(h))
    server = issue("lighthouse-cluster node", sans, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    client = issue("lighthouse-cluster client", [], [ExtendedKeyUsageOID.CLIENT_AUTH])
    files = PKIFiles(out / "ca.pem", out / "server.pem", out / "server.key", out / "client.pem", out / "client.key")
    # Each file durably (temp file, fsync, rename, directory fsync): the nodes trust them after a
    # restart, and a power loss must not leave a key half written. Keys readable by their owner only.
    write_durably(files.ca_cert, ca.public_bytes(serialization.Encoding.PEM))
    for path, data in ((files.server_cert, server[0]), (files.client_cert, client[0])):
        write_durably(path, data)
    for path, data in ((files.server_key, server[1]), (files.client_key, client[1])):
        write_durably(path, data, mode=0o600)
    return files
