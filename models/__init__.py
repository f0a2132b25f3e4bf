"""Model definitions built from the tensor-parallel primitives in models.parallel."""
from .config import ConfigError, GPTConfig
from .gpt import GPT

__all__ = ["ConfigError", "GPTConfig", "GPT"]
