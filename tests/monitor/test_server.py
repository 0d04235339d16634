"""The dashboard: the API answers what the store holds, refuses what it must, and a real browser renders it
live (headless Chromium driven by Selenium: the charts' series, and a live run's new steps without reload)."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from rpt.errors import RptError
from rpt.monitor.metrics import stragglers
from rpt.monitor.server import create_app, serve
from rpt.monitor.store import MetricsReader, MetricsWriter
from rpt.train.trainer import Trainer


@pytest.fixture(scope="module")
def recorded(tiny_data, tmp_path_factory) -> Path:
    """A finished 2-layer run with 8 steps, logged every 2."""
    from rpt.config import Config
    from rpt.parallel.launch import Dist
    import torch

    run = tmp_path_factory.mktemp("runs") / "recorded"
    cfg = Config.load(None, [f"data.path={tiny_data}", "model.d_model=32", "train.batch_size=4", "train.seq_len=16",
                             "train.max_steps=8", "train.eval_interval=4", "train.eval_tokens=1024",
                             "monitor.log_interval=2"])
    Trainer(cfg, run, Dist(0, 1, 0, torch.device("cpu")), show_progress=False).run()
    return run


def test_the_api_returns_what_the_store_holds(recorded):
    client = TestClient(create_app([recorded]))
    reader = MetricsReader(recorded)
    for table in ("train", "ranks", "evals", "state"):
        assert client.get(f"/api/runs/0/{table}").json() == reader.rows(table)
    assert [r["step"] for r in client.get("/api/runs/0/train?after=4").json()] == [6, 8]
    runs = client.get("/api/runs").json()
    assert runs[0]["name"] == "recorded" and runs[0]["live"] is False and runs[0]["summary"]["steps"] == 8
    assert "max_steps = 8" in client.get("/api/runs/0/config").text


@pytest.mark.parametrize("path", ["/api/runs/1/train", "/api/runs/0/sqlite_master", "/static/server.py",
                                  "/static/..%2F..%2Fconfig.toml", "/static/%2e%2e/store.py", "/../config.toml"])
def test_nothing_outside_the_dashboard_and_the_runs_store_is_served(recorded, path):
    response = TestClient(create_app([recorded])).get(path)
    assert response.status_code == 404, response.text


def test_a_token_guards_every_request(recorded):
    client = TestClient(create_app([recorded], token="s3cret"))
    assert client.get("/api/runs").status_code == 401
    assert client.get("/").status_code == 401
    assert client.get("/api/runs?token=wrong").status_code == 401
    assert client.get("/api/runs?token=s3cret").status_code == 200
    assert client.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_a_port_in_use_is_a_clear_error(recorded):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RptError, match=f"cannot listen on 127.0.0.1:{port}") as info:
            serve([str(recorded)], "127.0.0.1", port, None)
        assert "--port" in info.value.fix


def test_a_folder_that_is_not_a_run_is_refused(tmp_path):
    with pytest.raises(RptError, match="not a run directory"):
        serve([str(tmp_path)], "127.0.0.1", 0, None)


# ---------------------------------------------------------------------------------------------- the browser
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def _serve_in_thread(app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return server, thread, port


def _write_step(writer: MetricsWriter, step: int) -> None:
    rows = [{"rank": r, "step_s": 0.1, "forward_s": 0.03, "backward_s": 0.05, "optimizer_s": 0.01, "data_s": 0.0,
             "checkpoint_s": 0.0, "eval_s": 0.0, "exposed_comm_s": 0.01, "compute_s": 0.08 + 0.04 * r,
             "memory_bytes": 1e8, "stage": 0} for r in range(2)]
    writer.write_interval({"step": step, "time": time.time(), "tokens": step * 256, "loss": 5.0 - 0.1 * step,
                           "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 2560.0, "skipped_steps": 0},
                          rows, {0: (0.5, 0.01), 1: (0.7, 0.2)}, {0: 4096.0, 1: 1024.0}, stragglers(rows),
                          {0: 0.01, 1: 0.03})


def _chromium(tmp_path: Path):
    """Debian's headless Chromium driven through its ChromeDriver, with a profile of its own."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1300,2200", f"--user-data-dir={tmp_path / 'chrome'}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


NEEDS_CHROMIUM = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="Debian's chromium and chromium-driver "
                                    "are not installed (.ci/run installs them)")


@NEEDS_CHROMIUM
def test_with_a_token_the_page_opened_from_the_printed_address_draws_its_charts(recorded, tmp_path):
    """`rpt monitor --token T` prints http://HOST:PORT/?token=T: the page's stylesheet, plotly and app.js come
    with it (they were fetched without the token, and refused), and nothing is served without it."""
    from selenium.webdriver.support.ui import WebDriverWait

    app = create_app([recorded], token="s3cret")
    server, thread, port = _serve_in_thread(app)
    driver = _chromium(tmp_path)
    try:
        driver.get(f"http://127.0.0.1:{port}/?token=s3cret")
        wait = WebDriverWait(driver, 30, poll_frequency=0.2)
        wait.until(lambda d: d.execute_script("return (document.getElementById('loss').data || []).length") == 1)
        assert driver.execute_script("return typeof Plotly") == "object"
        assert driver.execute_script("return document.styleSheets[0].cssRules.length") > 0  # the stylesheet came
        assert driver.execute_script("return document.querySelectorAll('svg.main-svg').length") >= 6  # drawn
    finally:
        driver.quit()
        server.should_exit = True
        thread.join(timeout=10)
    client = TestClient(app)  # no cookie, no token: every path is refused, the page's own files too
    for path in ("/", "/static/app.js", "/static/style.css", "/static/plotly.min.js", "/api/runs",
                 "/api/runs/0/train"):
        assert client.get(path).status_code == 401, path
    client.cookies.set(f"rpt_monitor_{client.base_url.port or 80}", "wrong")
    assert client.get("/static/app.js").status_code == 401


@NEEDS_CHROMIUM
def test_the_dashboard_renders_the_runs_and_shows_new_steps_live(recorded, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    live = tmp_path / "live"
    live.mkdir()
    (live / "config.toml").write_text((recorded / "config.toml").read_text())
    writer = MetricsWriter(live)
    writer.set_meta(world_size=2, n_layers=2, tokens_per_rank_step=128,
                    progress={"step": 3, "max_steps": 10, "spent": 0.3, "eta_s": 42.0, "budget": "train.max_steps"})
    for step in (1, 2, 3):
        _write_step(writer, step)
    # the live run is a looped model: its validation at each depth, the state's change at each iteration
    writer.write_eval({"step": 2, "time": time.time(), "final": False, "loss": 3.0, "ppl": 20.0, "bpb": 2.1,
                       "by_depth": {1: {"loss": 3.2, "bpb": 2.3}, 2: {"loss": 3.0, "bpb": 2.1},
                                    4: {"loss": 2.9, "bpb": 2.05}},
                       "loop": {"state_rms": [1.0, 1.0], "state_change": [1.0, 0.2], "token_spread": 0.8},
                       "by_position": [{"from": 1, "to": 64, "tokens": 90, "bytes": 300, "bpb": 2.4},
                                       {"from": 65, "to": 256, "tokens": 40, "bytes": 130, "bpb": 2.0},
                                       {"from": 257, "to": None, "tokens": 0, "bytes": 0, "bpb": None}]})
    writer.write_profile(3, [{"steps": 2, "wall_s": 0.2, "compute_s": 0.12, "comm_s": 0.06, "overlap_s": 0.02,
                              "idle_s": 0.04}] * 2)
    server, thread, port = _serve_in_thread(create_app([recorded, live]))
    driver = _chromium(tmp_path)
    try:
        driver.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(driver, 30, poll_frequency=0.2)
        names = "return (document.getElementById(arguments[0]).data || []).map(t => t.name)"
        wait.until(lambda d: len(d.execute_script(names, "loss")) == 2)
        assert driver.execute_script(names, "loss") == ["recorded train", "live train"]
        # the periodic evaluations (first 1,024 tokens) and the final whole-split one are separate series
        assert driver.execute_script(names, "val") == ["recorded val (first 1,024 tokens)", "recorded final (whole split)",
                                                       "live val (whole split)"]
        # as a user sees them: the text rendered in the page, axis titles, legends and the runs' progress
        text = "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)"
        titles = {chart: (driver.execute_script(text, f"#{chart} .xtitle"), driver.execute_script(text, f"#{chart} .ytitle"))
                  for chart in ("loss", "val", "lr", "gradnorm", "throughput", "breakdown", "state", "gates")}
        assert titles == {"loss": (["step"], ["train loss (nats per token)"]), "val": (["step"], ["validation (bits per byte)"]),
                          "lr": (["step"], ["learning rate"]), "gradnorm": (["step"], ["gradient norm (before clipping)"]),
                          "throughput": (["step"], ["tokens per second"]), "breakdown": (["rank"], ["seconds per step"]),
                          "state": (["step"], ["state RMS"]), "gates": (["step"], ["share of gate outputs saturated"])}
        assert driver.execute_script(text, "#val .legendtext") == ["recorded val (first 1,024 tokens)",
                                                                   "recorded final (whole split)",
                                                                   "live val (whole split)"]
        assert driver.execute_script(text, "#lr .legendtext") == ["recorded lr", "live lr"]
        lines = driver.execute_script(text, "#runs .run")
        assert lines[0].startswith("recorded: finished, step 8 (ended by train.max_steps = 8), val loss ")
        assert lines[1] == "live: step 3 of 10, 30% of train.max_steps, ETA 0:42"
        # the per-run panels name their run at the top; the empty ones say why they are empty
        assert set(driver.execute_script(text, ".run-name")) == {"recorded"}
        assert driver.execute_script(text, "#profile .annotation-text") == [
            "no profiled steps: rpt train --profile START:END records them"]
        assert driver.execute_script(text, "#heatmap .annotation-text") == ["one process: no gradient communication"]
        shots = Path(os.environ.get("RPT_SCREENSHOTS", tmp_path))  # set it to keep the pictures
        shots.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(shots / "dashboard-recorded.png"))
        recorded_steps = MetricsReader(recorded).rows("train")
        xs = "return document.getElementById('loss').data[arguments[0]].x"
        assert driver.execute_script(xs, 0) == [r["step"] for r in recorded_steps]
        assert driver.execute_script(names, "breakdown") == ["data", "forward", "backward + optimizer",
                                                            "exposed communication", "checkpoint", "evaluation", "other"]
        assert driver.execute_script(names, "state") == ["layer 0", "layer 1"]
        assert driver.execute_script(names, "depth") == ["live step 2"]  # only the looped run has a depth curve
        curve = "return [document.getElementById('depth').data[0].x, document.getElementById('depth').data[0].y]"
        assert driver.execute_script(curve) == [[1, 2, 4], [2.3, 2.1, 2.05]]
        assert driver.execute_script(text, "#depth .xtitle") == ["iterations of the loop (depth)"]
        assert driver.execute_script(names, "position") == ["live step 2"]  # the bins with tokens
        curve = "return [document.getElementById('position').data[0].x, document.getElementById('position').data[0].y]"
        assert driver.execute_script(curve) == [["from 1", "from 65"], [2.4, 2.0]]
        assert driver.execute_script(names, "gates") == ["layer 0", "layer 1"]
        assert driver.execute_script("return document.querySelectorAll('svg.main-svg').length") >= 6  # drawn
        # the second run is live: new steps appear without a reload
        driver.execute_script("window.__same_page = 42")
        for step in (4, 5):
            _write_step(writer, step)
        wait.until(lambda d: d.execute_script(xs, 1)[-1] == 5)
        assert driver.execute_script(xs, 1) == [1, 2, 3, 4, 5]
        assert driver.execute_script("return window.__same_page") == 42
        hot = "return document.getElementById('hotspots').textContent"
        assert driver.execute_script(hot) == ""  # the recorded run: its chart says why it is empty
        # choose the live run: its per-rank views, heat map and named hot spots
        driver.execute_script("const s = document.getElementById('config-run'); s.value = '1';"
                              "s.dispatchEvent(new Event('change'))")
        wait.until(lambda d: d.execute_script(hot).startswith("hot spots"))
        assert driver.execute_script(hot) == "hot spots: bucket 0 80% of bytes, bucket 1 20% of bytes"
        assert set(driver.execute_script(text, ".run-name")) == {"live"}
        assert driver.execute_script(text, "#heatmap .cbtitle") == ["bytes per step"]
        assert driver.execute_script(text, "#heatmap .ytitle") == ["gradient bucket"]
        driver.save_screenshot(str(shots / "dashboard-live.png"))
        z = driver.execute_script("return document.getElementById('heatmap').data[0].z")
        assert z == [[4096.0] * 5, [1024.0] * 5]
        # the same heat map in time: bucket 1 is the slow one although it sends less
        driver.execute_script("const s = document.getElementById('heat-measure'); s.value = 'seconds';"
                              "s.dispatchEvent(new Event('change'))")
        assert driver.execute_script(hot) == "hot spots: bucket 1 75% of time, bucket 0 25% of time"
        assert driver.execute_script(names, "profile") == ["compute only", "compute + communication (overlap)",
                                                          "communication only", "idle"]
        assert driver.execute_script("return document.getElementById('profile').data[0].y") == pytest.approx([0.05] * 2)
        cells = driver.execute_script("return [...document.querySelectorAll('#progress tbody tr')]"
                                      ".map(r => [r.cells[0].textContent, r.cells[2].textContent])")
        assert cells == [["0", "5"], ["1", "5"]]
        # rank 1 computes 1.5x as long as its peer: flagged in the table of ranks and listed as a straggler
        assert driver.execute_script("return [...document.querySelectorAll('#progress tr.flag')]"
                                     ".map(r => r.cells[0].textContent)") == ["1"]
        listed = driver.execute_script("return [...document.querySelectorAll('#stragglers tbody tr')]"
                                       ".map(r => r.cells[1].textContent)")
        assert listed == ["1"] * 5
        # a row written after the page read its step still comes: a final validation at a periodic one's step
        val_steps = "return document.getElementById('val').data.filter(t => t.name.startsWith(arguments[0])).map(t => t.x)"
        writer.write_eval({"step": 5, "time": time.time(), "final": False, "loss": 2.9, "ppl": 18.0, "bpb": 2.0})
        wait.until(lambda d: d.execute_script(val_steps, "live val (") == [[2, 5]])
        writer.write_eval({"step": 5, "time": time.time(), "final": True, "loss": 2.8, "ppl": 16.0, "bpb": 1.9})
        wait.until(lambda d: d.execute_script(val_steps, "live final (") == [[5]])
        assert driver.execute_script(val_steps, "live val (") == [[2, 5]]  # each row once
    finally:
        driver.quit()
        writer.close()
        server.should_exit = True
        thread.join(10)
