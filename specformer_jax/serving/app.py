"""The HTTP side of `specformer serve`: a Starlette app with the OpenAI API's routes on a ServingEngine.

Each request is checked (protocol.py: HTTP 400 with the OpenAI error JSON), encoded, and queued on the engine;
its tokens come back through the engine's callbacks, which hand them to the request's asyncio queue on the event
loop. A streamed answer goes out as server-sent events as chunks of rounds end; a client that goes away abandons
its request, whose slot the engine frees at its next chunk boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from specformer_jax.decoding.encode import encode_prompts
from specformer_jax.errors import SpecformerError
from specformer_jax.serving import protocol as api
from specformer_jax.serving.engine import QueueFull, Request, ServingEngine, chat_ids
from specformer_jax.serving.text import TextStream

WATCH_SECONDS = 1.0  # how often a non-streamed request looks whether its client is still there


def build_app(engine: ServingEngine, served: str) -> Starlette:
    """The app serving `engine`'s model under the name `served`."""
    on = lambda handler, **kw: functools.partial(handler, engine, served, **kw)
    routes = [Route("/v1/completions", on(_answer, chat=False), methods=["POST"]),
              Route("/v1/chat/completions", on(_answer, chat=True), methods=["POST"]),
              Route("/v1/models", on(_models), methods=["GET"]), Route("/health", on(_health), methods=["GET"]),
              Route("/metrics", on(_metrics), methods=["GET"])]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.stop()  # after uvicorn has finished the requests in flight (or given up on them)

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})


async def _http_error(request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(api.error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                       "not_found_error" if exc.status_code == 404 else "invalid_request_error"),
                        status_code=exc.status_code)


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(api.error_body(message, kind, param), status_code=status)


async def _models(engine: ServingEngine, served: str, http: HTTPRequest) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": served, "object": "model",
                                                     "created": int(engine.metrics.started),
                                                     "owned_by": "specformer-jax"}]})


async def _health(engine: ServingEngine, served: str, http: HTTPRequest) -> JSONResponse:
    if engine.alive():
        return JSONResponse({"status": "ok"})
    return _error(503, f"the engine has stopped: {engine.error or 'shutting down'}", "server_error")


async def _metrics(engine: ServingEngine, served: str, http: HTTPRequest) -> PlainTextResponse:
    return PlainTextResponse(engine.metrics.text(), media_type="text/plain; version=0.0.4")


async def _answer(engine: ServingEngine, served: str, http: HTTPRequest, chat: bool):
    """A completion or chat completion: checked, queued, then answered whole or streamed."""
    try:
        body = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        engine.metrics.invalid += 1
        return _error(400, f"the request body is not valid JSON ({e})")
    try:
        job = api.parse_job(body, chat, served)
        ids, max_tokens = _encoded(engine, job)
    except api.BadRequest as e:
        engine.metrics.invalid += 1
        return _error(400, str(e), param=e.param)
    events: asyncio.Queue = asyncio.Queue()
    req = Request(ids, max_tokens, job.sampling, job.seed, _handoff(events, "tokens"), _handoff(events, "finish"))
    try:
        engine.submit(req)
    except QueueFull as e:
        return _error(503, str(e), "overloaded_error")
    except SpecformerError as e:
        return _error(503, str(e), "server_error")
    stream = TextStream(engine.model.tokenizer, job.stop)
    if job.stream:
        return StreamingResponse(_events(engine, served, job, req, stream, events), media_type="text/event-stream")
    return await _whole(engine, served, job, req, stream, events, http)


def _encoded(engine: ServingEngine, job: api.Job) -> tuple[list[int], int]:
    """The prompt's token ids and the answer's budget, checked against the context."""
    model, context = engine.model, engine.cfg.context
    try:
        ids = chat_ids(model, job.prompt) if job.chat else encode_prompts(model, [job.prompt], chat=False)[0]
    except SpecformerError as e:
        raise api.BadRequest(str(e).replace("prompt 0", "the prompt"), "messages" if job.chat else "prompt")
    if len(ids) >= context:
        raise api.BadRequest(f"the prompt has {len(ids)} tokens; this server's context holds {context} (prompt "
                             "and answer)", "messages" if job.chat else "prompt")
    if job.max_tokens is not None and len(ids) + job.max_tokens > context:
        raise api.BadRequest(f"max_tokens={job.max_tokens} with a prompt of {len(ids)} tokens needs "
                             f"{len(ids) + job.max_tokens} positions; this server's context holds {context}",
                             "max_tokens")
    return ids, job.max_tokens or context - len(ids)


def _handoff(events: asyncio.Queue, kind: str):
    """A callback for the engine thread that puts (kind, value) on `events` in the event loop's thread."""
    loop = asyncio.get_running_loop()

    def put(value) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed: nobody waits for this answer any more
            pass

    return put


async def _next_text(engine: ServingEngine, req: Request, stream: TextStream, events: asyncio.Queue, wait):
    """(new text, finish reason or None) after the next event; `wait` awaits the queue."""
    kind, value = await wait()
    if kind == "tokens":
        text = stream.add(value)
        if stream.stopped:
            engine.abandon(req)
            return text, "stop"
        return text, None
    if value.startswith("error") or value == "abandoned":
        raise SpecformerError(value if value != "abandoned" else "the server stopped before the answer was done")
    return stream.rest(), value


async def _whole(engine, served, job, req, stream: TextStream, events: asyncio.Queue, http: HTTPRequest):
    async def wait():
        while True:
            try:
                return await asyncio.wait_for(events.get(), WATCH_SECONDS)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    raise asyncio.CancelledError from None

    parts, finish = [], None
    try:
        while finish is None:
            text, finish = await _next_text(engine, req, stream, events, wait)
            parts.append(text)
    except SpecformerError as e:
        return _error(503, str(e), "server_error")
    except asyncio.CancelledError:
        engine.abandon(req)
        raise
    use = api.usage(len(req.ids), len(stream.ids))
    return JSONResponse(api.response(job, api.new_id(job.chat), served, "".join(parts), finish, use))


async def _events(engine, served, job, req, stream: TextStream, events: asyncio.Queue):
    """The server-sent events of a streamed answer; the request is abandoned if the client leaves first."""
    rid, finish = api.new_id(job.chat), None
    sse = lambda body: f"data: {json.dumps(body)}\n\n"
    try:
        if job.chat:
            yield sse(api.chunk(job, rid, served, "", first=True))
        while finish is None:
            text, finish = await _next_text(engine, req, stream, events, events.get)
            if text:
                yield sse(api.chunk(job, rid, served, text))
        use = api.usage(len(req.ids), len(stream.ids))
        yield sse(api.chunk(job, rid, served, None, finish, use))
        if job.include_usage:
            yield sse(api.chunk(job, rid, served, None, use=use))
        yield "data: [DONE]\n\n"
    except SpecformerError as e:
        finish = "error"
        yield sse(api.error_body(str(e), "server_error"))
        yield "data: [DONE]\n\n"
    finally:
        if finish is None:  # the client left (the response was cancelled) before the answer was done
            engine.abandon(req)
