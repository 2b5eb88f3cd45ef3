"""Which request fields gmlx honours, which change nothing, and which it cannot do.

A field that would change the answer and is silently dropped is the worst reply a server can
give: the client believes it got what it asked for. So every field of OpenAI's chat and
completions bodies is named here, and so are the extensions gmlx reads (from llama.cpp's and
vLLM's servers). A field that is neither honoured nor without effect is refused with a 400
`unsupported_parameter` naming it, unless its value asks for nothing (`best_of: 1`, `echo: false`);
a field gmlx does not know at all is refused the same way, since it cannot know what it asks.
"""

from __future__ import annotations

from typing import Any

from gmlx.server.errors import bad_request

# What parse() reads and acts on.
HONOURED_BOTH = (
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "repeat_last_n",
    "n",
    "dry_run",
)
HONOURED_CHAT = (
    "messages",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
HONOURED_COMPLETION = ("prompt",)

# Accepted and ignored: they label or route a request and change none of its tokens.
NO_EFFECT = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")

# Not done; each with the values that ask for nothing and so are accepted.
UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None, "none"),
    "reasoning_effort": (None,),
    "verbosity": (None,),
}
UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, "")}

# POST /v1/embeddings: `dimensions` would truncate and renormalise, which gmlx does not do.
HONOURED_EMBEDDINGS = ("input", "model", "encoding_format")
UNSUPPORTED_EMBEDDINGS: dict[str, tuple[Any, ...]] = {"dimensions": (None,)}

# POST /v1/responses (server/responses.py), translated to a chat body; `store` also says whether
# previous_response_id may name the answer later. Hosted tools, reasoning and prompt templates are not done.
HONOURED_RESPONSES = (
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "previous_response_id",
    "store",
)
NO_EFFECT_RESPONSES = (*(n for n in NO_EFFECT if n != "store"), "stream_options")
UNSUPPORTED_RESPONSES: dict[str, tuple[Any, ...]] = {
    "reasoning": (None,),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "conversation": (None,),
    "top_logprobs": (None, 0),
}


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1.0 is 1, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def unsupported(chat: bool) -> dict[str, tuple[Any, ...]]:
    return UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETION


def known(chat: bool) -> frozenset[str]:
    honoured = HONOURED_CHAT if chat else HONOURED_COMPLETION
    return frozenset((*HONOURED_BOTH, *honoured, *NO_EFFECT, *unsupported(chat)))


def check_fields(body: dict, chat: bool) -> None:
    """Refuse (400 `unsupported_parameter`, naming it) the first field that asks for what gmlx
    does not do, or that gmlx does not know."""
    _check(body, known(chat), unsupported(chat))


def check_embedding_fields(body: dict) -> None:
    """check_fields for an embeddings body."""
    _check(body, frozenset((*HONOURED_EMBEDDINGS, "user", *UNSUPPORTED_EMBEDDINGS)), UNSUPPORTED_EMBEDDINGS)


# POST /v1/messages (server/messages.py), Anthropic's shape, translated to a chat body.
HONOURED_MESSAGES = (
    "model",
    "max_tokens",
    "messages",
    "system",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "tools",
    "tool_choice",
)
# (cache_control: the prompt cache reuses every prefix without being asked; the rest route or label.)
NO_EFFECT_MESSAGES = ("metadata", "service_tier", "cache_control", "inference_geo", "workspace_id", "user_profile_id")
UNSUPPORTED_MESSAGES: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}),
    "mcp_servers": (None, []),
    "container": (None,),
    "output_config": (None,),
    "speed": (None,),
    "diagnostics": (None,),
}


def check_message_fields(body: dict) -> None:
    """check_fields for an Anthropic Messages body."""
    _check(body, frozenset((*HONOURED_MESSAGES, *NO_EFFECT_MESSAGES, *UNSUPPORTED_MESSAGES)), UNSUPPORTED_MESSAGES)


def check_response_fields(body: dict) -> None:
    """check_fields for a Responses body."""
    _check(body, frozenset((*HONOURED_RESPONSES, *NO_EFFECT_RESPONSES, *UNSUPPORTED_RESPONSES)), UNSUPPORTED_RESPONSES)


def _check(body: dict, names: frozenset[str], refused: dict[str, tuple[Any, ...]]) -> None:
    for name, value in body.items():
        if name not in names:
            raise bad_request(
                f"unknown field {name!r}: gmlx cannot tell what it would change, so it refuses it",
                name,
                code="unsupported_parameter",
            )
        if (harmless := refused.get(name)) is not None and not any(_same(value, h) for h in harmless):
            raise bad_request(f"{name!r} is not supported", name, code="unsupported_parameter")
