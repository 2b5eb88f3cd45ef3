"""Grammar-constrained decoding with llguidance: a JSON schema becomes a grammar over the served
model's own vocabulary, and each constrained row gets its own matcher, which masks that row's
logits every step so that only tokens the grammar allows can be sampled.

llguidance, not xgrammar: both compute a mask over gemma3's 262,144 tokens in tens of
microseconds, but xgrammar imports torch (and requires triton and transformers), several GB on a
CPU server, where llguidance has no dependencies; and it compiles a schema in about 1.5 ms to
xgrammar's 50 ms. llguidance is given each token's exact bytes from the GGUF's own vocabulary
(gmlx.gguf.vocab), byte-fallback tokens included, and the control tokens as special ones, which
no grammar here allows (byte 0xFF, llguidance's special-token marker, cannot be generated: no
valid UTF-8 has it). EOS is allowed exactly when the grammar is complete, and is then the only
token allowed once nothing more can follow, so a constrained response ends with its grammar.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np

from gmlx import kernels, upstream
from gmlx.gguf.vocab import token_bytes

if TYPE_CHECKING:
    from gmlx.models.loader import LoadedModel

log = logging.getLogger("gmlx.engine")

# One line of JSON with json.dumps' separators: with free whitespace a small model can spend
# its whole budget on newlines inside an object.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILED_PER_VOCABULARY = 64  # compiled grammars kept per served model (least recently used go first)
_NEG_INF_BITS = np.uint32(0xFF800000)  # float32 -inf
_SPECIAL_TYPES = (2, 3)  # llama.cpp's UNKNOWN and CONTROL token types


class GrammarError(ValueError):
    """A schema that cannot constrain decoding: invalid JSON Schema, unsatisfiable, or using a
    keyword llguidance does not implement (`not`, `if`/`then`, ...). The message names it."""


def json_schema_grammar(schema: Any) -> str:
    """The llguidance grammar for a JSON Schema object, checked without a tokenizer (well under a
    millisecond), so that a bad schema is the client's error before anything is queued."""
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(messages[0] if messages else "invalid schema")
    return grammar


@dataclass(frozen=True, eq=False)
class Constraint:
    """A grammar compiled for one vocabulary. Shared by every row it constrains: `matcher()` gives
    each row its own state."""

    grammar: str
    vocab_size: int  # the width of the model's logits, which the mask covers
    template: llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


class _GGUFTokens:
    """A vocabulary as llguidance's TokenizerWrapper reads it: each token's bytes, the special
    ones, and the model's tokenizer for text. Ids past the GGUF's tokens (padded embeddings) are
    empty special tokens, which no grammar allows."""

    def __init__(self, loaded: LoadedModel):
        header = loaded.header
        # The HF tokenizer inside, not the wrapper: that is _vocabularies' key, which this must not keep alive.
        self._encode = upstream.hf_tokenizer(loaded.tokenizer).encode
        self.tokens = token_bytes(header)
        types = header.get("tokenizer.ggml.token_type")
        self.special_token_ids = [] if types is None else [i for i, t in enumerate(types) if int(t) in _SPECIAL_TYPES]
        padding = range(len(self.tokens), loaded.geometry.vocab_size)
        self.tokens += [b""] * len(padding)
        self.special_token_ids += list(padding)
        self.eos_token_id = min(loaded.tokenizer.eos_token_ids)
        self.bos_token_id = loaded.tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:  # bytes raise here: llguidance then passes str
        return self._encode(text, add_special_tokens=False)


class Vocabulary:
    """llguidance's view of one served model's vocabulary, and the grammars compiled for it."""

    def __init__(self, loaded: LoadedModel):
        # About 1 s for a 262k vocabulary, the GIL held: built once per model, on first use.
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_GGUFTokens(loaded)),
            n_vocab=loaded.geometry.vocab_size,
            eos_token=sorted(loaded.tokenizer.eos_token_ids),
        )
        self.vocab_size = loaded.geometry.vocab_size
        self._compiled: OrderedDict[str, Constraint] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> Constraint:
        with self._lock:
            if (hit := self._compiled.get(grammar)) is not None:
                self._compiled.move_to_end(grammar)
                return hit
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise GrammarError(template.get_error())
            constraint = self._compiled[grammar] = Constraint(grammar, self.vocab_size, template)
            while len(self._compiled) > COMPILED_PER_VOCABULARY:
                self._compiled.popitem(last=False)
            return constraint


# Keyed by the model's tokenizer (a LoadedModel is no dict key), kept while the model is.
_vocabularies: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()


def vocabulary(loaded: LoadedModel) -> Vocabulary:
    """The Vocabulary of a loaded model, built once."""
    with _vocabularies_lock:  # held while building: concurrent first requests build it once
        if (vocab := _vocabularies.get(loaded.tokenizer)) is None:
            vocab = _vocabularies[loaded.tokenizer] = Vocabulary(loaded)
        return vocab


def compile_grammar(grammar: str, loaded: LoadedModel) -> Constraint:
    """A grammar from json_schema_grammar, compiled for the model (cached: the same grammar gives
    the same Constraint). A model's first call takes about a second: run it off the event loop."""
    return vocabulary(loaded).compile(grammar)


def json_schema_constraint(schema: dict[str, Any], loaded: LoadedModel) -> Constraint:
    """Constrain decoding to JSON that validates against `schema`: the Constraint to put in a
    request's Decoding. Raises GrammarError, whose message names the problem, for a schema that
    cannot be used."""
    return compile_grammar(json_schema_grammar(schema), loaded)


def additive_mask(bitmask: np.ndarray, width: int) -> np.ndarray:
    """0.0 where a bitmask row (llguidance's: bit i of word i // 32) allows token i, -inf where
    it does not. Built with integer ops: numpy's and MLX's `where` take about 1 ms on a 262k
    vocabulary, this a quarter of that."""
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:width]
    return ((1 - allowed).astype(np.uint32) * _NEG_INF_BITS).view(np.float32)


class GrammarProcessor:
    """One row's matcher as an mlx_lm logits processor. mlx_lm passes the row's tokens so far,
    prompt included; those past `start` that it has not seen are what the row generated since
    the last call, which the matcher consumes before masking the next token."""

    def __init__(self, constraint: Constraint, start: int):
        self._matcher = constraint.matcher()
        self._seen = start
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, constraint.vocab_size)

    def accepts(self, length: int, last: int) -> bool:
        """Whether the grammar takes the row's output as whole once the row is `length` tokens long
        (prompt included), the last being `last`: max_tokens reached just as the JSON closed."""
        m = self._matcher
        if self._seen < length and not m.is_stopped():
            m.consume_token(last)  # mlx_lm masks a step ahead: the row's last token may be unseen yet
            self._seen = length
        return m.is_accepting() and not m.is_error()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.shape[0] > self._seen:
            new = tokens[self._seen :].tolist()
            self._seen = tokens.shape[0]
            # Stopped, the last token is the EOS that ends the row: mlx_lm runs one step past it.
            if not self._matcher.is_stopped() and not self._matcher.consume_tokens(new):
                log.warning("a grammar rejected a generated token: %s", self._matcher.get_error())
        mx.async_eval(logits)  # the step's forward pass runs while the mask is computed
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        if kernels.available():  # one node reads the bits: no 1 MB mask to build and add per row
            return kernels.extension().mask_tokens(logits, mx.array(self._bitmask), stream=mx.cpu)
        return logits + mx.array(additive_mask(self._bitmask, logits.shape[-1])).astype(logits.dtype)
