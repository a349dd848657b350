"""A TCP relay on loopback that delays each direction: a network's latency, here.

    python bench/_delay_relay.py PORT TARGET_PORT DELAY_MS

Each chunk read from one side is written to the other ``DELAY_MS`` after it was
read, in order (a link of that one-way latency and no bandwidth limit): a round
trip through it costs ``2 * DELAY_MS`` more than over loopback. Prints ``ready``
once it listens. bench/training.py runs it as a subprocess, so its event loop
takes no time from the client's process.
"""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    delivering = asyncio.create_task(deliver())
    try:
        while data := await reader.read(1 << 20):
            queue.put_nowait((loop.time() + delay, data))
    except (ConnectionError, OSError):
        pass
    queue.put_nowait((0.0, b""))
    try:
        await delivering
    except (ConnectionError, OSError):
        pass


async def main(port: int, target: int, delay: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer, delay), _pipe(up_reader, writer, delay))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1000))
