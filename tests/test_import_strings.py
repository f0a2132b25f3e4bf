"""No library module reaches another through an importlib string: a "module:attribute" name resolved at run time is
an import that import-linter's layer contracts cannot see (the family registry held eleven, three of them naming
finetune from pipeline). The family spec (pipeline.job.families) holds real callables instead."""
import ast

from conftest import ROOT

LIBRARY = ("models", "pipeline", "finetune")
RUNTIME_IMPORTS = {"import_module", "__import__", "find_spec"}


def project_module_strings(tree: ast.AST) -> list[str]:
    """String constants shaped "<models|pipeline|finetune>.<module>:<attribute>"."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            module, colon, attr = node.value.partition(":")
            if colon and attr.isidentifier() and module.split(".")[0] in LIBRARY and \
                    all(part.isidentifier() for part in module.split(".")):
                found.append(node.value)
    return found


def runtime_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [n for n in names if n and n.split(".")[0] == "importlib"]
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in RUNTIME_IMPORTS:
                found.append(name)
    return found


def test_no_module_names_another_through_an_importlib_string():
    offenders = {}
    for top in LIBRARY:
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            found = project_module_strings(tree) + runtime_imports(tree)
            if found:
                offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, offenders


def test_the_check_sees_a_registry_of_strings():
    """What the family registry held before its spec held callables is found."""
    tree = ast.parse('import importlib\nrefs = {"encoder": "finetune.model:GPTEncoder"}\n'
                     'part = importlib.import_module("finetune.model")')
    assert project_module_strings(tree) == ["finetune.model:GPTEncoder"]
    assert runtime_imports(tree) == ["importlib", "import_module"]
