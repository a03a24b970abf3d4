"""The user attributes of trials and studies (optimizer/search/attrs.py): one place names every key, the stored keys
never change (old studies load), a missing key reads as its default, and no module reads or writes an attribute
by a string of its own (read from the code, ast)."""

import ast
from pathlib import Path

import optuna
from optuna.trial import TrialState, create_trial

from optimizer.search import attrs
from optimizer.search.attrs import (
    BASELINE, CURVE, ENGINE_PROCESSES, PRESCREEN, PRUNED_DETAIL, PRUNED_REASON, RESULT, STUDY_ATTRS, STUDY_CONFIG,
    STUDY_PRESCREEN, TIMINGS, TRIAL_ATTRS, Attr, StudyAttr,
)
from tests.conftest import REPO

# The database form: these strings are what every study ever written holds. Never change one.
STORED_TRIAL_KEYS = {
    "BASELINE": "baseline", "RETRY_OF": "retry_of", "PRESCREEN": "prescreen", "SIM_GOODPUT_TOK_S": "sim_goodput_tok_s",
    "RUN": "run", "AB": "ab", "CONFIRM": "confirm", "WORKER": "worker", "GPUS": "gpus", "NODES": "nodes",
    "ENGINE_PROCESSES": "engine_processes", "ENGINE_PIDS": "engine_pids",
    "INTERRUPTED": "interrupted", "ENVIRONMENT_CAUSE": "environment_cause", "ENGINE_PARAMS": "engine_params",
    "ENGINE_CONFIG": "engine_config", "BASELINE_NOTE": "baseline_note", "MEMORY_WAITED_FOR": "memory_waited_for",
    "MEMORY_ESTIMATE_GIB": "memory_estimate_gib", "LOG_FILE": "log_file", "LOG_EXCERPT": "log_excerpt",
    "ENGINE_START_PHASES": "engine_start_phases", "TELEMETRY": "telemetry", "MACHINE_LOAD": "machine_load",
    "TIMINGS": "timings", "CURVE": "curve",
    "RESULT": "result", "LIMITED_BY": "limited_by", "PRUNED_REASON": "pruned_reason", "PRUNED_DETAIL": "pruned_detail",
}
STORED_STUDY_KEYS = {
    "STUDY_CONFIG": "optimizer_config", "STUDY_MACHINE": "machine", "STUDY_DEMO_SCALE": "demo_scale",
    "STUDY_REQUESTS_CHOICE": "num_requests_choice", "STUDY_PRESCREEN": "prescreen",
    "STUDY_P99_STABILITY": "p99_stability", "STUDY_VERIFY": "verify", "STUDY_CONFIRMATION": "confirmation",
    "STUDY_CREATED": "created", "STUDY_CONFIRMS": "confirms",
}


def _declared() -> dict[str, Attr]:
    return {name: v for name, v in vars(attrs).items() if isinstance(v, Attr)}


def test_the_stored_keys_are_the_database_form():
    declared = _declared()
    assert {n: a.key for n, a in declared.items() if not isinstance(a, StudyAttr)} == STORED_TRIAL_KEYS
    assert {n: a.key for n, a in declared.items() if isinstance(a, StudyAttr)} == STORED_STUDY_KEYS


def test_one_list_names_every_attribute_once_with_its_meaning():
    declared = _declared()
    assert set(TRIAL_ATTRS) | set(STUDY_ATTRS) == set(declared.values())
    assert all(not isinstance(a, StudyAttr) for a in TRIAL_ATTRS) and all(isinstance(a, StudyAttr) for a in STUDY_ATTRS)
    for group in (TRIAL_ATTRS, STUDY_ATTRS):
        keys = [a.key for a in group]
        assert len(keys) == len(set(keys)), keys
    assert all(a.meaning for a in declared.values())


def test_a_missing_key_reads_as_its_default_a_fresh_copy():
    t = create_trial(state=TrialState.COMPLETE, values=[1.0, 2.0])
    assert (BASELINE.of(t), RESULT.of(t), CURVE.of(t), TIMINGS.of(t)) == (False, {}, [], {})
    assert (PRUNED_REASON.of(t), PRUNED_DETAIL.of(t), ENGINE_PROCESSES.of(t)) == (None, "", [])
    RESULT.of(t)["x"] = 1
    CURVE.of(t).append(1)
    assert RESULT.of(t) == {} and CURVE.of(t) == [] and RESULT.default == {} and CURVE.default == []


def test_a_study_written_with_the_old_literal_keys_reads_through_the_fields():
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.set_user_attr("optimizer_config", "{}")
    study.set_user_attr("prescreen", {"picks": []})
    study.add_trial(create_trial(state=TrialState.COMPLETE, values=[1.0, 2.0],
                                 user_attrs={"baseline": True, "result": {"rate_rps": 2.5}, "prescreen": "top"}))
    t = study.trials[0]
    assert STUDY_CONFIG.of(study) == "{}" and STUDY_PRESCREEN.of(study) == {"picks": []}
    assert BASELINE.of(t) is True and RESULT.of(t)["rate_rps"] == 2.5 and PRESCREEN.of(t) == "top"


def test_the_fields_write_the_old_keys():
    study = optuna.create_study(directions=["maximize", "minimize"])
    STUDY_CONFIG.set(study, "{}")
    study.enqueue_trial({}, user_attrs={**BASELINE.item(True), **PRESCREEN.item("unsure")})
    trial = study.ask()
    RESULT.set(trial, {"feasible": False})
    assert study.user_attrs == {"optimizer_config": "{}"}
    assert study.trials[0].user_attrs == {"baseline": True, "prescreen": "unsure", "result": {"feasible": False}}


def _attr_call(node: ast.Call) -> bool:
    """set_user_attr("k", v), set_trial_user_attr(id, "k", v), set_study_user_attr(id, "k", v)."""
    name = node.func.attr if isinstance(node.func, ast.Attribute) else None
    pos = {"set_user_attr": 0, "set_trial_user_attr": 1, "set_study_user_attr": 1}.get(name or "")
    return pos is not None and len(node.args) > pos and _is_str(node.args[pos])


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _is_user_attrs(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "user_attrs"


def literal_uses(text: str) -> list[int]:
    """Lines that read or write a user attribute by a string literal."""
    lines = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):
            f = node.func
            if _attr_call(node) or (isinstance(f, ast.Attribute) and f.attr == "get" and _is_user_attrs(f.value)
                                    and node.args and _is_str(node.args[0])):
                lines.append(node.lineno)
            for kw in node.keywords:  # enqueue_trial(..., user_attrs={"k": v})
                if kw.arg == "user_attrs" and isinstance(kw.value, ast.Dict) and any(
                        k is not None and _is_str(k) for k in kw.value.keys):
                    lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _is_user_attrs(node.value) and _is_str(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and _is_str(node.left) and any(_is_user_attrs(c) for c in node.comparators):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_no_module_reads_or_writes_an_attribute_by_a_string_of_its_own():
    found = [f"{p.relative_to(REPO)}:{line}" for folder in ("optimizer", "benchmarks")
             for p in sorted((REPO / folder).rglob("*.py")) for line in literal_uses(p.read_text())]
    assert not found, found


def test_the_literal_check_sees_every_form():
    planted = '\n'.join([
        't.user_attrs.get("result", {})', 't.user_attrs["curve"]', '"ab" in t.user_attrs', 't.set_user_attr("x", 1)',
        's.set_trial_user_attr(i, "interrupted", "why")', 'study.enqueue_trial({}, user_attrs={"baseline": True})',
        'RESULT.of(t)', 'study.enqueue_trial({}, user_attrs=BASELINE.item(True))', 'd.get("result")',
    ])
    assert literal_uses(planted) == [1, 2, 3, 4, 5, 6]
    assert Path(attrs.__file__).parent.name == "search"
