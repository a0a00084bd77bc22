"""HTTP/1.1 by hand over one connection, for what a well-behaved client never sends
(headers that are not UTF-8, requests that never end) and for connections held open,
from a loopback source address of the test's choosing: to the services, each address
is a different peer."""

from __future__ import annotations

import asyncio
import json
import ssl


class RawConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def to(
        cls, url: str, source: str | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> RawConnection:
        """A connection to `url`'s host and port, from address `source` (127.0.0.x) if
        given, over TLS with `ssl_context`."""
        host, port = url.split("://", 1)[1].split(":")
        return cls(
            *await asyncio.open_connection(
                host,
                int(port),
                local_addr=(source, 0) if source else None,
                ssl=ssl_context,
                server_hostname=host if ssl_context else None,
            )
        )

    async def get(self, path: str) -> bytes:
        """A keep-alive GET: the status line of its answer."""
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
        return (await self.answer())[0]

    async def request(
        self, method: str, path: str, headers: dict[str, bytes] | None = None, body: bytes = b""
    ) -> tuple[int, dict]:
        """A keep-alive request, its header values as bytes: the answer's status and JSON."""
        lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: test"]
        lines += [name.encode() + b": " + value for name, value in (headers or {}).items()]
        if body:
            lines += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
        self.writer.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        status, answer = await self.answer()
        return int(status.split()[1]), json.loads(answer)

    async def answer(self) -> tuple[bytes, bytes]:
        """The next answer's status line and body."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        status, *lines = head.strip().split(b"\r\n")
        fields = dict(line.split(b": ", 1) for line in lines)
        return status, await self.reader.readexactly(int(fields[b"Content-Length"]))

    async def rest(self, timeout: float = 10) -> bytes:
        """All it answers until the server closes it."""
        return await asyncio.wait_for(self.reader.read(), timeout)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()
