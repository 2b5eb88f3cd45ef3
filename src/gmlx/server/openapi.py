"""GET /openapi.json: the server's own OpenAPI 3.1 description, written by hand as data.

It states what the routes accept, so a client (or a schema-based fuzz) knows it before sending:
the query parameters with their types and ranges, the request bodies that `openai_api.parse`
accepts, the answers, the OpenAI error shape, and the 4xx/503 each route can give. The bearer key
is declared only when the server has one, because only then is it enforced; `/health` and
`/system` stay open either way. The document is no secret, but it is a route like any other, so
it needs the key when the server has one (docs/ARCHITECTURE.md, "Contract": every route but /health and /system).
`tests/test_openapi.py` checks that it lists exactly the app's routes.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import gmlx
from gmlx.engine.logprobs import MAX_TOP
from gmlx.server import fields
from gmlx.server.openai_api import MAX_STOP_CHARS, MAX_STOPS, ROLES

OPEN_PATHS = frozenset({"/health", "/system"})  # the same as app.OPEN_PATHS (a test checks)
MAX_EMBEDDING_INPUTS = 2048  # embeddings.MAX_INPUTS
MEDIA_PARTS = ["image_url", "input_image", "image", "input_audio", "audio", "video", "video_url", "file"]


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict) -> dict:
    """null is accepted wherever a field may be left out: parse() reads it as absent."""
    return {"anyOf": [schema, {"type": "null"}]}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before trying again.",
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}
_ERRORS = {
    400: "Bad request: a malformed body or HTTP request, a wrong type or range, JSON nested over 64 levels, a "
    "string that is not valid Unicode, a prompt over the context window or max_tokens past what it leaves "
    "(context_length_exceeded).",
    401: "A missing or wrong API key.",
    404: "The model is not served here (`model_not_found`), or not loaded (`model_not_loaded`).",
    408: "The body did not arrive within the server's body timeout (`body_timeout`).",
    409: "The model has requests in flight or queued, or is loading (`model_busy`).",
    413: "The request body is over the server's limit.",
    503: "Load (`queue_full`, `queue_timeout`, `memory_pressure`, `too_many_connections`), a model that cannot "
    "be loaded now (`model_unavailable`), loading or shutting down; see Retry-After.",
}


def _errors(*statuses: int) -> dict:
    out = {}
    for status in statuses:
        out[str(status)] = {"description": _ERRORS[status], "content": _json(_ref("Error"))}
        if status == 503:
            out[str(status)]["headers"] = _RETRY_AFTER
    return out


_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_MEDIA_PART = {"type": "object", "required": ["type"], "properties": {"type": {"enum": MEDIA_PARTS}}}


_NAMED = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
_CALL = {
    "type": "object",
    "required": ["id", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {**_NAMED, "properties": {**_NAMED["properties"], "arguments": {"type": ["string", "object"]}}},
    },
}


def _role_needs(role: str, then: dict) -> dict:
    return {"if": {"properties": {"role": {"const": role}}}, "then": then}


def _message(parts: list[dict]) -> dict:
    content = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {"anyOf": parts}}]}
    role = {"enum": list(ROLES), "description": "developer is read as system; function is read as tool."}
    return {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": role,
            "content": content,
            "tool_calls": _nullable(
                {"type": "array", "items": _CALL, "description": "An assistant's calls (only an assistant's)."}
            ),
            "tool_call_id": {"type": "string", "description": "A tool message's: the call it answers."},
            "name": {"type": "string"},
        },
        "allOf": [
            _role_needs("tool", {"required": ["tool_call_id"]}),
            _role_needs("function", {"required": ["name"]}),
            {
                "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
                "then": {"properties": {"tool_calls": _nullable({"type": "array", "maxItems": 0})}},
            },
        ],
    }


_STOP = {"type": "string", "maxLength": MAX_STOP_CHARS}
_SAMPLING: dict[str, Any] = {
    "model": _nullable({"type": "string", "description": "The served model's id; any other is a 404."}),
    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
    "max_completion_tokens": _nullable(
        {"type": "integer", "minimum": 1, "description": "Takes precedence over max_tokens."}
    ),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "top_k": _nullable({"type": "integer", "description": "0 or less: off."}),
    "seed": _nullable({"type": "integer", "minimum": 0, "maximum": 2**64 - 1}),
    "n": _nullable({"type": "integer", "minimum": 1, "description": "Choices, each its own row of the batch."}),
    "stop": _nullable({"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": MAX_STOPS}]}),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": _nullable({"type": "boolean"})}}),
    "presence_penalty": _nullable(
        {"type": "number", "minimum": -2, "maximum": 2, "description": "OpenAI's, over the tokens generated so far."}
    ),
    "frequency_penalty": _nullable(
        {"type": "number", "minimum": -2, "maximum": 2, "description": "OpenAI's, over the tokens generated so far."}
    ),
    "repetition_penalty": _nullable(
        {
            "type": "number",
            "minimum": 0.01,
            "maximum": 100,
            "description": "llama.cpp's, over the last repeat_last_n tokens, prompt included.",
        }
    ),
    "repeat_last_n": _nullable(
        {
            "type": "integer",
            "minimum": -1,
            "description": "repetition_penalty's window: 64 by default, -1 the whole context, 0 off.",
        }
    ),
    "logit_bias": _nullable(
        {
            "type": "object",
            "propertyNames": {"pattern": "^0*[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": "Token ids (of the served model's vocabulary) to biases added to their logits.",
        }
    ),
}


def _accepted(chat: bool) -> dict[str, dict]:
    """The fields accepted without being honoured: those that change nothing, and the unsupported
    ones at the values that ask for nothing."""
    ignored = {name: {"description": "Accepted; changes nothing."} for name in fields.NO_EFFECT}
    return ignored | {
        name: {"enum": list(values), "description": "Not supported: only these values."}
        for name, values in fields.unsupported(chat).items()
    }


def _body(required: str, first: dict, chat: bool, **more: Any) -> dict:
    body = {
        "type": "object",
        "required": [required],
        "properties": {required: first, **_SAMPLING, **_accepted(chat), **more},
        "additionalProperties": False,
        "description": "A field not listed is refused with 400 unsupported_parameter: gmlx never drops one "
        "that would change the answer.",
    }
    if chat:  # top_logprobs asks for alternatives to logprobs that must be on
        body |= {
            "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        }
    return body


def _token_ids(vocab_size: int | None) -> dict:
    token = {"type": "integer", "minimum": 0} | ({} if vocab_size is None else {"maximum": vocab_size - 1})
    return {"type": "array", "items": token, "minItems": 1}


def _embedding_request(vocab_size: int | None) -> dict:
    ids, text = _token_ids(vocab_size), {"type": "string", "minLength": 1}
    many = {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS, "items": {"anyOf": [text, ids]}}
    return {
        "type": "object",
        "required": ["input"],
        "additionalProperties": False,
        "properties": {
            "input": {
                "anyOf": [text, ids, many],
                "description": "Each input tokenized (with BOS) must fit the context window.",
            },
            "model": _nullable({"type": "string", "description": "The served model's id; any other is a 404."}),
            "encoding_format": _nullable(
                {"enum": ["float", "base64"], "description": "base64: little-endian float32, base64-encoded."}
            ),
            "dimensions": {"type": "null", "description": "Not supported."},
            "user": {"description": "Accepted; changes nothing."},
        },
        "description": "Pooled as llama.cpp's server pools: the GGUF's pooling_type, else the last token; "
        "L2-normalised.",
    }


_DRY_RUN = _nullable({"type": "boolean", "description": "true: answer with the estimate, run nothing."})


def _completion_request(vocab_size: int | None) -> dict:
    """The completions body; the token ids' bound is the served model's vocabulary, once it is loaded."""
    token = {"type": "integer", "minimum": 0} | ({} if vocab_size is None else {"maximum": vocab_size - 1})
    ids = {"type": "array", "items": token, "minItems": 1}
    batch_of_one = {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [{"type": "string"}, ids]}}
    return _body(
        "prompt",
        {
            "anyOf": [{"type": "string"}, ids, batch_of_one],
            "description": "One prompt: a string or token ids, or a batch of one.",
        },
        chat=False,
        logprobs=_nullable(
            {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_TOP,
                "description": "Report each token's log-probability and this many alternatives.",
            }
        ),
        dry_run=_DRY_RUN,
    )


# Chat's logprobs: a flag, and how many alternatives.
_CHAT_LOGPROBS = {
    "logprobs": _nullable({"type": "boolean"}),
    "top_logprobs": _nullable(
        {"type": "integer", "minimum": 0, "maximum": MAX_TOP, "description": "Needs logprobs: true."}
    ),
}
_FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": "string"},
        "strict": {"type": "boolean", "description": "Accepted; arguments always validate when a call is forced."},
        "parameters": {
            "type": "object",
            "description": "A JSON Schema of type object; one that constrained decoding cannot compile is a 400.",
        },
    },
}
_TOOLS = {
    "tools": _nullable(
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {"type": {"const": "function"}, "function": _FUNCTION},
            },
            "description": "Names are distinct.",
        }
    ),
    "tool_choice": _nullable(
        {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {"type": {"const": "function"}, "function": _NAMED},
                },
            ],
            "description": "required and a named function (one of the tools) need tools, and force a call by "
            "constrained decoding.",
        }
    ),
    "parallel_tool_calls": _nullable({"type": "boolean"}),
}


_RESPONSE_FORMAT = {
    "response_format": _nullable(
        {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": _nullable({"type": "boolean"}),
                    },
                },
            },
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"required": ["type", "json_schema"]},
            "description": "JSON by constrained decoding: the content always parses and validates against the schema "
            "(unless max_tokens cuts it short). A schema constrained decoding cannot compile is a 400.",
        }
    )
}


_CHOICE = {
    "type": "object",
    "required": ["index", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "finish_reason": {"type": ["string", "null"]}},
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}


def _object(required: list[str], **properties: Any) -> dict:
    return {"type": "object", "required": required, "properties": properties}


def _closed(required: list[str], properties: dict, no_effect: tuple[str, ...], unsupported: dict) -> dict:
    """A body of one of the translated APIs: its fields, those that change nothing, and the unsupported
    ones at the values that ask for nothing (server/fields.py)."""
    return {
        "type": "object",
        "required": required,
        "additionalProperties": False,
        "properties": {
            **properties,
            **{n: {"description": "Accepted; changes nothing."} for n in no_effect},
            **{
                n: {"enum": list(v), "description": "Not supported: only these values."} for n, v in unsupported.items()
            },
        },
    }


_STRING = {"type": "string"}
_PARTS_TEXT = {
    "anyOf": [
        _STRING,
        {
            "type": "array",
            "items": _object(["type", "text"], type={"enum": ["input_text", "output_text"]}, text=_STRING),
        },
    ]
}
_RESPONSE_ITEM = {
    "anyOf": [
        _object(
            ["role", "content"],
            type={"const": "message"},
            role={"enum": ["user", "assistant", "system", "developer"]},
            content=_PARTS_TEXT,
        ),
        _object(
            ["type", "call_id", "name", "arguments"],
            type={"const": "function_call"},
            call_id=_STRING,
            name=_STRING,
            arguments=_STRING,
        ),
        _object(
            ["type", "call_id", "output"], type={"const": "function_call_output"}, call_id=_STRING, output=_PARTS_TEXT
        ),
    ]
}
_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_RESPONSES_REQUEST = _closed(
    ["input"],
    {
        "input": {
            "anyOf": [_STRING, {"type": "array", "minItems": 1, "items": _RESPONSE_ITEM}],
            "description": "Text, or messages, function calls and their outputs (text content only).",
        },
        "instructions": _nullable({**_STRING, "description": "A system message first; not carried over."}),
        "previous_response_id": _nullable({**_STRING, "description": "One of the server's last 256 stored answers."}),
        "store": _nullable({"type": "boolean", "description": "false: previous_response_id cannot name this answer."}),
        "max_output_tokens": _SAMPLING["max_tokens"],
        "temperature": _SAMPLING["temperature"],
        "top_p": _SAMPLING["top_p"],
        "model": _SAMPLING["model"],
        "stream": _SAMPLING["stream"],
        "parallel_tool_calls": _TOOLS["parallel_tool_calls"],
        "tools": _nullable(
            {
                "type": "array",
                "items": _object(
                    ["type", "name"],
                    type={"const": "function"},
                    name=_NAME,
                    description=_nullable(_STRING),
                    parameters=_nullable({"type": "object"}),
                    strict=_nullable({"type": "boolean"}),
                ),
                "description": "Function tools only; names are distinct.",
            }
        ),
        "tool_choice": _nullable(
            {
                "anyOf": [
                    {"enum": ["none", "auto", "required"]},
                    _object(["type", "name"], type={"const": "function"}, name=_STRING),
                ]
            }
        ),
        "text": _nullable(
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "format": _nullable(
                        _RESPONSE_FORMAT["response_format"]["anyOf"][0]
                        | {
                            "properties": {
                                "type": {"enum": ["text", "json_object", "json_schema"]},
                                "name": _STRING,
                                "schema": {"type": "object"},
                                "strict": _nullable({"type": "boolean"}),
                            },
                            "then": {"required": ["type", "name"]},
                        }
                    ),
                    "verbosity": {"type": "null"},
                },
            }
        ),
    },
    fields.NO_EFFECT_RESPONSES,
    fields.UNSUPPORTED_RESPONSES,
)
_TEXT_BLOCK = _object(["type", "text"], type={"const": "text"}, text=_STRING)
_MESSAGES_REQUEST = _closed(
    ["model", "max_tokens", "messages"],
    {
        "model": {**_STRING, "description": "The served model's id; any other is a 404."},
        "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    _object(
                        ["role", "content"],
                        role={"const": role},
                        content={"anyOf": [_STRING, {"type": "array", "items": {"anyOf": [_TEXT_BLOCK, block]}}]},
                    )
                    for role, block in (
                        (
                            "user",
                            _object(
                                ["type", "tool_use_id"],
                                type={"const": "tool_result"},
                                tool_use_id=_STRING,
                                content={"anyOf": [_STRING, {"type": "array", "items": _TEXT_BLOCK}]},
                                is_error={"type": "boolean"},
                            ),
                        ),
                        (
                            "assistant",
                            _object(
                                ["type", "id", "name"],
                                type={"const": "tool_use"},
                                id=_STRING,
                                name=_STRING,
                                input={"type": "object"},
                            ),
                        ),
                    )
                ],
                "description": "tool_result blocks in user messages, tool_use blocks in assistant ones.",
            },
        },
        "system": {"anyOf": [_STRING, {"type": "array", "items": _TEXT_BLOCK}, {"type": "null"}]},
        "temperature": _SAMPLING["temperature"],
        "top_p": _SAMPLING["top_p"],
        "top_k": _SAMPLING["top_k"],
        "stop_sequences": _nullable({"type": "array", "items": _STOP, "maxItems": MAX_STOPS}),
        "stream": _SAMPLING["stream"],
        "tools": _nullable(
            {
                "type": "array",
                "items": _object(
                    ["name"],
                    type={"const": "custom"},
                    name=_NAME,
                    description=_nullable(_STRING),
                    input_schema=_nullable({"type": "object"}),
                ),
                "description": "Custom tools only; names are distinct.",
            }
        ),
        "tool_choice": _nullable(
            {
                "anyOf": [
                    _object(
                        ["type"], type={"enum": ["auto", "any", "none"]}, disable_parallel_tool_use={"type": "boolean"}
                    ),
                    _object(
                        ["type", "name"],
                        type={"const": "tool"},
                        name=_STRING,
                        disable_parallel_tool_use={"type": "boolean"},
                    ),
                ]
            }
        ),
    },
    fields.NO_EFFECT_MESSAGES,
    fields.UNSUPPORTED_MESSAGES,
)


SCHEMAS: dict[str, dict] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "code": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                },
            }
        },
    },
    "ChatCompletionRequest": _body(
        "messages",
        {"type": "array", "minItems": 1, "items": _message([_TEXT_PART])},
        True,
        **_CHAT_LOGPROBS,
        **_TOOLS,
        **_RESPONSE_FORMAT,
        dry_run=_DRY_RUN,
    ),
    "ChatEstimateRequest": _body(
        "messages",
        {"type": "array", "minItems": 1, "items": _message([_TEXT_PART, _MEDIA_PART])},
        True,
        **_CHAT_LOGPROBS,
        **_TOOLS,
        **_RESPONSE_FORMAT,
        dry_run=_nullable({"type": "boolean", "description": "Accepted, and changes nothing."}),
    ),
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"enum": ["chat.completion", "text_completion"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": _CHOICE},
            "usage": _USAGE,
        },
    },
    "Estimate": {
        "type": "object",
        "required": [
            "kind",
            "prompt_tokens",
            "warm_tokens",
            "cache_tier",
            "need_bytes",
            "fits_now",
            "fits_drained",
            "context_ok",
            "context_limit",
            "est_ttft_s",
            "resident",
            "model",
            "estimated",
        ],
        "properties": {
            "kind": {"enum": ["generation", "embedding"], "description": "the body's kind"},
            "inputs": {"type": "integer", "minimum": 1, "description": "an embeddings body's inputs"},
            "prompt_tokens": {"type": "integer", "minimum": 0},
            "warm_tokens": {"type": "integer", "minimum": 0},
            "cache_tier": {"type": "string"},
            "need_bytes": {"type": ["integer", "null"]},
            "need_now_bytes": {
                "type": ["integer", "null"],
                "description": "what joining the batch now takes (rows pad to the longest)",
            },
            "note": {
                "type": "string",
                "description": "why figures are null, or what they assume for a model not loaded",
            },
            "fits_now": {"type": ["boolean", "null"]},
            "fits_drained": {"type": ["boolean", "null"]},
            "context_ok": {"type": "boolean"},
            "context_limit": {"type": "integer"},
            "est_ttft_s": {"type": ["number", "null"]},
            "resident": {"type": "boolean"},
            "model": {"type": "string"},
            "estimated": {"type": "boolean"},
        },
    },
    "Plan": {
        "type": "object",
        "required": [
            "width",
            "depth",
            "ok",
            "max_context_at_width",
            "max_width_at_depth",
            "model",
            "band",
            "decode_batch",
            "in_flight",
            "waiting",
            "slots",
            "admit_now",
            "reason",
        ],
        "properties": {
            "width": {"type": "integer"},
            "depth": {"type": "integer"},
            "ok": {"type": ["boolean", "null"]},
            "max_context_at_width": {"type": ["integer", "null"]},
            "max_width_at_depth": {"type": ["integer", "null"]},
            "model": {"type": "string"},
            "band": {"enum": ["green", "yellow", "orange", "red", None]},
            "decode_batch": {"type": "integer"},
            "in_flight": {"type": "integer"},
            "waiting": {"type": "integer"},
            "slots": {"type": "integer"},
            "admit_now": {"type": "boolean"},
            "reason": {"type": "string"},
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by", "max_context_at_width_1"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "status": {"enum": ["unloaded", "loading", "loaded"]},
            "context_length": {"type": ["integer", "null"]},
            "max_context_at_width_1": {"type": ["integer", "null"]},
            "kv_quant": {"type": "object"},
            "preloaded": {"type": "boolean"},
            "source": {"enum": ["argument", "preset", "models_dir"]},
            "load_error": {"type": "string"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
    },
    "ResponsesRequest": _RESPONSES_REQUEST,
    "MessagesRequest": _MESSAGES_REQUEST,
    "Embeddings": {
        "type": "object",
        "required": ["object", "model", "data", "usage"],
        "properties": {
            "object": {"const": "list"},
            "model": {"type": "string"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["object", "index", "embedding"],
                    "properties": {
                        "object": {"const": "embedding"},
                        "index": {"type": "integer"},
                        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]},
                    },
                },
            },
            "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"]},
        },
    },
    "Health": {
        "type": "object",
        "required": ["status", "pid"],
        "properties": {
            "status": {"const": "healthy"},
            "pid": {"type": "integer"},
            "ready": {"type": "boolean"},
            "reason": {"enum": ["loading", "shutting_down", "pressure", "queue", "busy"]},
        },
    },
    "Metrics": {"type": "object", "required": ["server"], "properties": {"server": {"type": "object"}}},
    "System": {
        "type": "object",
        "required": [
            "version",
            "state",
            "uptime_s",
            "device",
            "compute_type",
            "model",
            "gpu",
            "host",
            "activity",
            "models",
        ],
        "properties": {
            "version": {"type": "string"},
            "host": {
                "type": "object",
                "properties": {
                    "cpu_pct_per_core": {"type": ["array", "null"], "items": {"type": "number"}},
                    "process_cpu_pct": {"type": ["number", "null"]},
                    "process_rss_bytes": {"type": "integer"},
                },
            },
            "state": {"enum": ["loading", "ready", "draining"]},
            "uptime_s": {"type": "number", "minimum": 0},
            "gpu": {"type": ["array", "null"]},
            "activity": {
                "type": "object",
                "required": ["active", "waiting"],
                "properties": {"active": {"type": "integer"}, "waiting": {"type": "integer"}},
            },
        },
    },
}


def _op(summary: str, ok: dict, *errors: int, body: str | None = None, params: list | None = None) -> dict:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}
    if body:
        op["requestBody"] = {"required": True, "content": _json(_ref(body))}
    if params:
        op["parameters"] = params
    return op


def _query(name: str, schema: dict, required: bool = False, description: str = "") -> dict:
    return {"name": name, "in": "query", "required": required, "schema": schema, "description": description}


_MODEL_ID = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}

# One server-sent event: `data` is a JSON chunk (or an error object) and the last is `[DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_GENERATION_OK = {
    "description": "The answer; with stream=true, server-sent events ending in `data: [DONE]`.",
    "content": {
        **_json({"anyOf": [_ref("Completion"), _ref("Estimate")]}),
        "text/event-stream": {"schema": _SSE_EVENT},
    },
}


def _generation(what: str, body: str) -> dict:
    """A generation route: its answer, or with dry_run its estimate."""
    return {"post": _op(f"{what} (or, with dry_run, its estimate)", _GENERATION_OK, 400, 404, 408, 413, 503, body=body)}


PATHS: dict[str, dict[str, dict]] = {
    "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest"),
    "/v1/completions": _generation("Text completion", "CompletionRequest"),
    "/v1/embeddings": {
        "post": _op(
            "One normalised vector per input",
            {"description": "The vectors", "content": _json(_ref("Embeddings"))},
            400,
            404,
            408,
            413,
            503,
            body="EmbeddingRequest",
        )
    },
    "/v1/responses": {
        "post": _op(
            "OpenAI's Responses API on the chat path; with stream=true, its events (response.created, "
            "response.output_text.delta, ..., response.completed)",
            {
                "description": "A Response object, or server-sent events",
                "content": {**_json({"type": "object"}), "text/event-stream": {"schema": _SSE_EVENT}},
            },
            400,
            404,
            408,
            413,
            503,
            body="ResponsesRequest",
        )
    },
    "/v1/messages": {
        "post": _op(
            "Anthropic's Messages API on the chat path; with stream=true, its events "
            "(message_start, ..., message_stop)",
            {
                "description": "A message, or server-sent events",
                "content": {**_json({"type": "object"}), "text/event-stream": {"schema": _SSE_EVENT}},
            },
            400,
            404,
            408,
            413,
            503,
            body="MessagesRequest",
        )
    },
    "/v1/models": {
        "get": _op(
            "Every model a request may name, with its status",
            {"description": "One entry per model", "content": _json(_ref("ModelList"))},
        )
    },
    "/v1/models/{model_id}": {
        "get": _op(
            "One model (the openai client's models.retrieve); an id not served is a 404 model_not_found",
            {"description": "The model", "content": _json(_ref("Model"))},
            404,
            params=[_MODEL_ID],
        )
    },
    "/v1/models/{model_id}/load": {
        "post": _op(
            "Load a model now (requests load it on demand too); 503 model_unavailable when it cannot be",
            {"description": "The model, loaded", "content": _json(_ref("Model"))},
            404,
            503,
            params=[_MODEL_ID],
        )
    },
    "/v1/models/{model_id}/unload": {
        "post": _op(
            "Unload a model: 404 model_not_loaded when it is not, 409 model_busy while it has requests",
            {"description": "The model, unloaded", "content": _json(_ref("Model"))},
            404,
            409,
            params=[_MODEL_ID],
        )
    },
    "/health": {
        "get": _op(
            "Liveness, and with ready=1 readiness",
            {"description": "Healthy (and ready)", "content": _json(_ref("Health"))},
            params=[
                _query(
                    "ready", {"type": "string"}, description="1, true or yes: answer 503 with a reason when not ready"
                )
            ],
        )
        | {
            "responses": {
                "200": {"description": "Healthy (and ready)", "content": _json(_ref("Health"))},
                "503": {
                    "description": "Not ready: `reason` says why",
                    "headers": _RETRY_AFTER,
                    "content": _json(_ref("Health")),
                },
            }
        }
    },
    "/v1/capacity/plan": {
        "get": _op(
            "Do `width` streams of `depth` tokens fit, and can they start now?",
            {"description": "The plan", "content": _json(_ref("Plan"))},
            400,
            404,
            params=[
                _query("width", {"type": "integer", "minimum": 1}, True, "Concurrent streams"),
                _query("depth", {"type": "integer", "minimum": 1}, True, "Tokens per stream"),
                _query(
                    "model", {"type": "string"}, description="A model id (GET /v1/models); the preloaded one without it"
                ),
            ],
        )
    },
    "/v1/estimate": {
        "post": _op(
            "What one chat, completions or embeddings request would need, without running it",
            {"description": "The estimate", "content": _json(_ref("Estimate"))},
            400,
            404,
            408,
            413,
            503,
            body="EstimateRequest",
        )
    },
    "/v1/metrics": {
        "get": _op(
            "The live snapshot, as JSON or Prometheus text",
            {
                "description": "The snapshot",
                "content": {**_json(_ref("Metrics")), "text/plain": {"schema": {"type": "string"}}},
            },
            400,
            params=[_query("format", {"enum": ["json", "prometheus"]})],
        )
    },
    "/metrics": {
        "get": _op(
            "Prometheus text for routers: /v1/metrics?format=prometheus plus vllm:num_requests_waiting, "
            "vllm:num_requests_running, vllm:kv_cache_usage_perc (0-1) and vllm:cache_config_info",
            {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}},
        )
    },
    "/system": {
        "get": _op(
            "What runs where; open, no content", {"description": "System facts", "content": _json(_ref("System"))}
        )
    },
    "/openapi.json": {
        "get": _op("This document", {"description": "OpenAPI 3.1", "content": _json({"type": "object"})})
    },
}


def _most_choices(schema: dict, decode_batch: int) -> dict:
    n = schema["properties"]["n"]["anyOf"][0]
    return {**schema, "properties": {**schema["properties"], "n": _nullable({**n, "maximum": decode_batch})}}


def document(api_key: bool, vocab_size: int | None = None, decode_batch: int | None = None) -> dict:
    """The OpenAPI document; with `api_key`, every route but the open ones declares (and gets) a 401.
    `vocab_size`, the served model's, bounds the token ids a completions prompt may hold;
    `decode_batch`, the server's, bounds `n`."""
    paths: dict[str, dict] = {}
    for path, methods in PATHS.items():
        paths[path] = {}
        for method, op in methods.items():
            name = path.strip("/").replace("/", "_").replace(".", "_").replace("{", "").replace("}", "")
            op = {**op, "operationId": f"{method}_{name}"}
            if api_key and path not in OPEN_PATHS:
                op["responses"] = {**op["responses"], **_errors(401)}
            elif api_key:
                op["security"] = []
            paths[path][method] = op
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "gmlx",
            "version": gmlx.__version__,
            "description": "OpenAI-compatible server for GGUF models on MLX. Errors have the OpenAI shape. "
            "Every /v1 path also answers without the prefix (/chat/completions, /models, ...), "
            "as llama-server's do, except where the bare path is a route of its own (/metrics); "
            "the aliases are not listed again, so a generated client has one method per "
            "operation.",
        },
        "paths": paths,
        "components": {
            "schemas": {
                **SCHEMAS,
                "CompletionRequest": _completion_request(vocab_size),
                "EmbeddingRequest": _embedding_request(vocab_size),
                "EstimateRequest": {
                    "oneOf": [_ref("ChatEstimateRequest"), _ref("CompletionRequest"), _ref("EmbeddingRequest")],
                    "description": "A chat-completions, completions or embeddings body (the estimate's kind "
                    "says which of generation and embedding).",
                },
            }
        },
    }
    if decode_batch is not None:
        schemas = doc["components"]["schemas"]
        for name in ("ChatCompletionRequest", "CompletionRequest", "ChatEstimateRequest"):
            schemas[name] = _most_choices(schemas[name], decode_batch)
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


async def openapi_route(request: Request) -> Response:
    state = request.app.state.gmlx
    m = state.default  # the bounds a request without `model` meets
    loaded = m.engine.loaded if m.engine is not None else None  # None while loading: left out until known
    return JSONResponse(
        document(bool(state.settings.api_key), loaded.geometry.vocab_size if loaded else None, m.gate.width)
    )
