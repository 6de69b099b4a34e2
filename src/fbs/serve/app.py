"""The HTTP server: Starlette routes over the :class:`~fbs.serve.batcher.Scheduler`, run by uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or server-sent events with
``stream: true``), ``GET /v1/models``, and ``GET /v1/fbs/status`` (slots, queue, counters) and ``GET /health``.
The engine runs in the scheduler's thread; each HTTP request waits on an asyncio queue that the scheduler feeds
through ``loop.call_soon_threadsafe``. A client that disconnects cancels its request, which frees its slot at
the next token boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import threading

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .batcher import Event, Limits, QueueFull, Request, RequestTimeout, Scheduler
from .protocol import APIError, Parsed, ServeContext, TextStream, chunk, new_id, parse, response, usage

logger = logging.getLogger(__name__)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, RequestTimeout):
        return APIError(408, str(e), None, "timeout_error", "request_timeout")
    if isinstance(e, ValueError):  # an option combination the engine refused
        return APIError(400, str(e))
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", None, "server_error")


class Server:
    """The app's state: the served model's name and limits, the scheduler."""

    def __init__(self, model, tokenizer=None, model_name: str = "fbs", limits: Limits | None = None,
                 defaults: dict | None = None):
        limits = limits or Limits()
        spec = model.base.spec
        if limits.context_length > spec.max_positions:
            limits = dataclasses.replace(limits, context_length=spec.max_positions)
        self.limits = limits
        self.ctx = ServeContext(model_name, tokenizer, limits.context_length, limits.max_tokens, spec.num_layers)
        self.scheduler = Scheduler(model, tokenizer, limits, defaults)
        self.tok = tokenizer

    # ---- routes -------------------------------------------------------------
    async def models(self, request: HTTPRequest) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.ctx.model_name, "object": "model", "created": 0, "owned_by": "fbs",
             "max_model_len": self.ctx.context_length}]})

    async def status(self, request: HTTPRequest) -> JSONResponse:
        return JSONResponse(self.scheduler.status())

    async def health(self, request: HTTPRequest) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def completions(self, request: HTTPRequest):
        return await self._generate(request, chat=False)

    async def chat(self, request: HTTPRequest):
        return await self._generate(request, chat=True)

    async def _generate(self, request: HTTPRequest, chat: bool):
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"the request body is not valid JSON: {e}") from e
            parsed = parse(body, self.ctx, chat)
        except APIError as e:
            return _error(e)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        req = Request(parsed.prompt, parsed.options, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            return _error(APIError(429, f"the server is busy: {e}", None, "rate_limit_error", "queue_full"))
        rid, name = new_id(chat), self.ctx.model_name
        if parsed.stream:
            return StreamingResponse(self._sse(req, events, parsed, rid, name), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._collect(request, req, events, parsed, rid, name)

    async def _collect(self, request: HTTPRequest, req: Request, events: asyncio.Queue, parsed: Parsed, rid: str,
                       name: str) -> JSONResponse:
        """Wait for the result; a client that disconnects meanwhile cancels the request."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    self.scheduler.cancel(req)
                    return JSONResponse({}, status_code=499)  # nobody reads it
                ev = get.result()
                if ev.kind == "error":
                    return _error(_engine_error(ev.error))
                if ev.kind == "done":
                    new = ev.result.new_tokens[0]
                    text = TextStream(self.tok, parsed.stop)
                    out = text.add(new) + text.finish()
                    return JSONResponse(response(rid, name, parsed.chat, out, ev.finish_reason,
                                                 usage(len(parsed.prompt), len(new), ev.summary)))
        finally:
            gone.cancel()

    async def _sse(self, req: Request, events: asyncio.Queue, parsed: Parsed, rid: str, name: str):
        """Server-sent events: a chunk per text delta, the final chunk, the usage chunk if asked, ``[DONE]``."""
        finished = False
        text = TextStream(self.tok, parsed.stop)
        try:
            if parsed.chat:
                yield _data(chunk(rid, name, True, None, role=True))
            while True:
                ev = await events.get()
                if ev.kind == "token":
                    delta = text.add(ev.tokens)
                    if delta:
                        yield _data(chunk(rid, name, parsed.chat, delta))
                    continue
                finished = True
                if ev.kind == "error":
                    yield _data(_engine_error(ev.error).body())
                else:
                    yield _data(chunk(rid, name, parsed.chat, text.finish() or None, ev.finish_reason))
                    if parsed.include_usage:
                        n = len(ev.result.new_tokens[0])
                        yield _data(chunk(rid, name, parsed.chat, None, use=usage(len(parsed.prompt), n, ev.summary)))
                yield "data: [DONE]\n\n"
                return
        finally:
            if not finished:  # the client went away (the response task was cancelled) or the stream broke
                self.scheduler.cancel(req)

    # ---- app ----------------------------------------------------------------
    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.scheduler.start()
            try:
                yield
            finally:
                self.scheduler.stop()

        routes = [Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/fbs/status", self.status, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"])]

        async def http_error(request, exc: HTTPException):
            return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None,
                                   "invalid_request_error", "not_found" if exc.status_code == 404 else None))

        return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client has disconnected (the body is read already: receive waits for the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(model, tokenizer=None, model_name: str = "fbs", limits: Limits | None = None,
               defaults: dict | None = None) -> Starlette:
    """The ASGI app serving ``model`` (an :class:`~fbs.FBSForCausalLM`) under ``model_name``; its scheduler is
    ``app.state.scheduler``."""
    server = Server(model, tokenizer, model_name, limits, defaults)
    app = server.app()
    app.state.scheduler = server.scheduler
    return app


# --------------------------------------------------------------------------- running it
def _uvicorn_config(app, host: str, port: int, log_level: str):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)


def run(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
        scheduler: Scheduler | None = None) -> None:
    """Serve until interrupted. With ``scheduler`` (the app's), the engine runs in this thread
    (:meth:`Scheduler.run_here`: OpenMP work is ~3x slower in a second thread on a small machine) and uvicorn in a
    background thread; SIGINT / SIGTERM (handled here when this is the main thread) or the server's exit stop
    both, the server gracefully."""
    import uvicorn

    server = uvicorn.Server(_uvicorn_config(app, host, port, log_level))
    if scheduler is None:
        server.run()
        return
    scheduler.use_caller_thread()  # the lifespan's start() must not start a thread of its own
    thread = threading.Thread(target=server.run, name="fbs-http", daemon=True)

    def stop(signum, frame):  # uvicorn handles signals only in the main thread, which is the engine's here
        server.should_exit = True
        scheduler.stop()

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread.start()
    try:
        scheduler.run_here(until=lambda: not thread.is_alive())
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        thread.join(10)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class ServerThread:
    """Serve ``app`` from a background thread on ``host`` (loopback by default) and a free port::

        with ServerThread(app) as srv:
            client = openai.OpenAI(base_url=srv.url, api_key="-")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(_uvicorn_config(app, host, self.port, log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="fbs-serve")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during start-up")
            self.thread.join(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()
