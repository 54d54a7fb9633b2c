"""The HTTP side of `specdec serve` (FastAPI): OpenAI's /v1/completions, /v1/chat/completions
(streamed as server-sent events or not), /v1/models, /health and /metrics. Handlers parse and
check a request, submit it to the Scheduler and turn the tokens it hands back into text; they
never touch the engine. A client that disconnects (or a stop string that matches) cancels its
request, which then leaves its batch at the next step boundary."""
import asyncio
import json
import logging
import time
from typing import AsyncIterator, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec_inductor.loading import encode
from specdec_inductor.sampler import SamplingParams
from specdec_inductor.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                             ResponseShape, bad_request, parse)
from specdec_inductor.serve.scheduler import (CANCELLED, STOP, ContextLengthError, Delta,
                                              QueueFullError, ServeRequest)
from specdec_inductor.serve.text import StopText
from specdec_inductor.serve.trace import HANDED, RECEIVED, SENT, TOKENIZED, Trace

log = logging.getLogger("specdec.serve")

# How often a handler waiting for tokens checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


def chat_ids(tokenizer, messages: List[dict]) -> List[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready for the
    assistant's turn (loading.encode does the same for one user message)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class Deliveries:
    """Deltas from the scheduler thread to the handlers' event loop: each request's on_delta
    buffers its Delta (put), and the Scheduler's flush, once per step, hands every loop its
    Deltas in one call_soon_threadsafe (one wake-up of the loop per step, whatever the number
    of requests). Both run in the scheduler thread only."""

    def __init__(self):
        self._pending: Dict[asyncio.AbstractEventLoop, List[Tuple[asyncio.Queue, Delta]]] = {}

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, delta: Delta) -> None:
        self._pending.setdefault(loop, []).append((queue, delta))

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_hand_over, items)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass


def _hand_over(items: List[Tuple[asyncio.Queue, Delta]]) -> None:
    for queue, delta in items:  # in step order: each request's Deltas stay in order
        queue.put_nowait(delta)


class Service:
    """What the handlers share: the running Scheduler, the tokenizer, the served model's name,
    the metrics, the max_tokens of a request that gives none, and the Deliveries whose flush
    the scheduler calls."""

    def __init__(self, scheduler, tokenizer, model_name: str, metrics, default_max_tokens: int,
                 deliveries: Deliveries, trace: Optional[Trace] = None):
        self.scheduler, self.tokenizer, self.model_name = scheduler, tokenizer, model_name
        self.metrics, self.default_max_tokens = metrics, default_max_tokens
        self.deliveries, self.trace = deliveries, trace

    # -- a request, checked -------------------------------------------------------------------
    def prompt_ids(self, body, chat: bool) -> List[int]:
        if chat:
            ids = chat_ids(self.tokenizer, body.chat())
        elif isinstance(body.prompt, str):
            ids = encode(self.tokenizer, body.prompt, chat=False)
        else:
            ids = list(body.prompt)
        if not ids:
            raise bad_request("the prompt is empty", "messages" if chat else "prompt")
        return ids

    def serve_request(self, body, chat: bool, ids: List[int], on_delta) -> ServeRequest:
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist (this server serves "
                                f"`{self.model_name}`)", "model", code="model_not_found")
        max_tokens = (body.new_tokens() if chat else body.max_tokens) or self.default_max_tokens
        temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default
        try:
            sampling = SamplingParams(temperature, body.top_k or 0,
                                      1.0 if body.top_p is None else body.top_p, body.seed)
            self.scheduler.check(ids, max_tokens, body.speculative is not False)
        except ContextLengthError as exc:
            param = "messages" if chat and exc.param == "prompt" else exc.param
            raise bad_request(str(exc), param, code="context_length_exceeded") from None
        except ValueError as exc:  # "argument 'x' ..." from SamplingParams / check_request
            raise bad_request(str(exc), _argument(str(exc), chat), code="invalid_value") from None
        return ServeRequest(ids, max_tokens, sampling, on_delta,
                            speculative=body.speculative is not False)

    # -- answering ------------------------------------------------------------------------------
    async def answer(self, http: Request, body, chat: bool, received: float):
        """received: when the handler began (perf_counter; before the body was read)."""
        ids = self.prompt_ids(body, chat)
        tokenized = time.perf_counter()
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def on_delta(delta: Delta) -> None:  # the scheduler thread
            self.deliveries.put(loop, queue, delta)

        request = self.serve_request(body, chat, ids, on_delta)
        request.mark(RECEIVED, received)
        request.mark(TOKENIZED, tokenized)
        text = StopText(self.tokenizer, body.stop_strings())
        try:
            self.scheduler.submit(request)
        except QueueFullError as exc:
            raise APIError(429, str(exc), type="rate_limit_error",
                           code="rate_limit_exceeded") from None
        except RuntimeError as exc:
            raise APIError(503, str(exc), type="server_error") from None
        shape = ResponseShape(chat, self.model_name)
        # A streamed answer learns of a disconnect from Starlette, which cancels the stream;
        # a whole answer from a watcher that polls the connection.
        pieces = self._pieces(None if body.stream else http, request, queue, text, shape.id)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._events(shape, pieces, request, text, usage),
                                     media_type="text/event-stream")
        answer, reason = [], None
        async for piece, reason in pieces:
            answer.append(piece)
        if reason is None:  # the client left
            return JSONResponse({}, status_code=499)
        return JSONResponse(shape.full("".join(answer), reason, len(ids), text.tokens_used))

    async def _pieces(self, http: Optional[Request], request: ServeRequest,
                      queue: asyncio.Queue, text: StopText, answer_id: str
                      ) -> AsyncIterator[Tuple[str, Optional[str]]]:
        """(new text, finish_reason on the last piece) as the request's tokens arrive; ends
        without a finish_reason when the client disconnected (http: watched for that, None:
        the caller learns of it otherwise). Whatever ends it early (a stop string, a
        disconnect, an error, a cancelled stream) cancels the request. The request's trace
        line (--trace) is written when it ends."""
        watcher = (asyncio.ensure_future(_watch_disconnect(http, queue)) if http is not None
                   else None)
        try:
            while True:
                delta = await queue.get()
                if delta is None or delta.finish_reason == CANCELLED:
                    return
                request.mark(HANDED)
                if delta.error:
                    raise APIError(500, delta.error, type="server_error")
                piece, stopped = text.push(delta.tokens)
                if not stopped and delta.finish_reason is not None:
                    piece += text.finish()
                if stopped or text.stopped or delta.finish_reason is not None:
                    yield piece, STOP if text.stopped else delta.finish_reason
                    return
                if piece:
                    yield piece, None
        finally:
            if watcher is not None:
                watcher.cancel()
            if not request.finished:
                self.scheduler.cancel(request)
            if self.trace is not None:
                self.trace.write(answer_id, request, text.tokens_used)

    async def _events(self, shape: ResponseShape, pieces, request: ServeRequest, text: StopText,
                      include_usage: bool) -> AsyncIterator[str]:
        if shape.chat:
            yield _sse(shape.chunk(None, first=True))
        try:
            async for piece, reason in pieces:
                yield _sse(shape.chunk(piece, reason))
                if piece:
                    request.mark(SENT)  # resumed by the server: the event was written
        except APIError as exc:
            yield _sse(exc.body())
        if include_usage:
            yield _sse(shape.usage_chunk(len(request.prompt), text.tokens_used))
        yield "data: [DONE]\n\n"


async def _watch_disconnect(http: Request, queue: asyncio.Queue) -> None:
    """Put None in the request's queue once its client has disconnected."""
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    queue.put_nowait(None)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _argument(message: str, chat: bool) -> Optional[str]:
    """The request field an "argument 'x' ..." message names."""
    if "'" not in message:
        return None
    name = message.split("'")[1]
    if name in ("prompts", "prompt"):
        return "messages" if chat else "prompt"
    return "max_tokens" if name == "max_new_tokens" else name


def _error_response(exc: APIError, metrics) -> JSONResponse:
    metrics.http_error(exc.status)
    return JSONResponse(exc.body(), status_code=exc.status)


def create_app(service: Service) -> FastAPI:
    """The FastAPI app over a Service whose scheduler is started (or starting: /health says
    503 until it serves)."""
    app = FastAPI(title="specdec serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    metrics = service.metrics

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return _error_response(exc, metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind), metrics)

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        log.exception("request failed")
        return _error_response(APIError(500, f"internal error: {exc}", type="server_error"),
                               metrics)

    @app.get("/health")
    async def health():
        scheduler = service.scheduler
        if scheduler.failed is not None:
            return JSONResponse({"status": "failed", "error": str(scheduler.failed)}, 503)
        if not scheduler.ready.is_set():
            return JSONResponse({"status": "loading"}, 503)
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": 0,
                "owned_by": "specdec_inductor"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != service.model_name:
            raise APIError(404, f"The model `{name}` does not exist", "model",
                           code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(service.scheduler),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(http: Request):
        received = time.perf_counter()
        return await service.answer(http, parse(CompletionRequest, await http.body()), False,
                                    received)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        received = time.perf_counter()
        return await service.answer(http, parse(ChatCompletionRequest, await http.body()), True,
                                    received)

    return app
