"""sparkforge: reproducible vLLM images for DGX Spark (GB10) clusters."""

__version__ = "0.1.0"
