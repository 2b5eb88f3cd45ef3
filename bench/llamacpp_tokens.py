"""Regenerates tests/data/gemma3_270m_llamacpp_tokens.json: the token ids llama.cpp gives.

    python -m bench.llamacpp_tokens [--model M.gguf] [--count 500] [--seed 0]

Keeps the texts already in the file (hand-picked cases and control-token cases) and appends
`--count` random strings made from a seeded generator (ASCII words, punctuation, digits,
whitespace runs, accented Latin, Greek, Cyrillic, CJK, Hangul, emoji, code snippets, random
code points), then asks the `llama-tokenize` binary built by bench/llama_build.py (built now if
missing) for every text's ids, with the model's BOS (add_bos). Texts holding a control token are
tokenized with special tokens parsed; the rest as plain text. tests/test_tokenizer.py compares
gmlx's tokenizer against every case. A few minutes: one llama-tokenize process per text.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import llama_build
from gmlx.default_model import resolve_model

REFERENCE = Path(__file__).parent.parent / "tests" / "data" / "gemma3_270m_llamacpp_tokens.json"
CONTROL = ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>")

WORDS = (
    "the",
    "of",
    "Paris",
    "capital",
    "hello",
    "world",
    "tokenization",
    "don't",
    "we'll",
    "I'm",
    "ALLCAPS",
    "camelCase",
    "snake_case",
    "return",
    "lambda",
    "naïve",
    "café",
    "Straße",
    "ǅ",
    "ﬁ",
    "a\u00a0b",
)
PUNCT = ".,;:!?-—–…'\"“”‘’()[]{}<>/\\|@#$%^&*_+=~`"
WHITESPACE = (
    " ",
    "  ",
    "   ",
    "    ",
    "        ",
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\n\n\n",
    "\r\n",
    " \n",
    "\n ",
    "\u3000",
    "\u200b",
    "\u00a0",
)
CODE = (
    "def f(x):\n    return x**2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    '<div class="a">x</div>',
    "SELECT * FROM t WHERE id = 1;",
    '{"key": [1, 2.5, null]}',
    "#include <stdio.h>",
    "$ ls -la | grep foo",
    "std::vector<int> v{1, 2};",
    "x => x + 1",
    "if __name__ == '__main__':",
    "http://example.com/a?b=c&d=%20",
    'fn main() { println!("hi"); }',
)
EMOJI = ("😀", "🤖", "👍🏽", "🇫🇷", "👨‍👩‍👧", "❤️", "🎉", "🐍", "🧪", "✅", "🫣", "⭐")
RANGES = {  # (first, last) code points of each script the strings draw letters from
    "latin": (0x00C0, 0x017F),
    "greek": (0x0391, 0x03C9),
    "cyrillic": (0x0410, 0x044F),
    "cjk": (0x4E00, 0x9FFF),
    "kana": (0x3041, 0x30FF),
    "hangul": (0xAC00, 0xD7A3),
    "arabic": (0x0621, 0x064A),
    "devanagari": (0x0905, 0x0939),
}


def _letters(rnd: random.Random, script: str) -> str:
    first, last = RANGES[script]
    return "".join(chr(rnd.randint(first, last)) for _ in range(rnd.randint(1, 6)))


def _code_point(rnd: random.Random) -> str:
    """Any assigned-or-not scalar value below U+30000, surrogates excluded."""
    while True:
        c = rnd.randint(0x20, 0x2FFFF)
        if not 0xD800 <= c <= 0xDFFF:
            return chr(c)


def _piece(rnd: random.Random) -> str:
    kind = rnd.choices(
        ("word", "ascii", "punct", "digits", "script", "code", "emoji", "point"), weights=(5, 4, 3, 3, 4, 1, 2, 1)
    )[0]
    if kind == "word":
        return rnd.choice(WORDS)
    if kind == "ascii":
        word = "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(1, 12)))
        return rnd.choice((word, word.capitalize(), word.upper()))
    if kind == "punct":
        return "".join(rnd.choice(PUNCT) for _ in range(rnd.randint(1, 4)))
    if kind == "digits":
        return rnd.choice(
            (
                str(rnd.randint(0, 10 ** rnd.randint(1, 12))),
                f"{rnd.uniform(-1e3, 1e3):.{rnd.randint(1, 5)}f}",
                hex(rnd.randint(0, 2**32)),
                f"{rnd.randint(1, 31)}/{rnd.randint(1, 12)}/20{rnd.randint(10, 30)}",
            )
        )
    if kind == "script":
        return _letters(rnd, rnd.choice(list(RANGES)))
    if kind == "code":
        return rnd.choice(CODE)
    if kind == "emoji":
        return "".join(rnd.choice(EMOJI) for _ in range(rnd.randint(1, 3)))
    return "".join(_code_point(rnd) for _ in range(rnd.randint(1, 4)))


def random_text(rnd: random.Random) -> str:
    parts = [rnd.choice(WHITESPACE)] if rnd.random() < 0.2 else []
    for _ in range(rnd.randint(1, 12)):
        parts.append(_piece(rnd))
        parts.append(rnd.choice(("", " ", " ", " ", rnd.choice(WHITESPACE))))
    return "".join(parts if rnd.random() < 0.3 else parts[:-1])


def llama_ids(binary: Path, model: Path, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(text.encode())  # -f reads the bytes verbatim; --no-escape keeps backslashes literal
        f.flush()
        argv = [str(binary), "-m", str(model), "-f", f.name, "--ids", "--no-escape", "--log-disable"]
        if not any(c in text for c in CONTROL):
            argv.append("--no-parse-special")
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.llamacpp_tokens")
    ap.add_argument("--model", help="GGUF file (the default model when omitted)")
    ap.add_argument("--count", type=int, default=500, help="random strings to add to the kept texts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REFERENCE)
    args = ap.parse_args()
    model = resolve_model(args.model)
    binary = llama_build.binary("llama-tokenize")
    old = json.loads(args.out.read_text(encoding="utf-8")) if args.out.exists() else {"cases": []}
    kept = [c["text"] for c in old["cases"][: old.get("kept", len(old["cases"]))]]
    rnd = random.Random(args.seed)
    seen, fresh = set(kept), []
    while len(fresh) < args.count:  # distinct texts, none already kept
        if (text := random_text(rnd)) not in seen:
            seen.add(text)
            fresh.append(text)
    cases = []
    for i, text in enumerate(kept + fresh):
        cases.append({"text": text, "ids": llama_ids(binary, model, text)})
        if i % 50 == 0:
            print(f"[tokens] {i}/{len(kept) + len(fresh)}", file=sys.stderr, flush=True)
    info = llama_build.build_info() or {}
    reference = {
        "source": f"llama.cpp's llama-tokenize (llama-cpp-python {info.get('llama_cpp_python', '?')} sdist) "
        "--ids, with the model's BOS; texts with a control token parse special tokens, the rest "
        "--no-parse-special. Regenerate: python -m bench.llamacpp_tokens",
        "model": model.name,
        "seed": args.seed,
        "kept": len(kept),
        "random": len(fresh),
        "cases": cases,
    }
    write_reference(args.out, reference)
    print(f"[tokens] wrote {len(cases)} cases to {args.out}", file=sys.stderr)


def write_reference(path: Path, reference: dict) -> None:
    """A test reference as JSON with one case a line, so a regenerated file diffs case by case."""
    head = json.dumps({k: v for k, v in reference.items() if k != "cases"}, ensure_ascii=False, indent=1)
    lines = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in reference["cases"])
    path.write_text(f'{head[:-2]},\n "cases": [\n{lines}\n ]\n}}\n', encoding="utf-8")


if __name__ == "__main__":
    main()
