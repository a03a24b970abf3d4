"""Raw per-request records of every replay, in the study's own database beside Optuna's tables.

Any metric or percentile can be recomputed later from them without rerunning (`load` -> `metrics.summarize`).
Warm-up requests are not stored: they are never measured.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import (Boolean, Column, Float, Integer, MetaData, String, Table, Text, create_engine, inspect,
                        select)

from optimizer.measurement.metrics import RequestRecord

_metadata = MetaData()
RECORDS = Table(
    "optimizer_request_records",
    _metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("study_name", String(512), nullable=False, index=True),
    Column("trial_number", Integer, nullable=False, index=True),
    Column("replay", Integer, nullable=False),
    Column("offered_rate_rps", Float, nullable=True),  # NULL for a burst
    Column("request_index", Integer, nullable=False),
    Column("input_len", Integer, nullable=False),
    Column("output_tokens", Integer, nullable=False),
    Column("planned_s", Float, nullable=False),
    Column("sent_s", Float, nullable=False),
    Column("first_token_s", Float, nullable=True),
    Column("chunk_times_s", Text, nullable=False),  # JSON list of seconds on the replay's clock
    Column("ok", Boolean, nullable=False),
    Column("error", Text, nullable=False),
)


class RecordStore:
    """Writes and reads request records through SQLAlchemy, at the study's storage URL."""

    def __init__(self, url: str, create: bool = True) -> None:
        from optimizer.search.dbretry import engine_kwargs
        from optimizer.search.study import with_installed_driver, with_schema_retry

        self._engine = create_engine(with_installed_driver(url), **engine_kwargs(url))
        if create:
            with_schema_retry(lambda: _metadata.create_all(self._engine))

    @classmethod
    def existing(cls, url: str) -> RecordStore | None:
        """The records at `url` to read, where the study's database holds them (None: no table of them); nothing
        is created."""
        store = cls(url, create=False)
        if not inspect(store._engine).has_table(RECORDS.name):
            store.close()
            return None
        return store

    def save(self, study_name: str, trial_number: int, replay: int, offered_rate_rps: float,
             records: list[RequestRecord]) -> None:
        rate = offered_rate_rps if offered_rate_rps != float("inf") else None
        rows: list[dict[str, Any]] = [
            {"study_name": study_name, "trial_number": trial_number, "replay": replay, "offered_rate_rps": rate,
             "request_index": r.index, "input_len": r.input_len, "output_tokens": r.output_tokens,
             "planned_s": r.planned_s, "sent_s": r.sent_s, "first_token_s": r.first_token_s,
             "chunk_times_s": json.dumps(r.chunk_times_s), "ok": r.ok, "error": r.error}
            for r in records
        ]
        if rows:
            from optimizer.search.dbretry import with_retries

            def insert() -> None:  # one transaction: an attempt that failed before its commit wrote nothing
                with self._engine.begin() as conn:
                    conn.execute(RECORDS.insert(), rows)

            with_retries(insert, f"storing the requests of trial {trial_number}'s replay {replay}")

    def load(self, study_name: str, trial_number: int) -> list[tuple[float, list[RequestRecord]]]:
        """[(offered rate, records)] per replay, in replay order (a burst's rate is infinity)."""
        query = (select(RECORDS).where(RECORDS.c.study_name == study_name, RECORDS.c.trial_number == trial_number)
                 .order_by(RECORDS.c.replay, RECORDS.c.id))
        out: dict[int, tuple[float, list[RequestRecord]]] = {}
        with self._engine.connect() as conn:
            for row in conn.execute(query).mappings():
                rate = float("inf") if row["offered_rate_rps"] is None else row["offered_rate_rps"]
                rec = RequestRecord(index=row["request_index"], input_len=row["input_len"],
                                    planned_s=row["planned_s"], sent_s=row["sent_s"],
                                    first_token_s=row["first_token_s"],
                                    chunk_times_s=json.loads(row["chunk_times_s"]),
                                    output_tokens=row["output_tokens"], ok=row["ok"], error=row["error"])
                out.setdefault(row["replay"], (rate, []))[1].append(rec)
        return [out[k] for k in sorted(out)]

    def close(self) -> None:
        self._engine.dispose()
