"""Regenerates tests/data/llamacpp_splits.json: llama.cpp's ids under each pre-tokenizer split.

    python -m bench.llamacpp_splits [--random 100] [--seed 0]

llama.cpp's tokenizer corpus covers 14 vocabularies, so most of the `tokenizer.ggml.pre` splits
it knows go unchecked there. This rewrites two of the corpus's byte-level vocabularies (their
tokens and merges) under one name of each distinct split in gmlx.gguf.splits, and asks
`llama-tokenize` (built by bench/llama_build.py when missing) for the ids of the corpus's texts,
of EXTRA and of `--random` seeded ones (bench.llamacpp_tokens' generator), without BOS. A split's
texts go in one call, joined by <|endoftext|>: llama.cpp cuts the control token out first and
tokenizes each text on its own. tests/test_tokenizer_corpus.py checks gmlx against every case.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

from bench import llama_build
from bench.llamacpp_tokens import random_text, write_reference
from gmlx.gguf.header import read_header
from gmlx.gguf.splits import SPLITS, SPM_STYLE_BPE
from gmlx.llama_sdist import vocab_corpus

REFERENCE = Path(__file__).parent.parent / "tests" / "data" / "llamacpp_splits.json"
# Two byte-level vocabularies: gpt-2 merges across digits, qwen2 across whitespace runs and marks.
BASES = ("gpt-2", "qwen2")
JOIN = "<|endoftext|>"
SEP = b"\n__ggml_vocab_test__\n"
# Texts aimed at what tells the splits apart: digit runs, contractions, case changes, marks, scripts.
EXTRA = [
    "1234567 12 1,234,567.89 ½²³ ٣٤٥",
    "I'M HERE, you'RE there; he'll 'LL 'd",
    "HelloWORLD camelCase XMLHttp ǅungla",
    "\r\n\r\n  x\n\n  \t\ty",
    "日本語のテキスト、カタカナ。한국어 텍스트 中文！",
    "កាន់តែពិសេស नमस्ते עִבְרִית",
    "a/b/c\n/d ./x ?!… 。，、",
    "<sentinel:12> IMGIMGABCZ    x  y",
    "ＡＢＣ ｄｅｆ １２３ ‘quoted’ “x”",
    " YouTube iPhone eBay McDonald's JavaScript",
    "x \n y  \n\n z",
    *(f"x{' ' * n}y" for n in (3, 5, 7, 10, 17, 33)),
    "e\u0301cole nai\u0308ve क्षत्रिय",
    "it's 'S 'Ll",
    "Word\r\n\r\n\tnext",
]


def representatives() -> list[str]:
    """One name for each distinct split (the first listed), SentencePiece-style BPE left out (gemma-4's
    corpus covers it; a byte-level vocabulary cannot stand in for one)."""
    seen: dict[tuple, str] = {}
    for name, split in SPLITS.items():
        if name not in SPM_STYLE_BPE:
            seen.setdefault((tuple(split.regexes), split.ignore_merges), name)
    return list(seen.values())


def corpus_texts(corpus: Path) -> list[str]:
    texts = set()
    for inp in corpus.glob("*.gguf.inp"):
        texts.update(t.decode("utf-8") for t in inp.read_bytes().split(SEP) if t)
    return sorted(texts)


# tokenizer.ggml.pre as a GGUF key-value starts: the key's length, the key, the string type.
_PRE_KEY = struct.pack("<Q", 18) + b"tokenizer.ggml.pre" + struct.pack("<I", gguf.GGUFValueType.STRING)


class Renamed:
    """The vocabulary-only GGUF `src` with its tokenizer.ggml.pre value swapped, byte for byte
    otherwise (a vocabulary-only file has no tensor data whose alignment a longer header would move)."""

    def __init__(self, src: Path) -> None:
        data = src.read_bytes()
        start = data.index(_PRE_KEY)
        at = start + len(_PRE_KEY)
        self.head, self.tail = data[:at], data[at + 8 + struct.unpack_from("<Q", data, at)[0] :]

    def write(self, dst: Path, pre: str) -> None:
        dst.write_bytes(self.head + struct.pack("<Q", len(pre.encode())) + pre.encode() + self.tail)
        if read_header(dst).get("tokenizer.ggml.pre") != pre:
            raise RuntimeError(f"could not rewrite {dst}")


def llama_ids(binary: Path, vocab: Path, texts: list[str], join_id: int) -> list[list[int]]:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(JOIN.join(texts).encode())
        f.flush()
        argv = [str(binary), "-m", str(vocab), "-f", f.name, "--ids", "--no-bos", "--no-escape", "--log-disable"]
        ids = json.loads(
            subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        )
    out: list[list[int]] = [[]]
    for i in ids:
        if i == join_id:
            out.append([])
        else:
            out[-1].append(i)
    if len(out) != len(texts):
        raise RuntimeError(f"{vocab.name}: {len(out)} pieces for {len(texts)} texts")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.llamacpp_splits")
    ap.add_argument("--random", type=int, default=100, help="seeded random texts besides the corpus's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REFERENCE)
    args = ap.parse_args()
    corpus = vocab_corpus()
    binary = llama_build.binary("llama-tokenize")
    rnd = random.Random(args.seed)
    texts = corpus_texts(corpus) + EXTRA + [random_text(rnd) for _ in range(args.random)]
    texts = [t for t in dict.fromkeys(texts) if JOIN not in t]
    names = representatives()
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for base in BASES:
            src = corpus / f"ggml-vocab-{base}.gguf"
            renamed, join_id = Renamed(src), read_header(src).get("tokenizer.ggml.tokens").index(JOIN)
            by_split = []
            for name in names:
                renamed.write(Path(tmp) / "vocab.gguf", name)
                by_split.append(llama_ids(binary, Path(tmp) / "vocab.gguf", texts, join_id))
                print(f"[splits] {base} {name}", file=sys.stderr, flush=True)
            for i, text in enumerate(texts):
                variants = list(dict.fromkeys(json.dumps(ids[i]) for ids in by_split))  # most splits agree
                cases.append(
                    {
                        "base": base,
                        "text": text,
                        "variants": [json.loads(v) for v in variants],
                        "split_variant": [variants.index(json.dumps(ids[i])) for ids in by_split],
                    }
                )
    info = llama_build.build_info() or {}
    write_reference(
        args.out,
        {
            "source": f"llama.cpp's llama-tokenize (llama-cpp-python {info.get('llama_cpp_python', '?')} sdist) --ids "
            "--no-bos on the corpus's vocabularies in `bases`, rewritten under each of `splits` (one name per "
            "distinct split); a case's ids under splits[k] are variants[split_variant[k]]. "
            "Regenerate: python -m bench.llamacpp_splits",
            "seed": args.seed,
            "bases": list(BASES),
            "splits": names,
            "cases": cases,
        },
    )
    print(
        f"[splits] wrote {len(names)} splits x {len(texts)} texts x {len(BASES)} vocabularies to {args.out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
