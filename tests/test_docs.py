"""The README and docs/ as a newcomer reads them: the README is short and reaches every docs page, every relative
link resolves, and every command line they show parses with that command's own parser as written (the short
ones also run: the console scripts answer --help)."""
import importlib
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT

PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [ROOT / "README.md", *PAGES]
LAUNCHERS = ("deepspeed", "torchrun")
# a console script or file path -> the module that holds its parse_args
SCRIPTS = {name: target.split(":")[0]
           for name, target in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"].items()}
FILES = {"pipeline/pretrain.py": "pipeline.pretrain", "finetune/train.py": "finetune.train",
         "finetune/predict.py": "finetune.predict", "finetune/ensemble/build.py": "finetune.ensemble.build"}
PACKAGES = {"finetune.ensemble": "finetune.ensemble.build"}  # python -m PACKAGE: its __main__ runs this command


def code_lines(path: Path) -> list[str]:
    """The shell lines of a Markdown file's code (indented blocks and fences), continuations joined."""
    lines, fenced, out = path.read_text().splitlines(), False, []
    for line in lines:
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            if out and out[-1].endswith("\\"):
                out[-1] = out[-1][:-1] + " " + line.strip()
            else:
                out.append(line.strip())
    return out


def without_substitutions(line: str) -> str:
    """``$(...)`` (balanced) replaced by a placeholder word: what the shell would paste there is a path."""
    while "$(" in line:
        start = line.index("$(")
        depth, end = 0, start + 1
        for end in range(start + 1, len(line)):
            depth += {"(": 1, ")": -1}.get(line[end], 0)
            if depth == 0:
                break
        line = line[:start] + "SUBSTITUTED" + line[end + 1:]
    return line


def commands(path: Path) -> list[tuple[str, list[str]]]:
    """(module, argv) of each project command in the file's code, launcher flags left out."""
    found = []
    for line in map(without_substitutions, code_lines(path)):
        for part in re.split(r"&&|\|\|", line):
            plain = [w for w in part.split() if "=" not in w or w.startswith("-")]
            if not plain or not (plain[0] in LAUNCHERS + ("python", "python3") or plain[0] in SCRIPTS
                                 or plain[0] in FILES):
                continue  # output or prose shown as code, not a command
            words = shlex.split(part.split(" #")[0])
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # VAR=value prefixes
            if not words:
                continue
            if words[0] in LAUNCHERS:
                start = next((i for i, w in enumerate(words) if w in FILES or w == "-m"), len(words))
                words = words[start:]
            if words[:1] == ["-m"] or words[:2] in (["python", "-m"], ["python3", "-m"]):
                words = words[words.index("-m") + 1:]
                if words and words[0].split(".")[0] in ("pipeline", "finetune"):
                    found.append((PACKAGES.get(words[0], words[0]), words[1:]))
            elif words and words[0] in SCRIPTS:
                found.append((SCRIPTS[words[0]], words[1:]))
            elif words and words[0] in FILES:
                found.append((FILES[words[0]], words[1:]))
    return found


def test_readme_is_short_and_reaches_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for page in PAGES:
        assert f"(docs/{page.name})" in readme, f"README does not link {page.name}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" not in target:
            assert (doc.parent / target).exists(), f"{doc.name}: link {target} leads nowhere"


def test_no_paragraph_appears_twice():
    seen = {}
    for doc in DOCUMENTS:
        for para in re.split(r"\n\s*\n", doc.read_text()):
            text = " ".join(para.split())
            if len(text) > 120 and not text.startswith(("|", "python3 -m venv")):
                assert text not in seen, f"{doc.name} repeats a paragraph of {seen.get(text)}: {text[:80]}..."
                seen[text] = doc.name


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_every_command_line_parses_as_written(doc, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # outputs named relative to the working directory do not exist here
    for module, argv in commands(doc):
        assert not any(w.startswith("[") or w == "..." for w in argv), f"{doc.name}: `{module}` elides parts: {argv}"
        parsed = importlib.import_module(module).parse_args(argv)
        assert parsed is not None, (doc.name, module, argv)


def test_the_readme_shows_a_command_of_every_job():
    shown = {module for module, _ in commands(ROOT / "README.md")}
    assert {"pipeline.pretrain", "pipeline.export_hf", "pipeline.import_hf", "pipeline.evaluate",
            "finetune.train", "finetune.predict"} <= shown


def test_console_scripts_resolve_and_answer_help():
    for target in SCRIPTS.values():
        assert callable(importlib.import_module(target).cli)
    bindir = Path(sys.executable).parent
    for name in ("mds-plot", "mds-export-hf"):  # two real entry points, as a user types them
        script = bindir / name
        if not script.exists():
            pytest.skip(f"{script} absent: the package is not installed (pip install --no-deps -e .)")
        proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
