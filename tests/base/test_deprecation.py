"""The deprecated spellings of the commands' options (convbias.base.deprecation, used by convbias-diagnostics and
convbias-robustness): a parser that takes an option through `Deprecated` parses it as argparse's plain store
action does (the oracle: the same parser without it), and `announce` prints one note per spelling."""

from __future__ import annotations

import argparse

import pytest

from convbias.base import deprecation


def parsers(**option) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(a parser with --old stored through Deprecated, the same parser with argparse's plain store action)."""
    note, when = option.pop("note", "use --new {}"), option.pop("when", None)
    deprecated, plain = argparse.ArgumentParser(), argparse.ArgumentParser()
    for parser in (deprecated, plain):
        parser.add_argument("--new", default="n")
    deprecated.add_argument("--old", dest="value", action=deprecation.Deprecated, note=note, when=when, **option)
    plain.add_argument("--old", dest="value", **option)
    return deprecated, plain


@pytest.mark.parametrize(
    "option, argv",
    [
        ({}, ["--old", "x"]),
        ({}, []),  # not given: the default, and no note
        ({"type": int, "default": 3}, ["--old", "7", "--new", "m"]),
        ({"nargs": "+", "default": []}, ["--old", "a", "b"]),
        ({"type": int}, ["--old", "1", "--old", "2"]),  # given twice: the last value, as argparse keeps it
    ],
)
def test_a_deprecated_option_parses_as_the_plain_one(capsys, option, argv):
    deprecated, plain = parsers(**option)
    args = deprecated.parse_args(argv)
    deprecation.announce(args)
    assert vars(args) == vars(plain.parse_args(argv))  # options only: announce dropped the notes
    capsys.readouterr()


def test_each_spelling_is_one_note_with_its_last_value(capsys):
    deprecated, _ = parsers(nargs="+", note="give them first: cmd {} ...")
    args = deprecated.parse_args(["--old", "a", "--old", "b", "c"])
    assert capsys.readouterr().err == ""  # nothing before announce
    deprecation.announce(args)
    assert capsys.readouterr().err == "note: --old is deprecated; give them first: cmd b c ...\n"
    deprecation.announce(args)  # the notes were dropped: a second call prints nothing
    assert capsys.readouterr().err == ""


def test_when_limits_the_note_to_the_former_meaning(capsys):
    deprecated, _ = parsers(when=lambda value: value.endswith("/"), note="give the run {} first")
    for value, note in (
        ("weights.safetensors", ""),
        ("runs/a/", "note: --old is deprecated; give the run runs/a/ first\n"),
    ):
        args = deprecated.parse_args(["--old", value])
        deprecation.announce(args)
        assert args.value == value  # stored either way
        assert capsys.readouterr().err == note
