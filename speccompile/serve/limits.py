"""What keeps hostile or broken clients from the engine's resources: a bound on request bodies, and
an idle timeout on connections that never send a request."""

import json


class BodyLimit:
    """An ASGI middleware that answers 413, in OpenAI's error shape, to a request body longer than
    `limit` bytes: by its Content-Length before anything is read, or as a chunked body grows past it
    (the route then sees the body end there, and its answer is replaced by the 413)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            await self._drain(receive)
            return await self._refuse(send)
        received, too_large = 0, False

        async def counted():
            nonlocal received, too_large
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit and not too_large:
                too_large = True
                if message.get("more_body"):
                    await self._drain(receive)
                return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def unless_too_large(message):
            if not too_large:
                await send(message)

        await self.app(scope, counted, unless_too_large)
        if too_large:
            await self._refuse(send)

    async def _drain(self, receive) -> None:
        """Read (and drop) what the client is still sending, up to 16 × the limit, so that a client
        that writes its whole body before it reads sees the 413 rather than a reset connection."""
        drained = 0
        while drained <= 16 * self.limit:
            message = await receive()
            drained += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                return

    async def _refuse(self, send) -> None:
        body = json.dumps({"error": {"message": f"the request body is larger than {self.limit} bytes",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def http_protocol():
    """uvicorn's HTTP/1.1 protocol, with its keep-alive timeout also on a new connection: a client
    that connects and sends nothing is disconnected after it, as an idle keep-alive connection is
    (uvicorn otherwise waits for a first request forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdleTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    return IdleTimeoutH11Protocol
