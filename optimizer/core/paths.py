"""Names and paths a user gives, checked at the edge: a study name that stays in its folder, a SQLite file that can be
created, an input file that is a file. Each bad one is a UsageError (exit code 2) that says what it is and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path

from optimizer.core.errors import UsageError

STUDY_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
MAX_STUDY_NAME_LEN = 100  # room for the suffixes of its files (.pilot.logs, .engine_args.json) within 255 bytes


def check_study_name(name: str) -> str:
    """Letters, digits, `.`, `-`, `_`, not starting with a dot: the name becomes file names in the studies folder
    (NAME.db, NAME.logs/), so `../x` or `a/b` would write outside it."""
    if not name:
        raise UsageError("--study is empty: give a name of letters, digits, '.', '-' or '_', e.g. --study llama8b")
    if len(name) > MAX_STUDY_NAME_LEN:
        raise UsageError(f"--study name is {len(name)} characters long: give at most {MAX_STUDY_NAME_LEN}")
    if not STUDY_NAME_RE.fullmatch(name):
        bad = sorted({c for c in name if not (c.isascii() and (c.isalnum() or c in "._-"))})
        what = (f"has {', '.join(repr(c) for c in bad)}" if bad else "starts with '.'")
        raise UsageError(f"--study {name!r} {what}: a study name is letters, digits, '.', '-' and '_' (not starting "
                         f"with '.'), since it names files in the studies folder, e.g. --study llama8b")
    return name


def describe_path(path: Path) -> str:
    """What is at `path`, in a few words: 'is a directory', 'does not exist', ..."""
    if path.is_dir():
        return "is a directory, not a file"
    if path.exists():
        return "is not a regular file"
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            return f"cannot exist: {str(parent)!r} is a file, not a directory"
    return "does not exist"


def require_file(path: str | Path, what: str) -> Path:
    """`path` as a Path when it is a readable regular file; else a UsageError that says what it is instead."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{what} file {str(p)!r} {describe_path(p)}: give the path of a {what} file")
    try:
        with p.open("rb"):
            pass
    except OSError as exc:
        raise UsageError(f"{what} file {str(p)!r} cannot be read ({exc.strerror}): check its permissions") from None
    return p


def sqlite_path(url: str) -> Path | None:
    """The file of a `sqlite:///PATH` URL (None for any other URL, or an in-memory database)."""
    if not url.startswith("sqlite:///"):
        return None
    raw = url[len("sqlite:///"):].split("?", 1)[0]
    return Path(raw) if raw and raw != ":memory:" else None


def check_sqlite_url(url: str, create: bool = True) -> None:
    """A SQLite study file must be a file in a folder that exists or can be made: otherwise one line that says what
    is in the way, instead of `FileExistsError` from deep inside. With `create`, the folder is made."""
    path = sqlite_path(url)
    if path is None:
        return
    hint = "choose a path in a folder you can write, e.g. --storage sqlite:///studies/NAME.db"
    if path.is_dir():
        raise UsageError(f"storage {url!r}: {str(path)!r} is a directory, not a database file: {hint}")
    if path.exists() and not path.is_file():
        raise UsageError(f"storage {url!r}: {str(path)!r} is not a regular file: {hint}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"storage {url!r}: {str(parent)!r} is a file, not a directory, so the database "
                                 f"cannot be created under it: {hint}")
            break
    if not create:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"storage {url!r}: cannot create the folder {str(path.parent)!r} "
                         f"({exc.strerror or type(exc).__name__}): {hint}") from None


def check_studies_dir(path: str | Path) -> None:
    """`--studies-dir` must be a folder, or a path where one can be made (nothing is made here)."""
    check_output_dir(path, "--studies-dir", "a folder for the studies")


def check_output_dir(path: str | Path, flag: str, what: str = "a folder to write into") -> Path:
    """A folder `flag` writes into must be one, or a path where one can be made under folders (nothing is made
    here): checked before any work, not found out as `FileExistsError` once the report is half written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {str(p)!r} is a file, not a directory: give {what}")
    _check_parents(p, flag)
    return p


def check_output_file(path: str | Path, flag: str, example: str) -> Path:
    """A file `flag` writes must not be a folder, and its folder must be one or can be made (nothing is made here);
    `example`: a file name to suggest inside a folder given instead."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {str(p)!r} is a directory: give a file name, e.g. {p / example}")
    _check_parents(p, flag)
    return p


def _check_parents(p: Path, flag: str) -> None:
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{flag} {str(p)!r} cannot be created: {str(parent)!r} is a file, not a directory")
            break
