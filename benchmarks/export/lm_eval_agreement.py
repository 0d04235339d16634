"""lm-evaluation-harness against rpt on the same documents: bits per byte of a run's validation documents, scored
by lm-eval's `hf` model on the run's export and by rpt's own forward.

    .venv/bin/python benchmarks/export/lm_eval_agreement.py RUN_DIR [--docs 20] [--max-length 2048]

The first --docs documents of the run's validation split are decoded to text and written as a local lm-eval task
(`loglikelihood_rolling`, one request per document, as wikitext's perplexity task does; max_length set above the
longest document, so lm-eval reads each in one window as rpt does; --max-length 2048, lm-eval's default, shows what
its windows, each read from a fresh state, cost a recurrent model). rpt scores the same texts with its fast path:
the tokens lm-eval's tokenizer gives each, after the end-of-text token, in one forward. Printed: both figures, their
difference, and the wall time of each (lm-eval's includes its request building; the export's forward runs the
reference forms of the cells).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import torch

from rpt.data.dataset import PreparedData
from rpt.export.hf_export import export_run
from rpt.train.run_dir import load_run

TASK = """task: rpt_val_docs
dataset_path: json
dataset_kwargs:
  data_files:
    test: {file}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


def val_documents(data: PreparedData, tokenizer, count: int) -> list[str]:
    """The first `count` whole documents of the validation split, as text (each starts after an end-of-text)."""
    tokens = np.asarray(data.tokens("val"))
    starts = np.flatnonzero(tokens == data.eot_id)
    texts = []
    for a, b in zip(starts, list(starts[1:]) + [len(tokens)]):
        text = tokenizer.decode(tokens[a + 1:b].tolist(), skip_special_tokens=False)
        if text.strip():
            texts.append(text)
        if len(texts) == count:
            break
    return texts


def rpt_bits_per_byte(model, tokenizer, texts: list[str], eot: int) -> float:
    nats = 0.0
    with torch.no_grad():
        for text in texts:
            x = torch.tensor([eot] + tokenizer.encode(text, add_special_tokens=False).ids)[None]
            loss, _ = model(x[:, :-1], reset_mask=x[:, :-1] == eot, targets=x[:, 1:])
            nats += float(loss.double().sum())
    return nats / sum(len(t.encode()) for t in texts) / math.log(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-length", type=int, help="lm-eval's window (default: above the longest document)")
    args = parser.parse_args()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    cfg, model, tokenizer, *_ = load_run(args.run_dir, "best", "cpu")
    data = PreparedData(cfg.data.path)
    eot = data.eot_id
    texts = val_documents(data, tokenizer, args.docs)
    longest = max(len(tokenizer.encode(t, add_special_tokens=False).ids) for t in texts)
    print(f"{len(texts)} validation documents, {sum(len(t.encode()) for t in texts):,} bytes, the longest "
          f"{longest:,} tokens; model {cfg.model.n_layers} x {cfg.model.d_model} {cfg.model.cell}")
    began = time.perf_counter()
    ours = rpt_bits_per_byte(model, tokenizer, texts, eot)
    rpt_seconds = time.perf_counter() - began
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        export_run(args.run_dir, tmp / "hf")
        (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        (tmp / "task.yaml").write_text(TASK.format(file=tmp / "docs.jsonl"))
        began = time.perf_counter()
        results = simple_evaluate(model="hf", model_args=f"pretrained={tmp / 'hf'},trust_remote_code=True,"
                                  f"dtype=float32,max_length={args.max_length or longest + 16}", tasks=["rpt_val_docs"],
                                  task_manager=TaskManager(include_path=str(tmp)), batch_size=args.batch_size,
                                  device="cpu")
        lm_eval_seconds = time.perf_counter() - began
    theirs = results["results"]["rpt_val_docs"]["bits_per_byte,none"]
    print(f"bits per byte: lm-eval {theirs:.6f}, rpt {ours:.6f}, difference {theirs - ours:+.2e}")
    print(f"wall: lm-eval {lm_eval_seconds:.1f} s (export's reference forward), rpt {rpt_seconds:.1f} s")


if __name__ == "__main__":
    main()
