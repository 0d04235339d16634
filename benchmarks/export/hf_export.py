"""rpt against its own export in Hugging Face transformers, per cell: logits, scoring speed, generation, memory.

    .venv/bin/python benchmarks/export/hf_export.py --data DIR [--cells lstm,gru,modlstm,mingru,minlstm] [--d-model 256]
                                          [--set model.attention_every=2 ...]

For each cell, an n_layers x d_model model (fresh weights, seed 0) is exported with `rpt export`'s own code and
loaded with AutoModelForCausalLM (trust_remote_code). On B x T tokens of the data's validation split: the largest
|logit difference| (fp32), and forward tokens/s of rpt's fast path against the export's reference forms (what
lm-eval's log-likelihood requests run). Then greedy generation from a 32-token prompt, rpt's `generate` against
transformers' `generate` (tokens/s, whether the tokens agree) and the size of transformers' cache after 16 and
after --new tokens (constant when the recurrent state is the cache).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from rpt.data.dataset import PreparedData
from rpt import kernels
from rpt.export.hf_export import export_model
from rpt.models.decoder import Decoder
from rpt.models import RecurrentLM


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (the native loops' first call, transformers' first generate)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def cache_numel(cache) -> int:
    def walk(s):
        if isinstance(s, torch.Tensor):
            return s.numel()
        return sum(walk(t) for t in s) if isinstance(s, (list, tuple)) else 0
    return walk(cache.blocks)


def one_cell(cell: str, args, data: PreparedData, tmp: Path) -> dict:
    import transformers

    from rpt.config import Config

    cfg = Config.load(None, [f"data.path={args.data}", f"model.cell={cell}", f"model.d_model={args.d_model}",
                             f"model.n_layers={args.n_layers}", f"model.vocab_size={data.vocab_size}", *args.set])
    torch.manual_seed(0)
    model = RecurrentLM(cfg.model).eval()
    folder = tmp / cell
    export_model(cfg, model, Path(args.data) / "tokenizer.json", folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    hf.generation_config.eos_token_id = None  # no stop at the end-of-text token: rpt generate has none either
    val = torch.from_numpy(data.tokens("val")[:args.batch * args.seq].astype("int64")).view(args.batch, args.seq)
    val[:, 0] = data.eot_id  # rows that start documents: the export reads every fresh row as one
    with torch.no_grad():
        ours, _ = model(val, reset_mask=val == data.eot_id)
        theirs = hf(val).logits
        diff = (ours - theirs).abs().max().item()
        t_rpt = best_seconds(lambda: model(val, reset_mask=val == data.eot_id), args.repeats)
        t_hf = best_seconds(lambda: hf(val), args.repeats)
    prompt = val[0, 1:33]  # the first 32 tokens of a document; rpt generate reads it after the end-of-text token,
    assert data.eot_id not in prompt  # the export starts every fresh row as a document
    as_document = torch.cat([torch.tensor([data.eot_id]), prompt])
    new = args.new
    ours_gen: list[int] = []

    def rpt_generate():  # as `rpt generate` runs it: on the CPU, the one-row products of rpt.kernels
        ours_gen[:] = list(Decoder.on(model, kernels.current()).generate(as_document, new, temperature=0,
                                                                         reset_at=data.eot_id))

    out = {}

    def hf_generate():
        out["r"] = hf.generate(prompt[None], max_new_tokens=new, do_sample=False,
                               return_dict_in_generate=True, output_logits=True, pad_token_id=0)

    g_rpt = best_seconds(rpt_generate, 1)
    g_hf = best_seconds(hf_generate, 1)
    theirs_gen = out["r"].sequences[0, 32:].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(ours_gen, theirs_gen)) if a != b), len(ours_gen))
    # where they part: how far apart transformers' two best logits were (a near-tie that 1e-6 can turn)
    margin = (lambda top: float(top[0] - top[1]))(out["r"].logits[agree][0].topk(2).values) if agree < new else None
    short = hf.generate(prompt[None], max_new_tokens=16, do_sample=False,
                        return_dict_in_generate=True, pad_token_id=0)
    return {"cell": cell, "params": sum(p.numel() for p in model.parameters()), "max_logit_diff": diff,
            "score_rpt": args.batch * args.seq / t_rpt, "score_hf": args.batch * args.seq / t_hf,
            "gen_rpt": new / g_rpt, "gen_hf": new / g_hf, "agree": agree, "margin": margin,
            "cache_short": cache_numel(short.cache), "cache_long": cache_numel(out["r"].cache)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a folder rpt prepare wrote (its tokenizer and val split)")
    parser.add_argument("--cells", default="lstm,gru,modlstm,mingru,minlstm")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--new", type=int, default=200, help="tokens to generate")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], help="a model setting, e.g. model.attention_every=2")
    args = parser.parse_args()
    data = PreparedData(args.data)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.n_layers} x {args.d_model} "
          f"{' '.join(args.set)}, "
          f"vocabulary {data.vocab_size:,}; scoring {args.batch} x {args.seq} tokens, generating {args.new}")
    print(f"{'cell':8} {'params':>10} {'max |dlogit|':>12} {'score rpt':>10} {'score hf':>9} {'hf/rpt':>6} "
          f"{'gen rpt':>8} {'gen hf':>7} {'hf/rpt':>6} {'same tokens':>11} {'cache 16 -> N':>17}")
    with tempfile.TemporaryDirectory() as tmp:
        for cell in args.cells.split(","):
            r = one_cell(cell, args, data, Path(tmp))
            print(f"{r['cell']:8} {r['params']:>10,} {r['max_logit_diff']:>12.2e} {r['score_rpt']:>10,.0f} "
                  f"{r['score_hf']:>9,.0f} {r['score_hf'] / r['score_rpt']:>6.2f} {r['gen_rpt']:>8,.0f} "
                  f"{r['gen_hf']:>7,.0f} {r['gen_hf'] / r['gen_rpt']:>6.2f} {r['agree']:>5}/{args.new:<5} "
                  f"{r['cache_short']:>8,} -> {r['cache_long']:,}"
                  + (f"  (parted at a margin of {r['margin']:.1e})" if r["margin"] is not None else ""), flush=True)


if __name__ == "__main__":
    main()
