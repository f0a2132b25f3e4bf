"""``--config job.yaml`` (or ``.toml``, ``.json``): any of a command's flags in a file, the command line overriding it.

    # job.yaml                                 # the same as --train-steps 1000 --lr 3e-4 --data a.txt --data b.txt
    train_steps: 1000                          # keys: the flag without its dashes, '_' or '-' alike
    lr: 3.0e-4
    data: [a.txt, b.txt]                       # a flag given more than once: a list
    sequence_parallel: true                    # a switch: true or false

The file becomes command-line words placed before the real ones, so argparse converts and checks every value as it
does a typed flag, and a flag on the command line replaces the file's value of it (a repeatable flag too: its
values on the command line replace the file's list). A key that names no flag of the command is refused in one
line naming the file and the key.
"""
from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Sequence
from pathlib import Path

import yaml

try:
    import tomllib
except ImportError:  # Python 3.10: TOML needs 3.11's tomllib
    tomllib = None

CONFIG_FLAG = "--config"
_SWITCHES = (argparse._StoreConstAction, argparse.BooleanOptionalAction)


class ConfigFileError(ValueError):
    """A user error (``pipeline.job.errors`` reports it by this marker: that module builds on this one)."""
    user_error = True


def config_path(argv: Sequence[str]) -> str | None:
    """The value of the last ``--config`` in ``argv`` (``--config F`` or ``--config=F``)."""
    path = None
    for i, word in enumerate(argv):
        if word == CONFIG_FLAG and i + 1 < len(argv):
            path = argv[i + 1]
        elif word.startswith(CONFIG_FLAG + "="):
            path = word.split("=", 1)[1]
    return path


def read_config_file(path: str) -> dict:
    """The file's mapping: YAML (.yaml/.yml), TOML (.toml) or JSON (.json)."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")  # a missing file: the OS error names it
    suffix = p.suffix.lower()
    if suffix == ".toml" and tomllib is None:
        raise ConfigFileError(f"{path}: TOML needs Python 3.11 or later (tomllib); write the file as YAML or JSON")
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            raise ConfigFileError(f"{CONFIG_FLAG} {path}: unknown file type {suffix or '(none)'}; use .yaml, .yml, "
                                  f".toml or .json")
    except (yaml.YAMLError, json.JSONDecodeError, *([tomllib.TOMLDecodeError] if tomllib else [])) as e:
        where = str(e).replace("\n", " ")
        raise ConfigFileError(f"{path}: not valid {suffix.lstrip('.').upper()} ({where}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: holds a {type(data).__name__}, not a mapping of flag names to values; "
                              f"write one 'flag_name: value' per line")
    return data


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each optional argument under its long names without dashes, '-' and '_' alike: ``train_steps``."""
    names = {}
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        for option in action.option_strings:
            if option.startswith("--") and option != CONFIG_FLAG:
                names[_key(option[2:])] = action
    return names


def _key(name: str) -> str:
    return str(name).replace("-", "_")


def _given(action: argparse.Action, argv: Sequence[str]) -> bool:
    return any(word == o or word.startswith(o + "=") for word in argv for o in action.option_strings)


def config_words(parser: argparse.ArgumentParser, path: str, argv: Sequence[str]) -> list[str]:
    """The command-line words the file stands for, without the flags ``argv`` gives itself."""
    actions = _flag_actions(parser)
    words = []
    for key, value in read_config_file(path).items():
        action = actions.get(_key(key))
        if action is None:
            close = difflib.get_close_matches(_key(key), list(actions), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"see {parser.prog} --help for its flags"
            raise ConfigFileError(f"{path}: key '{key}' is not a flag of {parser.prog}; {hint}")
        if not _given(action, argv):
            words += _words(action, key, value, path)
    return words


def _words(action: argparse.Action, key: str, value, path: str) -> list[str]:
    flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
    if isinstance(action, _SWITCHES) or action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigFileError(f"{path}: key '{key}' is a switch ({flag}); write true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [f"--{'' if value else 'no-'}{action.option_strings[0][2:]}"]
        return [flag] if value == bool(action.const) else []
    if value is None:
        return []
    if isinstance(value, dict):
        raise ConfigFileError(f"{path}: key '{key}' holds a mapping; write a value or a list of values for {flag}")
    values = value if isinstance(value, list) else [value]
    if action.nargs in (None, "?") and not isinstance(action, argparse._AppendAction):
        if len(values) != 1:
            raise ConfigFileError(f"{path}: key '{key}' takes one value ({flag}), not a list")
        return [flag, _text(values[0])]
    if isinstance(action, argparse._AppendAction):
        return [w for v in values for w in (flag, _text(v))]
    return [flag, *map(_text, values)]


def _text(value) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(CONFIG_FLAG, dest="config_file", default=None, metavar="FILE",
                        help="a YAML (.yaml), TOML (.toml) or JSON file of this command's flags, keys as flag names "
                             "without dashes (train_steps: 1000); flags on the command line override it")
