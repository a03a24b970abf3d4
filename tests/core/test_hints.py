"""The commands the tool prints for pasting carry no secret and run as printed."""

import shlex

import pytest

from optimizer.cli.run import build_parser
from optimizer.core.hints import export_hint, without_password


def command_of(hint):
    assert hint.startswith("export it: ")
    return shlex.split(hint[len("export it: "):].split("  (", 1)[0])


@pytest.mark.parametrize("url,bare", [
    ("postgresql://opt:s3cr%40t@db.example:5432/studies", "postgresql://opt@db.example:5432/studies"),
    ("postgresql+psycopg2://opt:pw@127.0.0.1/s", "postgresql+psycopg2://opt@127.0.0.1/s"),
])
def test_a_password_in_the_storage_url_moves_to_pgpassword(url, bare):
    hint = export_hint("llama8b", url, "studies")
    assert "***" not in hint and "s3cr" not in hint and ":pw@" not in hint
    assert "PGPASSWORD" in hint
    argv = command_of(hint)
    assert argv == ["optimize", "export", "--study", "llama8b", "--storage", bare]
    ns = build_parser().parse_args(argv[2:])  # the flags parse as printed
    assert ns.storage == bare and ns.study == "llama8b"


def test_a_url_without_password_is_printed_as_given():
    hint = export_hint("s", "postgresql://opt@db/s", "/data/studies")
    assert command_of(hint) == ["optimize", "export", "--study", "s", "--storage", "postgresql://opt@db/s",
                                "--studies-dir", "/data/studies"]
    assert "PGPASSWORD" not in hint


def test_the_default_sqlite_study_needs_no_storage_flag():
    assert export_hint("default", None, "studies") == "export it: optimize export --study default"


def test_a_driver_without_a_password_variable_says_where_the_password_goes():
    hint = export_hint("s", "mysql://u:pw@h/db", "studies")
    assert "pw" not in hint.replace("password", "") and "add the database password to the URL" in hint


def test_without_password_leaves_other_parts_alone():
    assert without_password("sqlite:////tmp/x.db") == ("sqlite:////tmp/x.db", None)
    assert without_password("postgresql://u:p@h:1/d?sslmode=require") == ("postgresql://u@h:1/d?sslmode=require",
                                                                          "PGPASSWORD")
