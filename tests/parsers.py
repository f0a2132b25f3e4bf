"""A command's parser as a user's ``--help`` builds it: its ``parse_args(["--help"])`` run with the help captured and
argparse's ``format_help`` wrapped to keep the parser it renders. Imports nothing heavy (``test_cli_parsers`` checks
what building a parser loads)."""
import argparse
import contextlib
import importlib
import io


def built_parser(module: str) -> tuple[argparse.ArgumentParser, str]:
    """(the parser the command ``module`` builds, the help it printed)."""
    rendered = []
    format_help = argparse.ArgumentParser.format_help

    def keep(parser):
        rendered.append(parser)
        return format_help(parser)

    argparse.ArgumentParser.format_help = keep
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            try:
                importlib.import_module(module).parse_args(["--help"])
            except SystemExit as e:
                assert e.code in (0, None), (module, e.code)
    finally:
        argparse.ArgumentParser.format_help = format_help
    return rendered[-1], out.getvalue()
