"""The prompt cache: the KV of earlier prompts, reused by requests that start the same way.

Agent loops resend the whole conversation and parallel subagents share a system prompt, so
most of a prompt has often been prefilled before. Entries are one request's per-layer caches
(as `BatchGenerator.extract_cache` hands them out), keyed by the tokens they hold and found in
mlx_lm's `PromptTrie`. A hit is one of the tiers of docs/ARCHITECTURE.md, "Contract":

- `exact`: everything but the prompt's last token is cached (that one is recomputed for its logits);
- `block`: a trimmable entry (plain attention, or sliding layers not yet past their window)
  shares a prefix: reused up to a whole number of blocks, or whole when the entry is a prefix;
- `ckpt`: an entry that cannot be trimmed (sliding layers past their window) is a prefix of the
  prompt: a checkpoint taken during an earlier prefill, or an earlier conversation turn;
- `anchor`: the checkpoint at the end of a shared system prompt is a prefix of the prompt;
- `miss`: nothing reusable.

The cache is bounded by bytes with least-recently-used eviction. The engine thread owns the
arrays; `peek` (for /v1/estimate) and `snapshot` read only keys and counters, under a lock.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import PromptTrie, can_trim_prompt_cache, trim_prompt_cache

TIERS = ("exact", "block", "ckpt", "anchor", "miss")
_PREFERENCE = {"exact": 0, "anchor": 1, "ckpt": 2, "block": 3}  # on equal warm tokens
_MODEL = "served"  # PromptTrie keys entries by model; one engine serves one model


@dataclass(frozen=True)
class Hit:
    tier: str
    warm_tokens: int

    def to_json(self) -> dict:
        return {"tier": self.tier, "warm_tokens": self.warm_tokens}


MISS = Hit("miss", 0)


@dataclass
class _Entry:
    cache: list[Any]
    nbytes: int
    kind: str  # "final" (a request's whole cache), "ckpt" or "anchor" (taken during prefill)
    trimmable: bool


@dataclass
class PromptCacheStats:
    hits: Counter = field(default_factory=Counter)  # tier -> requests served from it
    misses: int = 0
    reused_tokens: int = 0
    stored_bytes: int = 0
    evicted_bytes: int = 0

    def to_json(self) -> dict:
        hits = sum(self.hits.values())
        lookups = hits + self.misses
        return {
            "hits": hits,
            "hits_by_tier": {t: self.hits.get(t, 0) for t in TIERS[:-1]},
            "misses": self.misses,
            "hit_rate": round(hits / lookups, 4) if lookups else None,
            "reused_tokens": self.reused_tokens,
            "stored_bytes": self.stored_bytes,
            "evicted_bytes": self.evicted_bytes,
        }


class PromptCache:
    def __init__(self, max_bytes: int, block_tokens: int = 16) -> None:
        if block_tokens < 1:
            raise ValueError(f"the prompt cache's block must be at least 1 token, not {block_tokens}")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self.bytes = 0
        self.stats = PromptCacheStats()
        self._trie = PromptTrie()
        self._lru: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    # --- lookups ------------------------------------------------------------------------

    def _lookup(self, tokens: list[int]) -> tuple[Hit, tuple[int, ...] | None]:
        """The best hit for a prompt and the key of the entry that gives it; changes nothing."""
        limit = len(tokens) - 1  # the last token is always prefilled, for its logits
        if not self._lru or limit < 1:
            return MISS, None
        found = self._trie.search(_MODEL, tokens[:limit])
        candidates: list[tuple[Hit, tuple[int, ...]]] = []
        for key in (found.exact, found.shorter):
            if key is not None:
                entry = self._lru[tuple(key)]
                tier = (
                    "exact"
                    if len(key) == limit
                    else "anchor"
                    if entry.kind == "anchor"
                    else "block"
                    if entry.trimmable
                    else "ckpt"
                )
                candidates.append((Hit(tier, len(key)), tuple(key)))
        if found.longer is not None and self._lru[tuple(found.longer)].trimmable:
            shared = min(found.common_prefix, limit)
            warm = shared if shared == limit else shared - shared % self.block_tokens
            if warm > 0:
                candidates.append((Hit("exact" if warm == limit else "block", warm), tuple(found.longer)))
        if not candidates:
            return MISS, None
        return min(candidates, key=lambda c: (-c[0].warm_tokens, _PREFERENCE[c[0].tier]))

    def peek(self, tokens: list[int]) -> Hit:
        """The tier a prompt would hit now, without counting it or touching the LRU order."""
        with self._lock:
            return self._lookup(tokens)[0]

    def fetch(self, tokens: list[int]) -> tuple[Hit, list[Any] | None]:
        """The best hit and a cache holding its first `warm_tokens` tokens (None on a miss)."""
        with self._lock:
            hit, key = self._lookup(tokens)
            if key is None:
                self.stats.misses += 1
                return MISS, None
            entry = self._lru[key]
            self._lru.move_to_end(key)
            self.stats.hits[hit.tier] += 1
            self.stats.reused_tokens += hit.warm_tokens
        # Shallow copies: trimming moves only offsets, and the batch merges the arrays into
        # its own, so the stored entry is never written.
        cache = [copy.copy(c) for c in entry.cache]
        if len(key) > hit.warm_tokens:
            trim_prompt_cache(cache, len(key) - hit.warm_tokens)
        return hit, cache

    # --- storing ------------------------------------------------------------------------

    def store(self, tokens: list[int], cache: list[Any], kind: str) -> bool:
        """Keep `cache`, which holds exactly `tokens`; False when it is too big to keep at all."""
        key = tuple(tokens)
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return True
        mx.eval([c.state for c in cache])  # detach it from the batch's lazy graph now
        nbytes = sum(c.nbytes for c in cache)
        if not key or nbytes > self.max_bytes:
            return False
        entry = _Entry(cache, nbytes, kind, can_trim_prompt_cache(cache))
        with self._lock:
            self._trie.add(_MODEL, list(key), entry)
            self._lru[key] = entry
            self.bytes += nbytes
            self.stats.stored_bytes += nbytes
            if entry.trimmable and kind == "final":
                # Any shorter entry it starts with can be had by trimming this one (anchors stay:
                # they name their tier and cost little).
                for other in [
                    k for k, e in self._lru.items() if e.kind != "anchor" and len(k) < len(key) and key[: len(k)] == k
                ]:
                    self._drop(other, evicted=False)
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._lru)), evicted=True)
        return True

    def evict_coldest(self, nbytes: int) -> int:
        """Drop least recently used entries until `nbytes` are freed or none is left (the
        governor's release under orange and red); returns the bytes freed."""
        freed = 0
        with self._lock:
            while self._lru and freed < nbytes:
                key = next(iter(self._lru))
                freed += self._lru[key].nbytes
                self._drop(key, evicted=True)
        return freed

    def _drop(self, key: tuple[int, ...], evicted: bool) -> None:
        entry = self._lru.pop(key)
        self._trie.pop(_MODEL, list(key))
        self.bytes -= entry.nbytes
        if evicted:
            self.stats.evicted_bytes += entry.nbytes

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "enabled": self.enabled,
                "max_bytes": self.max_bytes,
                "bytes": self.bytes,
                "entries": len(self._lru),
                "block_tokens": self.block_tokens,
                "entries_by_kind": dict(Counter(e.kind for e in self._lru.values())),
                **self.stats.to_json(),
            }
