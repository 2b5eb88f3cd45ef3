"""A loaded GGUF -> an mlx_lm model directory (config, safetensors, tokenizer, chat template).

The weights are the loaded model's own parameters, so they carry every rename and
adjustment the loader made (Gemma's norms without the stored +1, for example), and
`mlx_lm.load(out)` rebuilds the same model gmlx serves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from gmlx import upstream
from gmlx.gguf.header import GGUFError
from gmlx.models.loader import Progress, architecture_for, load
from gmlx.models.weights_mode import GROUP_SIZE, WeightsOption

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class ExportReport:
    out_dir: Path
    mode: str  # "float" or "native"
    weight_bytes: int
    quantized_layers: int


def export(
    path: str | Path, out_dir: str | Path, weights: WeightsOption = "float", progress: Progress | None = None
) -> ExportReport:
    """Write `out_dir` so that `mlx_lm.load(out_dir)` gives the model `gmlx.models.loader.load` gives."""
    loaded = load(path, weights, progress)
    h = loaded.header
    if (why := architecture_for(h).export_blocker(h)) is not None:
        raise GGUFError(f"{h.path}: {why}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    config = architecture_for(h).model_args(h)
    config["eos_token_id"] = sorted(loaded.tokenizer.eos_token_ids)
    quantized = {
        name: {"group_size": m.group_size, "bits": m.bits}
        for name, m in loaded.model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    if quantized:
        bits = max(q["bits"] for q in quantized.values())
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": bits, **quantized}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    params = dict(tree_flatten(loaded.model.parameters()))
    mx.save_safetensors(str(out / WEIGHTS_FILE), params, metadata={"format": "mlx"})

    hf = upstream.hf_tokenizer(loaded.tokenizer)
    hf.save_pretrained(str(out))
    # The template goes inside tokenizer_config.json too, and the class is named as transformers 4
    # and 5 both know it, so the directory reads the same under either.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = hf.chat_template
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    return ExportReport(out, loaded.mode, sum(a.nbytes for a in params.values()), len(quantized))
