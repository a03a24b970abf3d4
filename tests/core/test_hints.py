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


def _bash_words(command: str) -> list[str]:
    """The words bash gives `command` (its line continuations included), as a shell would run it."""
    import subprocess

    done = subprocess.run(["bash", "-c", f"set -- {command}\nprintf '%s\\0' \"$@\""], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().split("\0")[:-1]


def test_a_long_command_wraps_at_the_width_and_pastes_as_the_one_line_form():
    from optimizer.core.hints import wrapped

    words = ["VLLM_X='a b'", "vllm", "serve", "/models/llama", "--max-num-seqs", "64", "--enable-prefix-caching",
             "--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.9", "--block-size", "16"]
    text = wrapped(words, width=40, first="deploy: ")
    lines = text.splitlines()
    # by hand: greedy lines of at most 40 characters, a flag on the line of its value, ` \` ending all but the last
    assert lines == ["deploy: VLLM_X='a b' vllm serve \\",
                     "    /models/llama --max-num-seqs 64 \\",
                     "    --enable-prefix-caching \\",
                     "    --max-num-batched-tokens 4096 \\",
                     "    --gpu-memory-utilization 0.9 \\",
                     "    --block-size 16"]
    assert all(len(line) <= 40 for line in lines)
    assert _bash_words(text[len("deploy: "):]) == _bash_words(" ".join(words))
    assert wrapped(words, width=1000) == " ".join(words)  # room for all of it: one line
