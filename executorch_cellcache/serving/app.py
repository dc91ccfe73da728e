"""The HTTP face of ``cellcache serve``: FastAPI routes, lifespan, auth and
errors. It maps HTTP onto ``completions`` (requests and responses) and never
touches the cache.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions`` (``stream`` for server-sent events), ``GET /health``
(503 while the program loads, then 200), ``GET /metrics`` (Prometheus text),
``GET /`` the chat page (static files under ``/static/``, from the package's
``serving/static/``). With an API key, every ``/v1`` route wants
``Authorization: Bearer KEY`` (401 otherwise); ``/health``, ``/metrics`` and
the page stay open (the page holds nothing; it sends the key a person types
with each of its ``/v1`` calls).

Errors: every non-2xx answer carries OpenAI's body ``{"error": {"message",
"type", "param", "code"}}``, built by ``error_response`` alone. A client's
mistake is a 4xx: malformed JSON, wrong types, bad values (400), a bad key
(401), an unknown model or route (404), a body over ``MAX_BODY_BYTES``
(413), a full wait queue (429). A 5xx means the server failed (a forward
that failed, 503 while loading or shutting down).
"""

import asyncio
import hmac
import logging
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from executorch_cellcache.runtime.runner import Runner
from executorch_cellcache.serving import completions
from executorch_cellcache.serving import protocol as p
from executorch_cellcache.serving.chat_template import ChatTemplate
from executorch_cellcache.serving.engine import (
    Engine,
    EngineError,
    QueueFullError,
    RequestError,
)
from executorch_cellcache.serving.metrics import CONTENT_TYPE, Metrics

MAX_BODY_BYTES = 4 * 1024 * 1024
STATIC = Path(__file__).resolve().parent / "static"   # the chat page: index.html, chat.js, chat.css
log = logging.getLogger("uvicorn.error")  # uvicorn configures it: our lines beside its own

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: Optional[str] = None,
               code: Optional[str] = None) -> p.ErrorBody:
    return p.ErrorBody(error=p.ErrorDetail(message=message, type=_TYPES.get(status, "error"),
                                           param=param, code=code))


def error_response(status: int, message: str, param: Optional[str] = None,
                   code: Optional[str] = None) -> JSONResponse:
    """The one place an error answer is built (OpenAI's error body)."""
    return JSONResponse(error_body(status, message, param, code).model_dump(),
                        status_code=status)


def _served(request: Request) -> completions.Served:
    state = request.app.state
    if state.served is None:
        detail = f": {state.load_error}" if state.load_error else ""
        raise APIError(503, f"the model is {'not loaded' if detail else 'loading'}{detail}")
    return state.served


def _check_key(request: Request) -> None:
    key = request.app.state.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                       code="invalid_api_key")


async def _body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body has {declared} bytes; the limit is "
                            f"{MAX_BODY_BYTES}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than the {MAX_BODY_BYTES}-byte "
                                f"limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(model_cls, body: bytes):
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON ({err['msg']})") from None
        loc = ".".join(str(x) for x in err["loc"])
        given = "" if err["type"] == "missing" else f", got {err.get('input')!r}"[:120]
        raise APIError(400, f"{loc or 'the body'}: {err['msg']}{given}",
                       param=str(err["loc"][0]) if err["loc"] else None) from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _accept(request: Request, model_cls, to_submissions, prompt_field: str):
    """Auth, body, schema, model and the request's submissions to the engine
    (all or none) -> (parsed request, Served, handles)."""
    _check_key(request)
    req = _parse(model_cls, await _body(request))
    served = _served(request)
    _check_model(served, req.model)
    handles = []
    try:
        for prompt, params, stops, constraint in to_submissions(req, served):
            handles.append(served.engine.submit(prompt, params, stops, prompt_field,
                                                constraint))
    except (RequestError, QueueFullError, EngineError) as e:
        for h in handles:
            served.engine.cancel(h)
        if isinstance(e, RequestError):
            raise APIError(400, str(e), param=e.param) from None
        if isinstance(e, QueueFullError):
            raise APIError(429, str(e), code="queue_full") from None
        raise APIError(503, str(e)) from None
    return req, served, handles


async def _respond(request: Request, handles, served, stream: bool, make_stream,
                   make_response):
    """Streams SSE or answers once; a client that disconnects has its
    requests cancelled (their cells are freed before the next step)."""
    if stream:
        return StreamingResponse(_guarded_stream(request, handles, served, make_stream),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        return await make_response(gone)
    except completions.ClientGone:
        return Response(status_code=499)  # nobody reads it
    except EngineError as e:
        raise APIError(500, str(e)) from None
    finally:
        gone.cancel()


async def _guarded_stream(request, handles, served, make_stream):
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        async for line in make_stream(gone):
            yield line
    except completions.ClientGone:
        return
    except EngineError as e:
        yield completions.sse(error_body(500, str(e)))
        yield completions.DONE
    finally:
        gone.cancel()
        for h in handles:
            served.engine.cancel(h)  # a no-op for finished requests


def _load(app: FastAPI, pte_path: Path, names: Tuple[str, ...], max_queue: int,
          on_failure: Callable[[], None], tokenizer, runner_options: dict, speculative):
    try:
        runner = Runner(pte_path, **runner_options)
        tok = tokenizer or runner.tokenizer
        if tok is None:
            raise ValueError(f"{pte_path} carries no tokenizer; the server needs one (export a "
                             f"checkpoint folder that has tokenizer.json)")
        info = runner.info
        template = ChatTemplate.for_program(info, tok)
        engine = Engine(runner, max_queue, app.state.metrics, tok, speculative)
        engine.start()
        app.state.served = completions.Served(engine, names, template)
        cells = ", ".join(f"{p.name} {p.capacity}" for p in runner.pools.pools) \
            if len(runner.pools) > 1 else str(info.n_cells)
        log.info("serving %s (%s, %s cells) as %s", pte_path, info.model_type, cells,
                 ", ".join(f"'{n}'" for n in names))
    except Exception as e:  # any load failure is reported, then the server stops
        app.state.load_error = str(e) or type(e).__name__
        log.error("cannot serve %s: %s", pte_path, app.state.load_error)
        on_failure()


def create_app(pte_path, api_key: Optional[str] = None, max_queue: int = 64,
               on_load_failure: Callable[[], None] = lambda: None,
               tokenizer=None, runner_options: Optional[dict] = None,
               speculative=None,
               served_model_names: Optional[Sequence[str]] = None) -> FastAPI:
    """The server's ASGI app. The program loads in a background thread once
    the app starts (``/health`` answers 503 meanwhile); a program that fails
    to load sets ``app.state.load_error`` and calls ``on_load_failure``.
    ``tokenizer`` replaces the program's (an object with the runtime
    tokenizers' methods; the benchmark serves a program that carries none).
    runner_options: keyword arguments of Runner (prefix_cache, prefix_cache_cells).
    speculative: speculative decoding for every request (Runner.proposer's
    argument: None, "lookup" or a runtime.speculative.Speculative); a bad one
    is a load failure.
    served_model_names: the names ``/v1/models`` lists and a request's
    ``model`` may name, the first reported in responses (None: the program
    file's stem); ValueError, before anything loads, for none, an empty one
    or a duplicate (completions.served_names)."""
    pte_path = Path(pte_path)
    names = completions.served_names(served_model_names, pte_path.stem)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=_load, name="cellcache-load",
                                  args=(app, pte_path, names, max_queue, on_load_failure,
                                        tokenizer, runner_options or {}, speculative),
                                  daemon=True)
        loader.start()
        yield
        loader.join()
        if app.state.served is not None:
            app.state.served.engine.stop()

    app = FastAPI(title="cellcache serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.served = None
    app.state.load_error = None
    app.state.api_key = api_key
    app.state.metrics = Metrics()

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) \
            else str(e.detail)
        return error_response(e.status_code, message)

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal server error ({type(e).__name__}: {e})")

    @app.get("/health")
    async def health(request: Request):
        state = request.app.state
        if state.served is None:
            status = {"status": "failed", "error": state.load_error} if state.load_error \
                else {"status": "loading"}
            return JSONResponse(status, status_code=503)
        return {"status": "ok"}

    @app.get("/")
    async def chat_page():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(request.app.state.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(request)
        served = _served(request)
        created = p.now()
        return p.ModelList(data=[p.ModelCard(id=name, created=created) for name in served.names])

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req, served, handles = await _accept(request, p.ChatCompletionRequest,
                                             completions.chat_submissions, "messages")
        return await _respond(
            request, handles, served, req.stream,
            lambda gone: completions.chat_stream(req, served, handles[0], gone),
            lambda gone: completions.chat_response(req, served, handles[0], gone))

    @app.post("/v1/completions")
    async def complete(request: Request):
        req, served, handles = await _accept(request, p.CompletionRequest,
                                             completions.completion_submissions, "prompt")
        return await _respond(
            request, handles, served, req.stream,
            lambda gone: completions.completion_stream(req, served, handles, gone),
            lambda gone: completions.completion_response(req, served, handles, gone))

    return app


def _check_model(served: completions.Served, name: Optional[str]) -> None:
    try:
        served.check_model(name)
    except LookupError as e:
        raise APIError(404, str(e), param="model", code="model_not_found") from None
