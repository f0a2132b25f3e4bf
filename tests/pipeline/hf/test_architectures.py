"""Each Hugging Face architecture is one module of pipeline/hf/architectures/ and one line of its registry, and the
shared conversion (pipeline/hf/convert.py) names no variant or family: what differs is in the modules' specs."""
import ast
import importlib
import re

from conftest import ROOT

from pipeline.hf.architectures import HF_FAMILIES, VARIANT_WEIGHTS
from pipeline.hf.architectures.base import HFFamily, WeightLayout

FOLDER = ROOT / "pipeline" / "hf" / "architectures"
SHARED = {"__init__", "base", "decoder"}  # the spec's types, and what the llama-variant families share


def test_every_architecture_module_is_one_registered_family():
    modules = sorted(p.stem for p in FOLDER.glob("*.py") if p.stem not in SHARED)
    families = {m: importlib.import_module(f"pipeline.hf.architectures.{m}").FAMILY for m in modules}
    assert all(isinstance(f, HFFamily) for f in families.values())
    assert {f.model_type for f in families.values()} == set(modules) == set(HF_FAMILIES)
    assert all(HF_FAMILIES[m] is f for m, f in families.items())
    assert {f.variant for f in families.values()} == set(VARIANT_WEIGHTS)
    assert all(isinstance(w, WeightLayout) for w in VARIANT_WEIGHTS.values())


def test_the_shared_conversion_branches_on_no_variant_or_family():
    tree = ast.parse((ROOT / "pipeline" / "hf" / "convert.py").read_text())
    branches = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and any(isinstance(side, ast.Constant) and side.value in {*HF_FAMILIES, *VARIANT_WEIGHTS}
                        for side in (node.left, *node.comparators))]
    assert not branches, branches
    assert not re.search(r"\b(variant|model_type) == \"", ast.unparse(tree))
