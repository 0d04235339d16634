"""`rpt monitor RUN_DIR [RUN_DIR ...]`: the live dashboard, a Starlette app served by uvicorn.

Read-only: every answer comes from the runs' metrics.sqlite (opened read-only, a fresh connection
per request, so requests never share a connection across threads) and their config.toml and
summary.json. Runs are addressed by their index on the command line, never by a path, and the only
files served are the dashboard's own (rpt/monitor/static) and plotly.min.js from the installed
plotly package: no path from a request reaches the file system, and nothing comes from a CDN.
The page polls /api every two seconds for rows after the last step it has, so a live run's new
steps appear without a reload. Loopback by default; `--token T` requires the token on every request: the
address printed carries it as ?token=T, and the page it opens keeps it in an HttpOnly cookie for its own
stylesheet, scripts and API calls (a bearer header works too).
"""

from __future__ import annotations

import hmac
import json
import sys
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rpt.monitor.store import FILENAME, TABLES, MetricsReader

STATIC = Path(__file__).parent / "static"


def plotly_js() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def create_app(run_dirs: list[Path], token: str | None = None) -> Starlette:
    runs = [Path(r) for r in run_dirs]
    assets = {"app.js": STATIC / "app.js", "style.css": STATIC / "style.css", "plotly.min.js": plotly_js()}

    def run_dir(request: Request) -> Path | None:
        index = request.path_params["run"]
        return runs[index] if 0 <= index < len(runs) else None

    no_run = PlainTextResponse("no such run", status_code=404)

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def asset(request: Request) -> Response:
        path = assets.get(request.path_params["name"])
        if path is None:
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(path)

    def list_runs(request: Request) -> Response:
        out = []
        for i, r in enumerate(runs):
            summary = r / "summary.json"
            meta = _meta(r)
            meta.pop("config", None)
            meta.pop("summary", None)
            out.append({"id": i, "name": r.name, "live": not summary.exists(), "meta": meta,
                        "summary": json.loads(summary.read_text()) if summary.exists() else None})
        return JSONResponse(out)

    def config(request: Request) -> Response:
        directory = run_dir(request)
        if directory is None:
            return no_run
        path = directory / "config.toml"
        return PlainTextResponse(path.read_text() if path.exists() else "")

    def rows(request: Request) -> Response:
        table = request.path_params["table"]
        if table not in TABLES:
            return PlainTextResponse("unknown table", status_code=404)
        try:
            after = int(request.query_params.get("after", "-1"))
        except ValueError:
            return PlainTextResponse("after must be an integer", status_code=400)
        directory = run_dir(request)
        if directory is None:
            return no_run
        if not (directory / FILENAME).exists():
            return JSONResponse([])
        reader = MetricsReader(directory)
        try:
            return JSONResponse(reader.rows(table, after))
        finally:
            reader.close()

    app = Starlette(routes=[
        Route("/", index),
        Route("/static/{name}", asset),
        Route("/api/runs", list_runs),
        Route("/api/runs/{run:int}/config", config),
        Route("/api/runs/{run:int}/{table}", rows),
    ])

    return _with_token(app, token) if token is not None else app


def _with_token(app, token: str):
    """`app` behind a token check on every HTTP request: ?token=, a bearer header, or the cookie that a page opened
    with ?token= sets, so that the page's own stylesheet, scripts and API calls carry it."""
    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            request = Request(scope, receive)
            cookie = f"rpt_monitor_{(scope.get('server') or ('', 0))[1]}"  # one per port: monitors side by side
            in_query = request.query_params.get("token")
            given = in_query or request.headers.get("authorization", "").removeprefix("Bearer ") or \
                request.cookies.get(cookie, "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                await PlainTextResponse("a token is required: open the address rpt monitor printed", 401)(
                    scope, receive, send)
                return
            if in_query:
                send = _setting_cookie(send, f"{cookie}={token}; Path=/; HttpOnly; SameSite=Strict")
        await app(scope, receive, send)

    return guarded


def _setting_cookie(send, value: str):
    """`send` with a Set-Cookie header added to the response's start."""
    async def with_cookie(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", value.encode())]}
        await send(message)
    return with_cookie


def _meta(run: Path) -> dict:
    if not (run / FILENAME).exists():
        return {}
    reader = MetricsReader(run)
    try:
        return reader.meta()
    finally:
        reader.close()


def serve(run_dirs: list[str], host: str, port: int, token: str | None) -> None:
    import socket

    import uvicorn

    from rpt.errors import RptError
    from rpt.net import open_warning

    missing = [r for r in run_dirs if not (Path(r) / "config.toml").is_file()]
    if missing:
        raise RptError(f"{missing[0]} is not a run directory (no config.toml)", "pass folders that `rpt train` wrote")
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise RptError(f"cannot listen on {host}:{port}: {exc.strerror}",
                           f"choose another port, e.g. --port {port + 1}, or stop what uses it") from None
    address = f"http://{host}:{port}/" + (f"?token={token}" if token else "")
    print(f"rpt monitor: {len(run_dirs)} run(s) at {address}  (Ctrl-C stops)", flush=True)
    warning = open_warning(host, token, "the dashboard")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    uvicorn.run(create_app([Path(r) for r in run_dirs], token), host=host, port=port, log_level="warning")
