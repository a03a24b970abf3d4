"""PostgreSQL storage: workers that open a brand-new database at the same moment all get in."""

import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import REPO

URL = os.environ.get("OPTIMIZER_TEST_POSTGRES_URL")


@pytest.mark.skipif(not URL, reason="set OPTIMIZER_TEST_POSTGRES_URL (.ci/postgres start does) to run")
def test_workers_opening_an_empty_database_together_all_succeed():
    import psycopg2

    name = f"fresh_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect(URL.replace("postgresql://", "postgresql://", 1))
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    url = URL.rsplit("/", 1)[0] + "/" + name
    code = ("from optimizer.search.study import storage_for; from optimizer.search.records import RecordStore; "
            f"storage_for({url!r}); RecordStore({url!r})")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    try:
        assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n".join(errors)[-3000:]
    finally:
        admin.cursor().execute(f"DROP DATABASE {name} WITH (FORCE)")
        admin.close()
