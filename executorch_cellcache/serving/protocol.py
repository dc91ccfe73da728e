"""The OpenAI wire format: pydantic models of what ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models`` accept and return.

Requests are validated strictly (``strict=True``: a string is not a number, a
bool is not an integer) and bounded where OpenAI bounds them; a field we do
not implement but OpenAI defines is accepted only at its neutral value (the
app refuses the rest with a 400 naming it). Unknown fields are ignored, as
OpenAI-compatible servers do.
"""

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """The fields both endpoints share."""
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=1)          # extension (vLLM, llama.cpp)
    stop_token_ids: Optional[List[int]] = None        # extension (vLLM)
    response_format: Optional[Dict[str, Any]] = None  # (an extension on completions, as vLLM)
    grammar: Optional[str] = None                     # extension (ours): a Lark/GBNF grammar
    ignore_eos: bool = False                          # extension (vLLM)
    n: int = Field(1, ge=1)
    seed: Optional[int] = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1)
    suffix: Optional[str] = None


class TextPart(_Request):
    type: str
    text: Optional[str] = None


class ChatMessage(_Request):
    role: str
    content: Optional[Union[str, List[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[List[Any]] = None   # checked entry by entry (serving/tool_calls.py)
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None


# ---------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    # Speculative decoding (OpenAI's names, from its predicted outputs): proposed tokens
    # the model accepted, and those it rejected (computed, never emitted).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(
        default_factory=CompletionTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob]


class ChatLogprobs(BaseModel):
    content: List[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: List[str]
    token_logprobs: List[float]
    top_logprobs: List[Dict[str, float]]
    text_offset: List[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str          # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]              # None when the reply is only tool calls
    tool_calls: Optional[List[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": ...}; tool calls come
    # last as {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}
    delta: Dict[str, Any]
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "executorch-cellcache"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    error: ErrorDetail
