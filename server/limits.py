"""The value limits of every request field, in one place: the constrained types server/protocol.py builds on.

A value that passes these fits the type the engine keeps it in: seeds seed a torch.Generator (int64), token ids,
counts and lengths are int32 tensor entries or loop bounds, floats are finite doubles, text encodes as UTF-8.
Limits that depend on the served model (vocabulary size, context length, --max-logprobs, --max-num-seqs, the
KV cache) are checked against the ServerContext (server/context.py) in server/preprocess.py; they are all tighter than these.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, StringConstraints

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

MAX_N = 128  # n and best_of: one request must not own the whole cache
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_LOGPROB_TOKEN_IDS = 128  # logprob_token_ids (vLLM's bound)
MAX_PROMPTS = 256  # prompts of one completions call: each is its own engine request
MAX_TOKEN_IDS = 1 << 17  # one token list (prompt, stop_token_ids, detokenize); the context is tighter still
MAX_STOP = 64  # stop strings
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 256  # parts of one chat message
MAX_DOCUMENTS = 256  # chat's documents
MAX_TEMPLATE_KWARGS = 64  # chat_template_kwargs entries
MAX_REQUEST_ID = 256  # characters of a client's request_id
MAX_METADATA = 16  # /v1/responses metadata entries (OpenAI's bound)


def _utf8(value: str) -> str:
    """JSON may carry a lone UTF-16 surrogate escape ("\\ud800"): no tokenizer or response can encode it.
    NUL and every other code point are text and pass."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode text; it holds a lone surrogate at position {exc.start}") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Priority = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # and below the vocabulary size (preprocess)
NumChoices = Annotated[int, Field(ge=1, le=MAX_N)]  # n, best_of
NumTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]  # max_tokens; and within the context (preprocess)
MinTokens = Annotated[int, Field(ge=0, le=INT32_MAX)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]  # -1 = off; 0 is refused by SamplingParams
# logprobs, top_logprobs, prompt_logprobs: -1 is the whole vocabulary (vLLM); all at most --max-logprobs (preprocess)
NumLogprobs = Annotated[int, Field(ge=-1, le=INT32_MAX)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Finite = Annotated[float, Field(allow_inf_nan=False)]  # ranges per field: SamplingParams
TruncateTokens = Annotated[int, Field(ge=-1, le=INT32_MAX)]  # -1: the context length; 0 is refused (preprocess)
RequestId = Annotated[Text, StringConstraints(min_length=1, max_length=MAX_REQUEST_ID)]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]  # logit_bias keys: a decimal token id

TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS)]
LogprobTokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
StopList = Annotated[list[Text], Field(max_length=MAX_STOP)]
TextPrompts = Annotated[list[Text], Field(max_length=MAX_PROMPTS)]
TokenPrompts = Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)]
LogitBias = Annotated[dict[TokenIdKey, Finite], Field(max_length=MAX_LOGIT_BIAS)]
TemplateKwargs = Annotated[dict[Text, Any], Field(max_length=MAX_TEMPLATE_KWARGS)]
Documents = Annotated[list[dict[Text, Text]], Field(max_length=MAX_DOCUMENTS)]
Metadata = Annotated[dict[Text, Text], Field(max_length=MAX_METADATA)]


_EXACT = {float(b): b for b in (INT64_MIN, INT64_MAX, -INT32_MAX - 1, INT32_MAX)}


def integer_bounds(schema: Any) -> Any:
    """FastAPI's OpenAPI model keeps minimum/maximum as floats (2**63 - 1 becomes 9.223372036854776e+18): give
    the integer bounds of this module back their exact values, in place."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in ("minimum", "maximum") and isinstance(value, float) and value.is_integer():
                schema[key] = _EXACT.get(value, int(value))
            else:
                integer_bounds(value)
    elif isinstance(schema, list):
        for item in schema:
            integer_bounds(item)
    return schema
