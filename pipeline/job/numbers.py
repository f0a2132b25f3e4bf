"""Numbers a user hands in, checked where they are parsed: argparse types for flags and one check for fields of
a JSON file. ``nan``, ``inf``, ``1e400``, a negative or zero size, a probability above 1 or a string where a
number belongs are refused in one line naming the flag or field.

    p.add_argument("--temperature", type=non_negative_float)       # argparse: "argument --temperature: ..."
    p.add_argument("--top-p", type=probability(open_low=True))     # (0, 1]
    p.add_argument("--gpus", type=int_in(1, 2**20))
    check_number(raw["capacity_factor"], "model.json: field 'capacity_factor'", positive_float)   # a config field

The bottom of the job layer: imports nothing of the project above ``pipeline.job.errors``.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from pipeline.job.errors import InputError

__all__ = ["positive_int", "non_negative_int", "int_in", "finite_float", "positive_float", "non_negative_float",
           "probability", "float_in", "parse_number", "check_number"]


def _int(text) -> int:
    if isinstance(text, bool) or isinstance(text, float):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    if isinstance(text, int):
        return text
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _float(text) -> float:
    if isinstance(text, bool):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """A whole number in [low, high] (no upper bound when ``high`` is None)."""
    def parse(text) -> int:
        value = _int(text)
        if value < low or (high is not None and value > high):
            bound = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: give a whole number {bound}")
        return value
    parse.__name__ = "int"
    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)


def float_in(low: float | None = None, high: float | None = None, *, open_low: bool = False,
             open_high: bool = False) -> Callable[[str], float]:
    """A finite number in the range (bounds included unless ``open_*``; None: no bound)."""
    def parse(text) -> float:
        value = _float(text)
        below = low is not None and (value <= low if open_low else value < low)
        above = high is not None and (value >= high if open_high else value > high)
        if below or above:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: give a finite number {_range(parse)}")
        return value
    parse.low, parse.high, parse.open_low, parse.open_high = low, high, open_low, open_high
    parse.__name__ = "float"
    return parse


def _range(parse) -> str:
    parts = []
    if parse.low is not None:
        parts.append(f"{'>' if parse.open_low else '>='} {parse.low:g}")
    if parse.high is not None:
        parts.append(f"{'<' if parse.open_high else '<='} {parse.high:g}")
    return " and ".join(parts)


finite_float = float_in()
positive_float = float_in(0, open_low=True)
non_negative_float = float_in(0)


def probability(*, open_low: bool = False, open_high: bool = False) -> Callable[[str], float]:
    """A number in [0, 1] (``open_low``: 0 excluded, as for top-p)."""
    return float_in(0, 1, open_low=open_low, open_high=open_high)


def parse_number(text, where: str, kind: Callable = finite_float):
    """Text from elsewhere than argparse (an environment variable) through one of the types above: its value,
    else an ``InputError`` naming ``where``."""
    try:
        return kind(text)
    except argparse.ArgumentTypeError as e:
        raise InputError(f"{where}: {e}") from None


def check_number(value, where: str, kind: Callable = finite_float):
    """A field of a JSON file: as ``parse_number``, and a string is refused even when it spells a number."""
    if isinstance(value, str):
        raise InputError(f"{where}: {value!r} is a string; give a number")
    return parse_number(value, where, kind)
