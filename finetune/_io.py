"""The project's atomic writes (pipeline.files), under the names the finetuning modules import."""
from pipeline.files import atomic_write_bytes, atomic_write_text

__all__ = ["atomic_write_bytes", "atomic_write_text"]
