"""A reader beside a running study: `optimize report`, `optimize export` and a dashboard-style read, in a loop.

    python -m tests.support.reader_loop KIND STUDIES_DIR OUT_DIR STOP_FILE

KIND is report, export, optuna (what optuna-dashboard does: load the study, list its trials) or dashboard
(optuna-dashboard's own HTTP API, through its WSGI app). Each pass prints one JSON line: the exit code, the stderr's
last line, and the finished trials seen that lack their values or stored result (a half-written trial). It stops
when STOP_FILE exists.
"""

import contextlib
import io
import json
import sys
import time
from pathlib import Path

import optuna

from optimizer.cli.main import main


def half_written(trials) -> list[int]:
    """Finished trials a reader sees without what a finished trial always has."""
    bad = []
    for t in trials:
        if t.state == optuna.trial.TrialState.COMPLETE and (not t.values or "result" not in t.user_attrs
                                                            or "curve" not in t.user_attrs):
            bad.append(t.number)
        if t.state == optuna.trial.TrialState.PRUNED and "pruned_reason" not in t.user_attrs:
            bad.append(t.number)
    return bad


def one_pass(kind: str, studies: Path, out: Path) -> dict:
    url = f"sqlite:///{studies}/s.db"
    if kind in ("report", "export"):
        argv = [kind, "--study", "s", "--studies-dir", str(studies), "--out", str(out)]
        if kind == "report":
            argv += ["--format", "json"]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
        seen = []
        if kind == "report" and code == 0:
            seen = [row["trial"] for row in json.loads(stdout.getvalue() or "{}").get("front", [])]
        return {"code": code, "err": (stderr.getvalue().strip().splitlines() or [""])[-1], "front": seen}
    if kind == "optuna":
        study = optuna.load_study(study_name="s", storage=url)
        trials = study.get_trials(deepcopy=False)
        return {"code": 0, "finished": sum(t.state.is_finished() for t in trials), "half": half_written(trials)}
    if kind == "dashboard":
        return dashboard_pass(url)
    raise SystemExit(f"unknown reader {kind}")


def dashboard_pass(url: str) -> dict:
    """GET optuna-dashboard's /api/studies and /api/studies/ID through its WSGI app, as its web page does."""
    from wsgiref.util import setup_testing_defaults

    import optuna_dashboard

    app = optuna_dashboard.wsgi(url)

    def get(path: str) -> tuple[str, dict]:
        environ: dict = {"PATH_INFO": path.split("?")[0], "QUERY_STRING": path.partition("?")[2],
                         "REQUEST_METHOD": "GET"}
        setup_testing_defaults(environ)
        status: list[str] = []
        body = b"".join(app(environ, lambda s, h, exc=None: status.append(s)))
        return status[0], json.loads(body or b"{}")

    status, studies = get("/api/studies")
    if not status.startswith("200"):
        return {"code": 1, "err": status}
    study_id = next(s["study_id"] for s in studies["study_summaries"] if s["study_name"] == "s")
    status, detail = get(f"/api/studies/{study_id}?after=0")
    trials = detail.get("trials", [])
    half = [t["number"] for t in trials if t["state"] == "Complete" and not t.get("values")]
    return {"code": 0 if status.startswith("200") else 1, "err": status, "finished": len(
        [t for t in trials if t["state"] in ("Complete", "Pruned")]), "half": half}


def run(kind: str, studies: Path, out: Path, stop: Path) -> None:
    while not stop.exists():
        try:
            result = one_pass(kind, studies, out)
        except Exception as exc:  # a reader that crashes is what the test looks for
            result = {"code": "crash", "err": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"kind": kind, "t": time.time(), **result}), flush=True)


if __name__ == "__main__":
    run(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
