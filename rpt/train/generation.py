"""`rpt generate`: a run's model streams a prompt's continuation as it is sampled (constant memory a token: the
recurrent state)."""

from __future__ import annotations

import codecs
import itertools
import sys

import torch

from rpt.data.text import not_utf8_at, shown
from rpt.errors import RptError
from rpt.models.loop_exit import Exit
from rpt.train.evaluate import check_depth
from rpt.train.run_dir import load_run


def generate_text(run_dir: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                  seed: int | None, checkpoint: str, device: str | None, out=None,
                  depth: int | None = None, exit: str | None = None, shared: bool = False) -> str:
    """Stream the prompt, then the generated text as it is sampled, to `out`; returns the generated text. `depth`:
    a looped model's iterations per token; `exit` ("kl:5e-4"): end them early, at most `depth` (4 x loop_mean by
    default); `shared`: keep one state for all iterations (rpt/models/loop_exit.py, docs/depth.md)."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    at = not_utf8_at(prompt)
    if at is not None:
        raise RptError(f"--prompt is not UTF-8 text: character {at + 1} is {shown(prompt[at])}",
                       "give the prompt as UTF-8 text (a terminal with a UTF-8 locale, e.g. LANG=C.UTF-8)")
    out = out or sys.stdout  # (the stream of the moment, not the one of the import)
    from rpt.data.tokenizer import eot_id, token_bytes
    from rpt import kernels
    from rpt.models.decoder import Decoder

    rule = Exit.parse(exit) if exit else None
    cfg, model, tokenizer, _, _ = load_run(run_dir, checkpoint, device)
    if (rule or shared) and not cfg.model.loop_core:
        raise RptError(f"{'--exit' if rule else '--shared-state'} for a model without a loop (model.loop_core = 0)",
                       "leave it out: only a looped model (docs/depth.md) has iterations to end or share")
    if rule is not None:
        rule.check(cfg.model)
    depth = check_depth(cfg.model, depth if depth is not None or rule is None else 4 * round(cfg.model.loop_mean))
    dev = next(model.parameters()).device
    ids = [eot_id(tokenizer)] + tokenizer.encode(prompt, add_special_tokens=False).ids  # a document starts with EOT
    table = token_bytes(tokenizer)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")  # whole characters only: a sampled token
    # may begin or end inside a character, and its lone bytes would print as U+FFFD
    generator = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    pieces = []
    picker = Decoder.on(model, kernels.current())  # on the CPU each step's one-row products, packed
    tokens = picker.generate(torch.tensor(ids, device=dev), max_new_tokens, temperature, top_k, top_p, generator,
                              reset_at=ids[0] if cfg.data.reset_at_documents else None, depth=depth, exit=rule,
                              shared=shared)
    first = next(tokens, None)  # the prompt's forward first: a first use's build message comes before any text
    out.write(prompt)
    for token in [] if first is None else itertools.chain([first], tokens):
        text = decoder.decode(table[token])
        if text:
            pieces.append(text)
            out.write(text)
            out.flush()
    tail = decoder.decode(b"", final=True)
    out.write(tail + "\n")
    if rule is not None:
        print(f"(--exit {exit}: {rule.mean_depth:.2f} iterations a token on average, at most {depth})",
              file=sys.stderr)
    return "".join(pieces) + tail


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """Refuse sampling settings that mean nothing, before the model is loaded."""
    if max_new_tokens < 0:
        raise RptError(f"--max-new-tokens {max_new_tokens} is negative", "e.g. --max-new-tokens 200")
    if not temperature >= 0:
        raise RptError(f"--temperature {temperature} is negative", "use 0 for the most likely token each time, "
                       "or a positive value such as 0.8 (higher: more varied text)")
    if top_k < 0:
        raise RptError(f"--top-k {top_k} is negative", "use 0 for no limit, or e.g. 50")
    if not 0 < top_p <= 1:
        raise RptError(f"--top-p {top_p} is outside (0, 1]", "it is a share of the probability mass: use e.g. 0.95, "
                       "or 1 for no limit")
