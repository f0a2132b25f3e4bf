"""Model definitions built from the tensor-parallel primitives in models.parallel."""
from .config import ConfigError, GPTConfig
from .gpt import GPT
from .mlstm import MLSTM, MLSTMConfig, load_mlstm, save_mlstm

__all__ = ["ConfigError", "GPTConfig", "GPT", "MLSTM", "MLSTMConfig", "load_mlstm", "save_mlstm"]
