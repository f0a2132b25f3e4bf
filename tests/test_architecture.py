"""The layout holds what ARCHITECTURE.md says: its tree matches the folders, the commands are the modules it names,
each command is thin (under 150 lines) and a console script, no module imports a command, no folder is crowded."""
import ast
import re
import tomllib

import pytest
from conftest import ROOT

LIBRARY = ("models", "pipeline", "finetune")


def tree_block() -> dict[str, str]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = text.split("## The tree", 1)[1].split("```", 2)[1]
    rows = {}
    for line in block.strip().splitlines():
        folder, _, what = line.partition(" ")
        rows[folder.rstrip("/")] = what.strip()
    return rows


def folders() -> set[str]:
    found = set()
    for top in LIBRARY:
        found.add(top)
        found.update(str(p.relative_to(ROOT)) for p in (ROOT / top).rglob("*")
                     if p.is_dir() and "__pycache__" not in p.parts)
    return found


def command_modules() -> dict[str, list[str]]:
    """Per folder, the modules that run as commands (an ``if __name__ == "__main__"`` block, or ``job_command``
    given the module's ``__name__``)."""
    out = {}
    for top in ("pipeline", "finetune"):
        out[top] = sorted(p.stem for p in (ROOT / top).glob("*.py")
                          if re.search(r'__name__ == "__main__"|job_command\(.*__name__\)', p.read_text()))
    return out


def test_the_tree_lists_every_folder_of_library_code_and_no_other():
    assert set(tree_block()) == folders()


def test_the_tree_names_the_commands_as_they_are():
    rows = tree_block()
    for top, commands in command_modules().items():
        named = re.match(r"commands: ([\w, ]+?)(;|$)", rows[top]).group(1)
        assert sorted(n.strip() for n in named.split(",")) == commands, top


def test_commands_are_thin_and_console_scripts():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    targets = {target.split(":")[0] for target in scripts.values()}
    for top, commands in command_modules().items():
        for name in commands:
            path = ROOT / top / f"{name}.py"
            lines = len(path.read_text().splitlines())
            assert lines < 150, f"{path.relative_to(ROOT)}: {lines} lines"
            assert f"{top}.{name}" in targets, f"{top}.{name} has no console script"
            assert re.search(r"^(cli = |def cli\(|main, cli = )", path.read_text(), re.M), f"{path} has no cli()"


def _imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_module_imports_a_command_module():
    commands = {f"{top}.{name}" for top, names in command_modules().items() for name in names}
    for top in LIBRARY:
        for path in (ROOT / top).rglob("*.py"):
            bad = _imports(path) & commands
            assert not bad, f"{path.relative_to(ROOT)} imports the command(s) {sorted(bad)}"


@pytest.mark.parametrize("top", LIBRARY)
def test_no_folder_holds_more_than_twelve_modules(top):
    for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 12, f"{folder.relative_to(ROOT)}: {len(modules)} modules"
