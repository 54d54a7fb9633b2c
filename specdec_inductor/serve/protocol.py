"""The OpenAI wire format of `specdec serve`: request schemas (pydantic, strict: a string where
OpenAI wants a number is refused, not coerced), the response and stream-chunk bodies, and
OpenAI-style errors (`{"error": {"message", "type", "param", "code"}}`, status 4xx/5xx).

Fields OpenAI defines but this server cannot honour (n > 1, logprobs, tools, penalties, ...) are
accepted only at their neutral value and otherwise refused naming the field; fields OpenAI does
not define are refused as OpenAI refuses them ("Unrecognized request argument supplied").
Extensions: `top_k` (0: no limit) and `speculative` (false: this request decodes without drafts).
"""
import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error answered as OpenAI answers it: HTTP `status` and the error object."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                       type, code)

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param, code=code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: Optional[bool] = False


class _Request(BaseModel):
    """Fields both endpoints share. Defaults are OpenAI's."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2 ** 64)
    stop: Union[None, str, List[str]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = 1
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # extensions
    top_k: Optional[int] = Field(default=None, ge=0)
    speculative: Optional[bool] = True

    def unsupported(self) -> Dict[str, bool]:
        """Supported-only-when-neutral fields -> whether this request set them otherwise."""
        return {"n": self.n not in (None, 1),
                "frequency_penalty": bool(self.frequency_penalty),
                "presence_penalty": bool(self.presence_penalty),
                "logit_bias": bool(self.logit_bias)}

    def stop_strings(self) -> List[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise bad_request(f"'stop' takes at most 4 sequences, got {len(stops)}", "stop")
        if any(s == "" for s in stops):
            raise bad_request("'stop' sequences must not be empty", "stop")
        return stops


class CompletionRequest(_Request):
    """POST /v1/completions (the legacy text completion)."""
    prompt: Union[str, List[int]]
    max_tokens: Optional[int] = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: Optional[bool] = False
    best_of: Optional[int] = 1
    logprobs: Optional[int] = None
    suffix: Optional[str] = None

    def unsupported(self) -> Dict[str, bool]:
        return {**super().unsupported(), "echo": bool(self.echo),
                "best_of": self.best_of not in (None, 1), "logprobs": self.logprobs is not None,
                "suffix": bool(self.suffix)}


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, List[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[Dict[str, Any]] = None
    metadata: Optional[Dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None

    def unsupported(self) -> Dict[str, bool]:
        fmt = (self.response_format or {}).get("type", "text")
        return {**super().unsupported(), "logprobs": bool(self.logprobs),
                "top_logprobs": self.top_logprobs is not None, "tools": bool(self.tools),
                "tool_choice": self.tool_choice not in (None, "none"),
                "response_format": fmt != "text"}

    def new_tokens(self) -> Optional[int]:
        """max_completion_tokens (OpenAI's newer name) or max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> List[Dict[str, str]]:
        """The messages as the tokenizer's chat template takes them (developer = system)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


def parse(schema, body: bytes):
    """The request `schema` validated from a raw JSON body, or APIError 400 naming the field
    (invalid JSON: no field)."""
    try:
        request = schema.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    for name, set_ in request.unsupported().items():
        if set_:
            raise bad_request(f"'{name}' is not supported by this server (only its default "
                              "value is accepted)", name, code="unsupported_parameter")
    return request


def _validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    if first["type"] in ("json_invalid", "json_type"):
        return bad_request("We could not parse the JSON body of your request. (HINT: This "
                           "likely means you aren't using your HTTP library correctly. The "
                           "OpenAI API expects a JSON payload.)")
    loc = [str(part) for part in first["loc"]]
    param = ".".join(loc) if loc else None
    field = loc[0] if loc else None
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param)
    return bad_request(f"Invalid value for '{field}': {first['msg']} (got "
                       f"{first.get('input')!r})", param, code="invalid_value")


# -- responses -------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseShape:
    """The bodies of one endpoint's answers: `full` (non-streamed), `chunk` (a stream event)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: List[dict]) -> Dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, text: str, finish_reason: str, prompt_tokens: int,
             completion_tokens: int) -> Dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, text: Optional[str], finish_reason: Optional[str] = None,
              first: bool = False) -> Dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> Dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
