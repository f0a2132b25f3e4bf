"""The project's atomic writes (pipeline.job.files), under the names the finetuning modules import, and the strict
reading of a saved dataclass."""
from dataclasses import fields

from pipeline.job.files import atomic_write_bytes, atomic_write_figure, atomic_write_text

__all__ = ["atomic_write_bytes", "atomic_write_figure", "atomic_write_text", "strict_from_dict"]


def strict_from_dict(cls, d: dict, what: str):
    """``cls(**d)``, refusing keys the dataclass does not have (a file from another version says so)."""
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown {what} {sorted(unknown)} (known: {sorted(known)})")
    return cls(**d)
