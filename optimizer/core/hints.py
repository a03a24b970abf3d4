"""Commands printed for the user to paste: they must work as printed and never carry a secret.

A storage URL with a password is printed without it; the password goes in an environment variable that the
database driver reads (PostgreSQL's libpq, hence psycopg2, reads PGPASSWORD), so the printed command still runs.
"""

from __future__ import annotations

import shlex

PASSWORD_ENV = {"postgresql": "PGPASSWORD", "postgres": "PGPASSWORD"}


def without_password(url: str) -> tuple[str, str | None]:
    """(the URL with no password at all, the environment variable to put it in; None when the URL had none).

    A driver with no such variable (MySQL's) gets an empty variable name: its password must stay in the URL."""
    try:
        from sqlalchemy.engine import URL, make_url

        parsed = make_url(url)
    except Exception:
        return url, None
    if parsed.password is None:
        return url, None
    bare = URL.create(parsed.drivername, parsed.username, None, parsed.host, parsed.port, parsed.database,
                      parsed.query).render_as_string(hide_password=False)
    return bare, PASSWORD_ENV.get(parsed.get_backend_name(), "")


def export_hint(study_name: str, storage_url: str | None, studies_dir: str, default_dir: str = "studies") -> str:
    """`export it: optimize export ...`, pasteable: the study, the storage without its password (and where the
    password goes instead), the studies folder when it is not the default."""
    parts = ["optimize", "export", "--study", study_name]
    note = ""
    if storage_url:
        bare, env = without_password(storage_url)
        parts += ["--storage", bare]
        if env:
            note = f"  (with the database password in {env}: export {env}=...)"
        elif env == "":
            note = "  (add the database password to the URL: this driver reads it from nowhere else)"
    if studies_dir != default_dir:
        parts += ["--studies-dir", studies_dir]
    return "export it: " + " ".join(shlex.quote(p) for p in parts) + note


def wrapped(words: list[str], width: int = 100, first: str = "", indent: str = "    ") -> str:
    """Shell words (each already quoted) as one command over lines of at most `width` characters where the words
    allow, each line but the last ending in ` \\`, so that it pastes as printed; `first` leads the first line and
    `indent` the others. A flag stays on the line of its value."""
    groups: list[str] = []
    for word in words:
        if groups and groups[-1].startswith("-") and " " not in groups[-1] and not word.startswith("-"):
            groups[-1] += " " + word
        else:
            groups.append(word)
    lines, line = [], first + (groups[0] if groups else "")
    for group in groups[1:]:
        if len(line) + 1 + len(group) + 2 > width:
            lines.append(line + " \\")
            line = indent + group
        else:
            line = f"{line} {group}"
    return "\n".join([*lines, line])
