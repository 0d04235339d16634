"""The step cost of the full softmax against the two-level one (model.head_shortlist), on a prepared corpus's tokens.

    .venv/bin/python benchmarks/quality/head.py --data DIR [--sizes 256,384] [--shortlists 0,1024] [--steps 10]

For each lstm 2 x d and shortlist, the milliseconds of one training step (forward, backward, SGD with momentum)
on 16 x 64 real training tokens, in one process; the last line gives each shortlist's speed-up over the full head.
The shortlist is assigned from the training split's token counts, as a run does.
"""

from __future__ import annotations

import argparse
import time

import torch

from rpt.config import ModelConfig
from rpt.data.dataset import PreparedData
from rpt.models import RecurrentLM
from rpt.data.dataset import token_counts


def step_ms(d: int, shortlist: int, x: torch.Tensor, counts, vocab: int, steps: int) -> float:
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(vocab_size=vocab, d_model=d, n_layers=2, head_shortlist=shortlist))
    if shortlist:
        model.head.assign(counts)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k in range(steps + 3):
        if k == 3:
            began = time.perf_counter()
        nats, _ = model(x[:, :-1], targets=x[:, 1:])
        nats.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - began) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--sizes", default="256,384")
    parser.add_argument("--shortlists", default="0,1024")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    data = PreparedData(args.data)
    train = data.tokens("train")
    counts = token_counts(train, data.vocab_size)
    x = torch.from_numpy(train[:16 * 65].astype("int64")).view(16, 65)
    shortlists = [int(s) for s in args.shortlists.split(",")]
    for S in shortlists:
        if S:
            share = counts[counts.argsort()[::-1][:S]].sum() / counts.sum()
            print(f"shortlist {S:,}: {share:.1%} of the training tokens")
    ratios = []
    for d in (int(s) for s in args.sizes.split(",")):
        times = {S: step_ms(d, S, x, counts, data.vocab_size, args.steps) for S in shortlists}
        for S, ms in times.items():
            print(f"lstm 2 x {d}  shortlist {S:>5}  {ms:7.1f} ms a step  {16 * 64 / ms * 1000:8,.0f} tokens/s",
                  flush=True)
        ratios += [f"2 x {d} shortlist {S}: {times[0] / ms:.2f}x" for S, ms in times.items() if S and 0 in times]
    print("speed-up over the full head: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
