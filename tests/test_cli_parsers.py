"""Every console script's parser is built, and its help rendered, without torch, DeepSpeed, transformers, datasets,
PEFT, TRL or torchao: ``--help`` stays fast because the commands import their work only once the arguments are
parsed. Asserted on ``sys.modules`` in one fresh interpreter for all commands, not timed. Every flag has a help
line, shows its default, and the usage names the console script."""
import json
import subprocess
import sys
import tomllib

from conftest import ROOT

from cli import cli_env

HEAVY = ("torch", "deepspeed", "transformers", "datasets", "peft", "trl", "torchao")
# torchrun's own parser (torch.distributed.run) is the launcher's: building it imports torch, nothing more
TORCH_PARSERS = {"pipeline.launch": ("torch",)}

# Each command's parser as a user's --help builds it (tests/parsers.py), in one fresh interpreter.
PROBE = """
import argparse, importlib, json, sys
sys.path.insert(0, "tests")
from parsers import built_parser
heavy, allowed, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
report = {}
for name in modules:
    parser, out = built_parser(name)
    loaded = sorted(m for m in heavy if m in sys.modules and m not in allowed.get(name, ()))
    actions = [a for a in parser._actions if a.help != argparse.SUPPRESS]
    report[name] = {"loaded": loaded, "usage": out.split("\\n")[0], "cli": callable(importlib.import_module(name).cli),
                    "no_help": [a.dest for a in actions if not (a.help or "").strip()],
                    "default_unshown": [a.dest for a in actions if a.option_strings and a.default not in
                                        (None, False, argparse.SUPPRESS) and "default" not in
                                        parser._get_formatter()._expand_help(a)]}
print(json.dumps(report))
"""


def console_scripts() -> dict[str, str]:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items()}


def test_every_parser_builds_without_heavy_libraries_and_explains_every_flag():
    scripts = console_scripts()
    # torchrun's parser last: the ones before it are checked in a process that has not loaded torch yet
    modules = sorted(scripts.values(), key=lambda m: m in TORCH_PARSERS)
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HEAVY), json.dumps(TORCH_PARSERS),
                           json.dumps(modules)], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == set(scripts.values())
    for name, module in scripts.items():
        r = report[module]
        assert r["loaded"] == [], f"{module}: building its parser imported {r['loaded']}"
        assert r["cli"], module
        assert r["usage"].startswith(f"usage: {name} "), f"{module}: {r['usage']}"
        if module not in TORCH_PARSERS:  # torchrun's flags and their help are torch's own
            assert r["no_help"] == [], f"{module}: flags without a help line: {r['no_help']}"
            assert r["default_unshown"] == [], f"{module}: defaults not shown: {r['default_unshown']}"


def test_the_parsers_copies_of_the_model_layers_values_agree():
    """pipeline.job.arguments and pipeline.plan repeat a few values of modules that load torch."""
    from models.gpt import RECOMPUTE_MODULES
    from models.parallel.layout import FP8_RECIPES
    from pipeline import plan
    from pipeline.job import arguments
    from pipeline.planning.layouts import DEFAULT_BUCKET
    from pipeline.planning.memory import POLICIES, PRECISION_BYTES

    assert arguments.RECOMPUTE_MODULES == RECOMPUTE_MODULES and arguments.FP8_RECIPES == FP8_RECIPES
    assert arguments.RECOMPUTE_POLICIES == POLICIES
    assert set(plan.PRECISIONS) == set(PRECISION_BYTES) and plan.DEFAULT_BUCKET == DEFAULT_BUCKET
