"""Raw servers on loopback that write exact bytes, the data-path clients under test, and TLS
material made at test time.

`RawServer(handler)` accepts connections and runs `handler(conn)` for each; `conn.request()`
reads one HTTP/1.1 request (head and Content-Length body) and returns None when the client
closed. Every connection and request is recorded, so a test can tell a reused connection from
a new one and a request sent once from one sent twice. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from gateway.servers.pool import Server
from gateway.upstream.aiohttp_client import AiohttpUpstream
from gateway.upstream.client import leg_error
from gateway.upstream.fast import FastUpstream

CLIENTS = ("fast", "aiohttp")
WAIT = 5.0  # bound of every wait on the other side


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@dataclass
class Request:
    head: bytes
    body: bytes
    connection: int  # which accepted connection carried it (1, 2, ...)

    def header(self, name: str) -> str | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower().encode():
                return value.strip().decode()
        return None


@dataclass
class Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    index: int
    server: RawServer
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)

    async def request(self) -> Request | None:
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await self.reader.readexactly(length)
        request = Request(head, body, self.index)
        self.server.requests.append(request)
        self.server.request_seen.set()
        return request

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def wait_client_close(self, timeout: float = WAIT) -> bool:
        """True once the client closed its side (EOF or reset) within `timeout`."""
        async def eof() -> None:
            with contextlib.suppress(ConnectionError):
                while await self.reader.read(65536):
                    pass
            self.closed_by_client.set()
        try:
            await asyncio.wait_for(eof(), timeout)
        except TimeoutError:
            return False
        return True


class RawServer:
    def __init__(self, handler, host: str = "127.0.0.1",
                 tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.host = host
        self.tls = tls
        self.conns: list[Conn] = []
        self.requests: list[Request] = []
        self.request_seen = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, self.host, 0, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for conn in self.conns:
            conn.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn(reader, writer, len(self.conns) + 1, self)
        self.conns.append(conn)
        try:
            await self.handler(conn)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def wait_requests(self, count: int, timeout: float = WAIT,
                            prefix: bytes = b"") -> None:
        """Until `count` requests (whose head starts with `prefix`) arrived."""
        async def enough() -> None:
            while sum(r.head.startswith(prefix) for r in self.requests) < count:
                self.request_seen.clear()
                await self.request_seen.wait()
        await asyncio.wait_for(enough(), timeout)


def response(body: bytes = b'{"ok":true}', status: str = "200 OK", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def answering(*replies: bytes, close: bool = False):
    """A keep-alive handler answering each request on a connection with the next reply."""
    async def handler(conn: Conn) -> None:
        for reply in replies:
            if await conn.request() is None:
                return
            await conn.send(reply)
        if not close:
            await conn.request()  # keep the connection until the client closes it
    return handler


WORKER = Server("http://upstream", "decode")


@contextlib.contextmanager
def translate_errors(leg: str, server: Server):
    """Errors raised inside named for the leg as the dispatcher's legs name them
    (`upstream.client.leg_error`)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - named for the leg, or raised as it is
        raise leg_error(leg, server.url, exc)  # noqa: B904


async def call(up, url: str, body: bytes = b'{"text":"hi"}') -> tuple[int, bytes]:
    """One POST read whole, errors translated as the dispatcher sees them."""
    with translate_errors("decode", WORKER):
        r = await up.post(url, "/generate", body, "rid-1")
        try:
            return r.status, await r.read()
        except BaseException:
            r.abort()
            raise


async def open_client(kind: str, max_connections: int = 16, pool_timeout: float = 5.0,
                      tls: ssl.SSLContext | None = None, connect_timeout: float = 2.0):
    if kind == "fast":
        return FastUpstream(connect_timeout, max_connections, pool_timeout, tls)
    up = AiohttpUpstream(connect_timeout, max_connections, pool_timeout, tls)
    await up.start()
    return up


# -- TLS material ----------------------------------------------------------------------------

@dataclass
class Certs:
    ca_file: Path
    cert_file: Path
    key_file: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def make_certs(out: Path) -> Certs:
    """A CA and a server certificate for localhost / 127.0.0.1 signed by it, as PEM files."""
    from cryptography import x509  # noqa: PLC0415 - only the TLS tests need it
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import NameOID  # noqa: PLC0415

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pd-gateway test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    certs = Certs(out / "ca.pem", out / "server.pem", out / "server.key")
    certs.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certs.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    certs.key_file.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return certs
