"""`rpt serve` as a real process on a free loopback port, talked to by the `openai` package and by raw HTTP: answers,
streaming, concurrent clients, every refusal OpenAI-shaped, a client that leaves, the bearer token, a full server,
and the drain on SIGTERM. Every request loop is bounded in count and time."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_data) -> Path:
    from rpt.cli import main

    run = tmp_path_factory.mktemp("serve") / "tiny"
    main(["train", "--run-dir", str(run), "--set", f"data.path={tiny_data}", "--set", "model.d_model=32",
          "--set", "model.n_layers=2", "--set", "train.batch_size=8", "--set", "train.seq_len=32",
          "--set", "train.max_steps=40", "--set", "train.eval_interval=0", "--set", "train.eval_tokens=512"])
    return run


class Server:
    """`rpt serve RUN_DIR ARGS` on a free port: started, waited for (its /health), stopped."""

    def __init__(self, run: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "rpt", "serve", str(run), "--port", str(self.port), *args],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "".join(self.lines)
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server did not start in 120 s: " + "".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(run_dir):
    s = Server(run_dir, "--max-streams", "8", "--max-queue", "8", "--max-prompt-bytes", "4096")
    yield s
    s.stop()


def client(server: Server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                         timeout=60, **kw)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_a_greedy_completion_is_what_rpt_generate_gives(server, run_dir):
    from rpt.train.generation import generate_text

    answer = client(server).completions.create(model="tiny", prompt="ROMEO:", max_tokens=24, temperature=0)
    [choice] = answer.choices
    expected = generate_text(str(run_dir), "ROMEO:", 24, 0.0, 0, 1.0, None, "best", "cpu", out=io.StringIO())
    if choice.finish_reason == "length":
        assert choice.text == expected
    else:  # the end of text: rpt generate goes on past it (a new document), the server stops there
        assert choice.finish_reason == "stop" and expected.startswith(choice.text)
    assert answer.usage.completion_tokens <= 24 and answer.usage.prompt_tokens > 0
    assert answer.model == "tiny" and answer.object == "text_completion"


def test_streaming_several_prompts_and_choices_reproducibly_with_a_seed(server):
    def streamed():
        chunks = list(client(server).completions.create(
            model="tiny", prompt=["KING:", "First Citizen:"], n=2, max_tokens=12, temperature=0.9, seed=7,
            stream=True, stream_options={"include_usage": True}))
        texts, reasons = {}, {}
        for c in chunks[:-1]:
            for choice in c.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 4 * 12
        return texts, reasons

    texts, reasons = streamed()
    assert sorted(reasons) == [0, 1, 2, 3] and set(reasons.values()) <= {"length", "stop"}
    assert streamed()[0] == texts  # the same seed: the same four texts
    assert len(set(texts.values())) > 1  # the choices of a prompt differ (seed + choice)


def test_concurrent_clients_are_all_served(server):
    results, errors = {}, []

    def ask(i):
        try:
            answer = client(server).completions.create(model="tiny", prompt=f"Speech {i}:", max_tokens=16 + i,
                                                       temperature=0.8, seed=i)
            results[i] = answer.choices[0]
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]  # 8 run, 4 wait in the queue
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 12
    assert all(c.finish_reason in ("length", "stop") for c in results.values())


def test_models_health_and_metrics(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    client(server).completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("rpt_requests_total{outcome=\"ok\"}", "rpt_streams_active", "rpt_streams_queued",
                 "rpt_generated_tokens_total", "rpt_time_to_first_token_seconds_bucket",
                 "rpt_time_per_output_token_seconds_bucket", "rpt_state_bytes "):
        assert name in text, name
    per_stream = float(next(line.split()[1] for line in text.splitlines()
                            if line.startswith("rpt_state_bytes_per_stream ")))
    assert per_stream == 2 * 2 * 32 * 4  # two LSTM layers, (h, c) of 32 float32 numbers each


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "a", "max_tokens": 4, "colour": "red"}).encode(), 400, "colour"),
    (json.dumps({"prompt": "a", "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "max_tokens": 10 ** 12}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "temperature": 7}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "a", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "a", "stop": ["x"] * 5}).encode(), 400, "stop"),
    (json.dumps({"prompt": "a", "logprobs": 2}).encode(), 400, "logprobs"),
    (json.dumps({"prompt": "a", "depth": 2}).encode(), 400, "depth"),  # a model without a loop
    (json.dumps({"prompt": "a", "n": 100}).encode(), 400, "n"),  # more streams than run and wait together
    (json.dumps({"prompt": "a", "model": "gpt-4"}).encode(), 404, "model"),
    (json.dumps({"prompt": "a" * 5000}).encode(), 413, None),
])
def test_bad_requests_get_openai_shaped_errors_and_break_nothing(server, body, status, param):
    response = httpx.post(f"{server.url}/v1/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert error_of(response)["param"] == param
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_body_without_a_length_is_cut_at_the_limit(server):
    def chunks():
        for _ in range(10):
            yield b"x" * 1000

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=30)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def test_a_client_that_leaves_mid_stream_frees_its_slot_and_others_go_on(server):
    def active() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith("rpt_streams_active ")))

    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json={"prompt": "Long:", "max_tokens": 1_000_000, "stream": True, "ignore_eos": True}) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert got[0].startswith("data: ")
    deadline = time.monotonic() + 10
    while active() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active() == 0
    text = httpx.get(f"{server.url}/metrics").text
    assert 'rpt_streams_finished_total{reason="cancelled"}' in text
    answer = client(server).completions.create(model="tiny", prompt="After:", max_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop")


@pytest.fixture(scope="module")
def small_server(run_dir):
    s = Server(run_dir, "--max-streams", "1", "--max-queue", "0", "--token", "s3cret")
    yield s
    s.stop()


def test_the_bearer_token_guards_every_route_but_health(small_server):
    url = small_server.url
    assert httpx.get(f"{url}/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        denied = httpx.get(f"{url}{path}")
        assert denied.status_code == 401 and error_of(denied)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(small_server, api_key="wrong").models.list()
    assert client(small_server, api_key="s3cret").models.list().data[0].id == "tiny"


def test_a_full_server_answers_429_with_retry_after_and_serves_again_after(small_server):
    auth = {"Authorization": "Bearer s3cret"}
    with httpx.stream("POST", f"{small_server.url}/v1/completions", headers=auth, timeout=30,
                      json={"prompt": "Hold:", "max_tokens": 1_000_000, "stream": True, "ignore_eos": True}) as holding:
        lines = holding.iter_lines()  # (kept: an iterator dropped closes the response, and the client is gone)
        next(lines)  # the one slot is taken
        began = time.monotonic()
        refused = httpx.post(f"{small_server.url}/v1/completions", headers=auth, json={"prompt": "b"}, timeout=30)
        assert time.monotonic() - began < 1.0
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert error_of(refused)["type"] == "rate_limit_error"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        again = httpx.post(f"{small_server.url}/v1/completions", headers=auth, json={"prompt": "b", "max_tokens": 2},
                           timeout=30)
        if again.status_code != 429:
            break
        time.sleep(0.05)
    assert again.status_code == 200


def test_sigterm_drains_cuts_at_the_grace_period_and_exits_zero(run_dir):
    s = Server(run_dir, "--grace", "1")
    try:
        reasons = []
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=30,
                          json={"prompt": "On and on:", "max_tokens": 1_000_000, "stream": True, "ignore_eos": True}) as response:
            lines = response.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            late = httpx.post(f"{s.url}/v1/completions", json={"prompt": "late"}, timeout=10)
            assert late.status_code == 503 and error_of(late)["code"] == "shutting_down"
            for line in lines:
                if line.startswith("data: {"):
                    reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
        assert reasons == ["abort"]
        assert s.proc.wait(timeout=15) == 0
    finally:
        s.stop()


def test_a_looped_model_takes_its_depth_and_exit_per_request(tmp_path_factory, tiny_data):
    from rpt.cli import main

    run = tmp_path_factory.mktemp("serve-loop") / "looped"
    main(["train", "--run-dir", str(run), "--set", f"data.path={tiny_data}", "--set", "model.d_model=32",
          "--set", "model.n_layers=3", "--set", "model.loop_prelude=1", "--set", "model.loop_core=1",
          "--set", "model.loop_mean=2", "--set", "model.loop_max=4", "--set", "train.batch_size=8",
          "--set", "train.seq_len=32", "--set", "train.max_steps=20", "--set", "train.eval_interval=0",
          "--set", "train.eval_tokens=512"])
    s = Server(run)
    try:
        def ask(**extra):
            return httpx.post(f"{s.url}/v1/completions", json={"prompt": "KING:", "max_tokens": 8, "temperature": 0,
                                                                "ignore_eos": True, **extra}, timeout=60)

        texts = {d: ask(depth=d).json()["choices"][0]["text"] for d in (1, 4)}
        assert ask().json()["choices"][0]["finish_reason"] == "length"
        assert ask(exit="kl:1e-3").status_code == 200 and ask(depth=4, exit="change:0.01").status_code == 200
        from rpt.train.generation import generate_text

        for d, text in texts.items():  # ignore_eos: past an end of text both go on into a new document
            assert text == generate_text(str(run), "KING:", 8, 0.0, 0, 1.0, None, "best", "cpu", out=io.StringIO(),
                                         depth=d)
        for bad, param in (({"depth": 5}, "depth"), ({"depth": 0}, "depth"), ({"exit": "bogus:x"}, "exit"), ({"exit": "bogus"}, "exit"),
                           ({"exit": "shortlist:1e-3"}, "exit")):  # (its head has no shortlist)
            refused = ask(**bad)
            assert refused.status_code == 400 and error_of(refused)["param"] == param, refused.text
            assert "--" not in error_of(refused)["message"]  # in the API's words, not the command line's
    finally:
        s.stop()


def metric(server: Server, line_start: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(next((line.split()[-1] for line in text.splitlines() if line.startswith(line_start)), "0"))


def test_a_prompt_or_stop_string_that_is_not_unicode_text_is_a_400_naming_its_field(server):
    for body, param in (('{"prompt": "ab\\ud83dcd", "max_tokens": 2}', "prompt"),
                        ('{"prompt": ["fine", "\\udcff"], "max_tokens": 2}', "prompt"),
                        ('{"prompt": "ab", "stop": ["\\ude00"], "max_tokens": 2}', "stop")):
        refused = httpx.post(f"{server.url}/v1/completions", content=body.encode(), timeout=30)
        assert refused.status_code == 400, refused.text
        error = error_of(refused)
        assert error["param"] == param and "pair" in error["message"], error
    paired = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "ab\\ud83d\\ude42", "max_tokens": 2}',
                        timeout=30)
    assert paired.status_code == 200  # a surrogate pair is one character


def test_usage_and_metrics_count_each_prompt_once_whatever_its_choices(server):
    def usage(**kw):
        return httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 3, "temperature": 0.5, **kw},
                          timeout=60).json()["usage"]["prompt_tokens"]

    one = usage(prompt="import")
    before = metric(server, "rpt_prompt_tokens_total")
    assert usage(prompt="import", n=3) == one
    assert metric(server, "rpt_prompt_tokens_total") - before == one
    assert usage(prompt=["import", "import"], n=2) == 2 * one
    chunks = list(client(server).completions.create(model="tiny", prompt="import", n=3, max_tokens=3, stream=True,
                                                    stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == one


@pytest.mark.parametrize("body, param, said", [
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "true or false"),
    ({"prompt": "a", "stream": "true"}, "stream", "true or false"),
    ({"prompt": "a", "top_k": -2}, "top_k", "-1 for no limit"),
    ({"prompt": "a", "stop": ["a", 5]}, "stop", "strings"),
])
def test_one_set_of_rules_for_the_fields(server, body, param, said):
    refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400, refused.text
    error = error_of(refused)
    assert error["param"] == param and said in error["message"], error


def test_top_k_minus_one_and_zero_both_mean_no_limit(server):
    def greedy(**kw):
        return httpx.post(f"{server.url}/v1/completions", json={"prompt": "KING:", "max_tokens": 6, "seed": 3,
                                                                 "temperature": 0.9, **kw}, timeout=60).json()
    assert greedy(top_k=-1)["choices"][0]["text"] == greedy(top_k=0)["choices"][0]["text"]


def test_every_route_answers_openai_shaped_errors(server):
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 404 and "/v1/completions" in error_of(chat)["message"]
    with pytest.raises(openai.NotFoundError, match="base model"):
        client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert client(server).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client(server).models.retrieve("gpt-4")
    for method, path, status in (("GET", "/v1/completions", 405), ("GET", "/nowhere", 404),
                                 ("DELETE", "/v1/models", 405)):
        answer = httpx.request(method, f"{server.url}{path}")
        assert answer.status_code == status and error_of(answer)["message"], answer.text


def test_the_bearer_scheme_in_any_case_and_a_wrong_token_said_so(small_server):
    url = small_server.url
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "wrong" in error_of(wrong)["message"]
    missing = httpx.get(f"{url}/v1/models")
    assert missing.status_code == 401 and "needed" in error_of(missing)["message"]


def test_port_zero_takes_a_free_port_says_it_and_an_open_host_without_token_is_warned_of(run_dir):
    proc = subprocess.Popen([sys.executable, "-m", "rpt", "serve", str(run_dir), "--port", "0", "--host", "0.0.0.0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines, port = [], None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and port is None:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            if line.startswith("listening on http://0.0.0.0:"):
                port = int(line.split(":")[2].split("/")[0])
        warning = proc.stdout.readline()
        assert port and port != 0 and "open to the network with no token" in warning, "".join(lines) + warning
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("command", [["serve", "RUN", "--port", "99999"], ["serve", "RUN", "--port", "-1"],
                                     ["monitor", "RUN", "--port", "0"], ["monitor", "RUN", "--port", "70000"]])
def test_a_port_outside_its_range_is_refused_at_start(cli, command):
    code, out, err = cli(*command)
    assert code == 2 and "outside" in err and f"rpt {command[0]}" in err, err


def test_a_request_that_fails_inside_the_server_is_a_counted_500_in_openai_shape():
    from starlette.testclient import TestClient

    from rpt.serve.api import Service, build_app
    from rpt.serve.metrics import ServeMetrics

    class Broken:
        def encode(self, *a, **k):
            raise RuntimeError("a bug")

    class Idle:
        max_streams, max_queue = 4, 4

    metrics = ServeMetrics(64)
    service = Service("m", Broken(), 0, Idle(), metrics, 1 << 20)
    with TestClient(build_app(service), raise_server_exceptions=False) as http:
        answer = http.post("/v1/completions", json={"prompt": "a"})
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
    assert 'rpt_requests_total{outcome="error"} 1.0' in metrics.text().decode()


def test_rpt_generate_refuses_a_prompt_that_is_not_utf8_in_one_line(cli, run_dir):
    code, out, err = cli("generate", str(run_dir), "--prompt", "ab\udcffcd", "--max-new-tokens", "2")
    assert code == 2 and "Traceback" not in err and "byte 0xff" in err and "fix:" in err, err
