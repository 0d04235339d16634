"""The server-sent events of one request (rpt/serve/api.py's Answer.events), fed events by hand as the outbox hands
them out: a stream's events of one turn go out as one chunk (its texts joined, its last finish reason, the usage as
of its last token), and what a client joins from the chunks is what the engine produced."""

from __future__ import annotations

import asyncio
import json
import threading

from rpt.serve.api import Answer, Completion
from rpt.serve.engine import Sampling, Stream


class Scheduler:
    def __init__(self):
        self.cancelled = []

    def cancel(self, stream):
        self.cancelled.append(stream.id)


def chunks_of(turns: list[list[tuple[int, str, str | None, int]]]) -> tuple[list[list[dict]], list[int]]:
    """Each turn's written events as parsed chunks, for two streams fed `turns` of (stream, text, finish, tokens)."""
    streams = [Stream([0, 1], Sampling(max_tokens=8), lambda *a: None) for _ in range(2)]
    job = Completion(prompts=[[0, 1]], n=2, stream=True, include_usage=True, continuous_usage=True,
                     settings=[Sampling(max_tokens=8)] * 2)
    scheduler = Scheduler()

    async def main():
        queue = asyncio.Queue()
        answer = Answer(job, streams, queue, scheduler, "m")
        events, written = answer.events(), []
        for turn in turns:
            for i, text, finish, tokens in turn:
                if finish is not None:
                    streams[i].finish_reason = finish
                queue.put_nowait((streams[i], text, finish, tokens))
            written.append(await events.__anext__())
        written += [e async for e in events]
        return written

    written = asyncio.run(main())
    assert len(written) == len(turns) and written[-1].endswith("data: [DONE]\n\n")  # one write per turn, the end too
    parsed = [[json.loads(line[6:]) for line in w.split("\n\n") if line.startswith("data: {")] for w in written]
    return parsed, scheduler.cancelled


def test_a_streams_events_of_one_turn_go_out_as_one_chunk_with_the_usage_of_its_last_token():
    turns = [[(0, "Hel", None, 1), (1, "A", None, 1), (0, "lo", None, 2), (0, "", None, 3), (1, "B", None, 2)],
             [(0, " wo", None, 4), (0, "rld", "length", 5), (1, "", None, 3)],
             [(1, "C", "stop", 4)]]
    parsed, cancelled = chunks_of(turns)
    first, second, third = parsed[:3]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["usage"]["completion_tokens"]) for c in first] \
        == [(0, "Hello", 3), (1, "AB", 5)]  # stream 0's third token (no whole character yet) counted with its text
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in second] == [(" world", "length")]
    assert third[0]["choices"][0] == {"text": "C", "index": 1, "logprobs": None, "finish_reason": "stop"}
    assert third[0]["usage"]["completion_tokens"] == 9  # 5 + 4: stream 1's tokenless event of turn 2 counted too
    usage_chunk = third[1]  # the usage goes out with the last chunk
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 9
    assert cancelled == []  # both ended: nothing left to cancel


def test_the_outbox_hands_out_a_streams_last_event_at_once_and_the_rest_at_its_tick():
    """Outbox (the engine's thread to the event loop): events posted while a tick is pending wait for it, but a
    stream's last event (`now`) goes out at once, with whatever waited beside it."""
    from rpt.serve.api import Outbox

    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        outbox.TICK = outbox.LONGEST = 30.0  # a tick that would outlast the test
        queue = asyncio.Queue()
        outbox.post(queue, "first")
        assert await asyncio.wait_for(queue.get(), 5) == "first"  # the first event starts the ticking at once
        outbox.post(queue, "token")
        await asyncio.sleep(0.05)
        assert queue.empty()  # held for the next tick
        thread = threading.Thread(target=outbox.post, args=(queue, "last"), kwargs={"now": True})
        thread.start()
        thread.join()
        got = [await asyncio.wait_for(queue.get(), 5), await asyncio.wait_for(queue.get(), 5)]
        assert got == ["token", "last"]
        outbox.task.cancel()

    asyncio.run(main())
