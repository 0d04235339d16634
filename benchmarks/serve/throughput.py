"""Benchmark: `rpt serve`'s throughput against one stream, against `rpt generate`, and against transformers'
`generate` on rpt's export batched with padding (issue 61's targets). The client is one process of asyncio streams
(httpx) on this machine; its own CPU share is reported, since it shares the cores with the server.

    .venv/bin/python benchmarks/serve/throughput.py --run runs/demo [--cases scaling,overhead,transformers]

- scaling: 1 and then 32 concurrent streams, prompts of 256 tokens, 128 new tokens each (end of text ignored), each
  --rounds times: aggregate tokens/s, the median round's (target: 32 streams >= 8x one), and time per output token
  at p99 over every round's gaps between tokens (<= 4x one stream's).
- overhead: one stream's tokens/s through the server against `rpt generate`'s (the model's `generate` with the
  one-row products, in this process) on the same prompt (target >= 0.9x).
- transformers: 32 requests of mixed lengths (prompts 16-512 tokens, max_tokens 16-256, drawn with --seed) to the
  server at once, against the same requests as one padded batch through transformers' `generate` on `rpt export`'s
  folder (what a user without rpt's server would run): aggregate useful tokens/s (target >= 3x).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import Served, run_cases  # noqa: E402


def prompt_texts(run: Path, lengths: list[int], seed: int) -> list[str]:
    """Texts of the run's validation split that encode to about these many tokens (decoded token runs)."""
    import numpy as np

    from rpt.config import Config
    from rpt.data.dataset import PreparedData
    from rpt.data.tokenizer import load_tokenizer

    cfg = Config.load(run / "config.toml")
    tokens = PreparedData(cfg.data.path).tokens("val")
    tok = load_tokenizer(run / "tokenizer.json")
    rng = np.random.default_rng(seed)
    texts = []
    for n in lengths:
        start = int(rng.integers(0, len(tokens) - n - 1))
        texts.append(tok.decode(tokens[start:start + n].tolist()))
    return texts


async def one(client, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion; the times of its chunks."""
    began = time.perf_counter()
    times, reason, usage, seen = [], None, None, 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            now = time.perf_counter()
            for c in chunk["choices"]:
                reason = c["finish_reason"] or reason
            if chunk["choices"] and usage:  # one time per token the chunk brought (its usage says how many)
                times += [now] * (usage["completion_tokens"] - seen)
                seen = usage["completion_tokens"]
    return {"began": began, "times": times, "reason": reason, "tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}


async def together(url: str, prompts: list[str], max_tokens: list[int]) -> dict:
    import httpx

    cpu = time.process_time()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        began = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, p, m) for p, m in zip(prompts, max_tokens)))
        wall = time.perf_counter() - began
    tokens = sum(r["tokens"] for r in results)
    gaps = []  # each token's time after the one before: a chunk of k tokens spreads its gap over them
    for r in results:
        arrivals = sorted(set(r["times"]))
        for a, b in zip(arrivals, arrivals[1:]):
            gaps += [(b - a) / r["times"].count(b)] * r["times"].count(b)
    decoding = max(r["times"][-1] for r in results) - min(r["times"][0] for r in results)
    return {"streams": len(prompts), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "decode_tokens_per_s": (tokens - len(results)) / decoding,  # from the first first token to the end
            **per_token(gaps), "gaps": gaps,
            "ttft_median_ms": 1000 * statistics.median(r["times"][0] - r["began"] for r in results),
            "client_cpu_share": (time.process_time() - cpu) / wall,
            "reasons": sorted({r["reason"] for r in results}),
            "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in results)}


def per_token(gaps: list[float]) -> dict:
    gaps = sorted(gaps)
    return {"tpot_p50_ms": 1000 * gaps[len(gaps) // 2], "tpot_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))]}


def rounds(url: str, prompts: list[str], max_tokens: list[int], n: int) -> dict:
    """`together` n times in turn: the round of median tokens/s, with the time per token over every round's gaps
    (one stream's 127 gaps alone put its p99 at the second-largest)."""
    runs = sorted((asyncio.run(together(url, prompts, max_tokens)) for _ in range(n)), key=lambda r: r["tokens_per_s"])
    gaps = [g for r in runs for g in r.pop("gaps")]
    return {**runs[n // 2], **per_token(gaps), "rounds": n, "gaps_pooled": len(gaps),
            "tokens_per_s_rounds": [r["tokens_per_s"] for r in runs]}


def scaling(run: Path, args) -> dict:
    served = Served(run, "--max-streams", "64")
    try:
        texts = prompt_texts(run, [256] * 32, args.seed)
        asyncio.run(together(served.url, texts[:2], [8, 8]))  # warm
        single = rounds(served.url, texts[:1], [128], args.rounds)
        many = rounds(served.url, texts, [128] * 32, args.rounds)
    finally:
        served.stop()
    return {"one": single, "thirty_two": many, "aggregate_ratio": many["tokens_per_s"] / single["tokens_per_s"],
            "decode_ratio": many["decode_tokens_per_s"] / single["decode_tokens_per_s"],
            "tpot_p99_ratio": many["tpot_p99_ms"] / single["tpot_p99_ms"]}


def generate_speed(run: Path, prompt: str, tokens: int) -> float:
    """`rpt generate`'s tokens/s after the prompt: the model's generate on the one-row products, as it runs them."""
    import torch

    from rpt import kernels
    from rpt.data.tokenizer import eot_id
    from rpt.models.decoder import Decoder
    from rpt.train.run_dir import load_run

    cfg, model, tok, _, _ = load_run(run, "best", "cpu")
    ids = [eot_id(tok)] + tok.encode(prompt, add_special_tokens=False).ids
    best = 0.0
    for _ in range(2):
        stream = Decoder.on(model, kernels.current()).generate(torch.tensor(ids), tokens, temperature=0, reset_at=None)
        next(stream)
        began = time.perf_counter()
        count = sum(1 for _ in stream)
        best = max(best, count / (time.perf_counter() - began))
    return best


def overhead(run: Path, args) -> dict:
    text = prompt_texts(run, [256], args.seed)[0]
    served = Served(run)
    try:
        asyncio.run(together(served.url, [text], [8]))
        rounds = [asyncio.run(together(served.url, [text], [256])) for _ in range(2)]
    finally:
        served.stop()
    server = max(r["tokens"] / (r["wall_s"] - r["ttft_median_ms"] / 1000) for r in rounds)  # after the first token
    local = generate_speed(run, text, 256)
    return {"server_tokens_per_s": server, "generate_tokens_per_s": local, "ratio": server / local}


def transformers_case(run: Path, args) -> dict:
    import numpy as np
    import torch

    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(16, 513, 32).tolist()
    max_tokens = rng.integers(16, 257, 32).tolist()
    texts = prompt_texts(run, lengths, args.seed)
    served = Served(run, "--max-streams", "64")
    try:
        asyncio.run(together(served.url, texts[:2], [4, 4]))
        ours = asyncio.run(together(served.url, texts, max_tokens))
        ours.pop("gaps")
    finally:
        served.stop()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as out:
        from rpt.export.hf_export import export_run

        export_run(str(run), out, "best", "2GB", True)
        model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        batch = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            model.generate(**tok(texts[:2], return_tensors="pt", padding=True), max_new_tokens=2, do_sample=False)
            began = time.perf_counter()
            model.generate(**batch, max_new_tokens=max(max_tokens), do_sample=False, min_new_tokens=max(max_tokens))
            wall = time.perf_counter() - began
    useful = sum(max_tokens)  # what the 32 requests asked for; the batch runs every row to the longest
    theirs = {"wall_s": wall, "tokens_per_s": useful / wall, "padded_to": int(batch["input_ids"].shape[1]),
              "steps": max(max_tokens)}
    return {"rpt_serve": ours, "transformers": theirs, "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"]}


CASES = {"scaling": scaling, "overhead": overhead, "transformers": transformers_case}


def main() -> None:
    run_cases(__doc__, CASES, lambda p: p.add_argument(
        "--rounds", type=int, default=3, help="scaling: each of its runs this many times in turn (the median's rate)"))


if __name__ == "__main__":
    sys.exit(main())
