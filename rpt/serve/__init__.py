"""`rpt serve`: an OpenAI-compatible server that generates many streams as one batch, each at constant memory.

    api.py        the HTTP face (Starlette): routes, request checks, OpenAI-shaped answers and errors
    scheduler.py  admission (a bounded queue before --max-streams), the engine's loop, draining
    engine.py     the batch: prefill, one token per running row per step, rows joining and leaving
    metrics.py    the Prometheus figures /metrics serves
    server.py     `rpt serve`: all of it put together, the memory it states, SIGTERM
"""
