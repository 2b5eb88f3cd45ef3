"""One module per architecture, mapping GGUF names and keys onto mlx_lm's model classes; loader.py loads them."""

from gmlx.gguf.header import GGUFError

# The GGUF `general.architecture` values gmlx loads, known without importing mlx_lm, so that the
# header-only commands (gmlx inspect) refuse the others as fast as they read the header.
SUPPORTED = (
    "deepseek2",
    "gemma2",
    "gemma3",
    "granite",
    "llama",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
    "smollm3",
)


def check_supported(architecture: str) -> None:
    if architecture not in SUPPORTED:
        raise GGUFError(f"unsupported architecture {architecture!r} (supported: {', '.join(SUPPORTED)})")
