"""bcg: breakable CUDA graphs for diffusion transformers (no Ray in here)."""
__all__: list[str] = []
