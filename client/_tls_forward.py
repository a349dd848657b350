"""A TLS forwarder for the ``jitserve`` JAX backend: ``python -m jitserve.client._tls_forward HOST PORT``.

jaxlib's IFRT proxy client speaks only plaintext gRPC or ALTS. For a server with
``JITSERVE_IFRT_TLS_CERT`` (a ``grpcs://`` target), ``client.ifrt_plugin`` starts this
process: it listens on 127.0.0.1 (only), prints its port, and forwards each connection
to ``HOST:PORT`` over TLS, HTTP/2 by ALPN as gRPC wants, verifying the server against
the system's CAs or ``JITSERVE_IFRT_CA`` (a PEM file). It exits when its stdin closes,
which is when the process that started it ends.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until the reader's end closes; then close the writer."""
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (OSError, ConnectionError):
        pass
    finally:
        writer.close()


async def forward(host: str, port: int, context: ssl.SSLContext, listener: socket.socket) -> None:
    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            remote_reader, remote_writer = await asyncio.open_connection(
                host, port, ssl=context, server_hostname=host)
        except OSError as e:  # the client sees its connection fail; the reason goes here
            print(f"jitserve: TLS connection to {host}:{port} failed: {e}", file=sys.stderr)
            writer.close()
            return
        await asyncio.gather(_pipe(reader, remote_writer), _pipe(remote_reader, writer))

    server = await asyncio.start_server(one, sock=listener)
    loop = asyncio.get_running_loop()
    parent_gone = loop.run_in_executor(None, sys.stdin.buffer.read)  # EOF when the parent ends
    async with server:
        await parent_gone


def main(argv: list[str]) -> None:
    host, port = argv[0], int(argv[1])
    context = ssl.create_default_context(cafile=os.environ.get("JITSERVE_IFRT_CA") or None)
    context.set_alpn_protocols(["h2"])
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    asyncio.run(forward(host, port, context, listener))
    os._exit(0)  # the executor thread may still be reading stdin


if __name__ == "__main__":
    main(sys.argv[1:])
