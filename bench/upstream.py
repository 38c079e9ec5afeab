"""The bench's TLS upstream: a tiny asyncio HTTP/1.1 server, cheap enough not to be measured.

    python bench/upstream.py HOST PORT CERT KEY

Keep-alive; any path answers a fixed small JSON body, except
  /sse  an event stream (chunked): the first event at once, 50 ms later the last and the end;
  /big  20 MiB of bytes with a Content-Length.
Prints "ready" once listening. Runs until killed.
"""

from __future__ import annotations

import asyncio
import ssl
import sys

BODY = b'{"id":"msg_bench","type":"message","content":[{"type":"text","text":"' + b"x" * 200 \
    + b'"}],"usage":{"input_tokens":10,"output_tokens":20}}'
SMALL = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
         + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
SSE_EVENT = b'event: message_start\ndata: {"type":"message_start"}\n\n'
SSE_PAUSE = 0.05
BIG_SIZE = 20 * 1024 * 1024
BIG_CHUNK = b"b" * (256 * 1024)
BIG_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: "
            + str(BIG_SIZE).encode() + b"\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
                return
            lines = head.split(b"\r\n")
            path = lines[0].split(b" ")[1] if b" " in lines[0] else b"/"
            length = 0
            close = False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
            if length:
                await reader.readexactly(length)
            if path.startswith(b"/sse"):
                writer.write(SSE_HEAD + chunk(SSE_EVENT))
                await writer.drain()
                await asyncio.sleep(SSE_PAUSE)  # a model thinking: a buffering proxy shows here
                writer.write(chunk(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
                             + b"0\r\n\r\n")
            elif path.startswith(b"/big"):
                writer.write(BIG_HEAD)
                for _ in range(BIG_SIZE // len(BIG_CHUNK)):
                    writer.write(BIG_CHUNK)
                    await writer.drain()
            else:
                writer.write(SMALL)
            await writer.drain()
            if close:
                return
    except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
        return
    finally:
        try:
            writer.close()
        except Exception:  # noqa: S110 - the peer is gone already
            pass


async def main(host: str, port: int, cert: str, key: str) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    server = await asyncio.start_server(handle, host, port, ssl=ctx, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]))
