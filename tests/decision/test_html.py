"""The HTML report (decision/html.py): what it opens with, every trial with what stopped it, the importance with its
trial count, and the page of a confirmed simulator study rendered by a real headless Chromium at 1400 px."""

import html
import io
import json
import os
import re
import shutil
import subprocess
from datetime import datetime, timedelta, timezone

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from optimizer.config.limits import Limits
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.decision.decide import decide
from optimizer.decision.html import NOT_RECORDED, length_mix_text, metadata_rows, render_html, run_info, trial_rows
from optimizer.decision.importance import TRUSTED_TRIALS_FOR_IMPORTANCE, importance_caveat
from optimizer.decision.plots import figure, titled_and_untitled, write_report
from optimizer.decision.report import summary_text
from optimizer.decision.views import confirmation_rows, title
from optimizer.hardware.machine import fingerprint
from optimizer.search.attrs import CONFIRM, STUDY_CREATED
from optimizer.search.study import confirmation_runs, is_confirmation
from tests.support.fakes import config_only_model_in, make_config, run_study
from tests.support import synthetic


def test_an_old_study_opens_with_what_it_stored_and_says_what_it_did_not(syn):
    study, config, _ = syn
    rows = dict(metadata_rows(decide(study, config), run_info(study, config)))
    assert list(rows) == ["model", "workload", "tuned for", "machine", "vLLM", "date", "trials"]
    assert rows["model"] == f"{config.model}, random weights"
    assert rows["workload"] == config.workload.describe() and rows["tuned for"] == "TTFT P99 <= 100ms"  # no mix
    assert rows["machine"] == rows["vLLM"] == NOT_RECORDED  # the synthetic study stored no fingerprint
    assert rows["date"].startswith(NOT_RECORDED + " (first trial started ")
    assert rows["trials"] == ("5 search trials: 4 meet the limit, 0 miss it (0 stopped early: they could not beat "
                              "the best so far), 1 could not run; no confirmation runs")


def test_the_length_mix_names_each_component_with_its_share():
    spec = WorkloadSpec(input_len_min=64, input_len_max=256, input_mixture=[
        {"weight": 0.3, "min": 1024, "max": 2048, "dist": "lognormal", "mean": 1500, "std": 200}])
    assert length_mix_text(spec) == ("prompts 70% 64-256 uniform, 30% 1024-2048 lognormal (mean 1500); completions "
                                     "100% 100-300 uniform")


def test_every_trial_says_what_stopped_it_and_what_it_changed(syn):
    study, config, _ = syn
    rows = {r["trial"]: r for r in trial_rows(decide(study, config))}
    assert list(rows) == ["#0", "#1", "#2", "#3", "#4"]
    # the synthetic curves store no counts: each probe is judged by its P99 (tests/support/synthetic.py)
    assert rows["#2"]["what stopped it"] == "at 8.80 req/s failed: TTFT P99 200ms over 100ms"
    assert rows["#0"]["what stopped it"] == "at 4.80 req/s failed: TTFT P99 150ms over 100ms"
    assert rows["#4"]["what stopped it"] == "could not run: out_of_memory: CUDA out of memory"
    assert rows["#2"]["changed from vLLM's defaults"] == "max_num_seqs 256\u2192128"
    assert rows["#0"]["changed from vLLM's defaults"] == "(vLLM's defaults)"
    assert rows["#2"]["role"] == "recommended" and rows["#2"]["output tok/s"] == "770.0"
    assert rows["#2"]["rate at the limit, req/s [95%]"] == "7.70 (passed)"  # no pooled fit stored
    assert rows["#2"]["TTFT P99"] == "97ms"  # the statistic of each limit at the chosen rate, named in the header
    loose = {r["trial"]: r for r in trial_rows(decide(study, config, Limits.ttft_p99(1000.0)))}
    assert loose["#2"]["what stopped it"] == "even a burst met the limits: no arrival pattern offers more"
    strict = {r["trial"]: r for r in trial_rows(decide(study, config, Limits.ttft_p99(25.0)))}
    assert strict["#0"]["what stopped it"] == ("no probe meets the limits; at 3.60 req/s failed: TTFT P99 90ms over "
                                               "25ms")


def test_importance_is_shown_with_its_trial_count_and_a_caveat_below_the_threshold(syn):
    study, config, _ = syn
    d = decide(study, config)
    page = render_html(d, b"png", run_info(study, config))
    assert "Parameter importance, from 3 trials that meet the limit" in page
    assert html.escape(importance_caveat(3)) in page and "computed from 3 trials" in importance_caveat(3)
    assert importance_caveat(TRUSTED_TRIALS_FOR_IMPORTANCE) is None
    assert page.count(html.escape(title(d))) == 1  # the title once (the page's figure is cut below its title)


@pytest.fixture(scope="module")
def confirmed(tmp_path_factory):
    """A confirmed study on the simulator: 3 search trials, then 2 rounds of the defaults and the best two."""
    d = tmp_path_factory.mktemp("confirmed")
    config = make_config(d, config_only_model_in(d), budget=9, confirm=2)
    return run_study(d, config), config, d


def test_a_new_study_stores_when_and_where_it_was_made(confirmed):
    study, config, _ = confirmed
    created = datetime.fromisoformat(STUDY_CREATED.of(study))
    assert created.tzinfo is not None and abs(datetime.now(timezone.utc) - created) < timedelta(hours=1)
    rows = dict(metadata_rows(decide(study, config), run_info(study, config)))
    assert rows["date"] == created.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert rows["vLLM"] == str(fingerprint("cpu")["vllm"]) and rows["machine"].endswith("; engine on cpu")
    runs = confirmation_runs(study)
    assert runs and not any(is_confirmation(t) for t in study.trials)  # in the study's confirmation study
    # a run that other processes disturbed is run again (its first run stays stored): count each (config, round) once
    done = {(CONFIRM.of(t)["of"], CONFIRM.of(t)["round"]) for t in runs}
    assert rows["trials"].endswith(f"; {len(done)} confirmation runs of {len(done)} planned (2 rounds of "
                                   f"{len(done) // 2} configs, 2 full)")


def test_the_page_lists_every_confirmation_run_with_its_reason(confirmed):
    study, config, _ = confirmed
    d = decide(study, config)
    rows = trial_rows(d)
    # the search's trials, then the confirmation runs by the names the report takes (c0, c1, ...)
    runs = confirmation_runs(study)
    assert [r["trial"] for r in rows] == [f"#{t.number}" for t in study.trials] + [f"c{t.number}" for t in runs]
    assert len([r for r in rows if r["role"].startswith("confirmation round")]) == len(runs) > 0
    assert all(r["what stopped it"] and r["what stopped it"] != "-" for r in rows)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# appended to a copy of the page: writes the layout's widths into the DOM once everything has loaded
LAYOUT_SCRIPT = ("<script>addEventListener('load',()=>{const p=document.createElement('pre');p.id='layout';"
                 "p.textContent=JSON.stringify({scroll:document.documentElement.scrollWidth,"
                 "client:document.documentElement.clientWidth,images:[...document.images].map(i=>i.naturalWidth)});"
                 "document.body.appendChild(p)})</script>")


@pytest.fixture(scope="session")  # before the module's study: a skip costs no study
def chromium() -> str:
    """Chromium's path; outside CI a skip where it is absent, in CI (CI=true) a failure: there it must run."""
    if CHROMIUM:
        return CHROMIUM
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is not installed, and CI must run this test: .ci/run installs it with .ci/chromium")
    pytest.skip("chromium is not installed (apt-get install chromium; CI installs it with .ci/chromium)")


def _headless(chromium: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'p'}",
             "--window-size=1400,900", "--virtual-time-budget=5000"]
    return subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=120, check=False)


def test_the_page_renders_in_chromium_at_1400_px_without_overflow_and_holds_the_decision(chromium, confirmed,
                                                                                        tmp_path):
    study, config, _ = confirmed
    d = decide(study, config)
    assert d.confirmed and d.best is not None
    _, page_path = write_report(d, tmp_path, run_info(study, config))
    probe = tmp_path / "layout.html"
    probe.write_text(page_path.read_text().replace("</body>", LAYOUT_SCRIPT + "</body>"))
    dom = _headless(chromium, tmp_path, "--dump-dom", probe.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = re.search(r'<pre id="layout">([^<]*)</pre>', dom.stdout)
    assert found, "the page did not finish loading in Chromium"
    layout = json.loads(html.unescape(found.group(1)))
    assert layout["scroll"] <= layout["client"] <= 1400, f"horizontal overflow at 1400 px: {layout}"
    assert layout["images"] and all(w > 0 for w in layout["images"])  # the embedded figure decoded
    # the recommendation's confirmed median and interval, as the console's end table prints them
    best = next(r for r in confirmation_rows(d) if r["trial"] == f"#{d.best.number}")
    console = summary_text(study, config)
    median, interval = best["tok/s (median)"], best["95% interval of the mean"]
    assert median in console and interval in console
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom.stdout))
    assert f"{median} output tok/s (median of" in text and f"95% interval of the mean {interval}" in text
    assert "Confirmation" in text and text.count(interval) >= 2  # headline and table
    shot = tmp_path / "page.png"
    assert _headless(chromium, tmp_path, f"--screenshot={shot}", page_path.as_uri()).returncode == 0
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 50_000


def test_the_figure_is_drawn_once_titled_for_the_file_and_cut_below_the_title_for_the_page():
    fig = Figure(figsize=(4, 3))
    FigureCanvasAgg(fig)
    fig.subplots().plot([0, 1], [0, 1])
    png, page = titled_and_untitled(fig, "a title")
    whole, cut = Image.open(io.BytesIO(png)), Image.open(io.BytesIO(page))
    assert whole.size == (440, 330) and cut.width == whole.width and 0 < whole.height - cut.height < 40
    band = whole.convert("L").crop((0, 0, whole.width, whole.height - cut.height))
    assert band.getextrema()[0] < 100  # the title's dark pixels are in the band cut off
    assert whole.crop((0, whole.height - cut.height, whole.width, whole.height)).tobytes() == cut.tobytes()


def test_the_defaults_as_run_caveat_is_on_the_page_once(tmp_path):
    study, config = synthetic.build(tmp_path, baseline_note=synthetic.FALLBACK_NOTE)
    d = decide(study, config)
    page = html.unescape(re.sub(r"<[^>]+>", " ", render_html(d, b"png", run_info(study, config))))
    assert page.count("does not fit on this CPU machine") == 1
    assert "vLLM's defaults (vllm serve) as this study ran them, not tuned: gpu_memory_utilization=0.3" in page


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 - 1 and b.x0 < a.x1 - 1 and a.y0 < b.y1 - 1 and b.y0 < a.y1 - 1


def test_no_legend_entry_runs_into_another_or_off_the_figure(confirmed):
    # a confirmed star's label carries its interval (~75 characters): three columns of such labels overlapped
    study, config, _ = confirmed
    fig = figure(decide(study, config))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 3  # the Pareto front, the history, latency vs load
    for legend in legends:
        boxes = [t.get_window_extent(renderer) for t in legend.get_texts()]
        assert all(page.x0 <= b.x0 and b.x1 <= page.x1 for b in boxes), "a legend label runs off the figure"
        assert not any(_boxes_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), \
            [t.get_text() for t in legend.get_texts()]
    star = next(t.get_text() for t in legends[0].get_texts() if t.get_text().startswith("recommended"))
    assert "95% interval" in star.replace("\n", " ")
