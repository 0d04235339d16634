"""rpt against two published peers (../shared/peers: nanoGPT, pytorch/examples' word_language_model), trained for
the same wall time on the same training text and scored in bits per UTF-8 byte on the same held-out text (issue 22).

    .venv/bin/python benchmarks/quality/peers.py [--cases shakespeare-130,shakespeare-600,stdlib-300,stdlib-600,prose-600]
                                         [--peers nanogpt,gpt,wlm,rpt] [--work DIR]
                                         [--vocab-size N] [--rpt-set KEY=VALUE ...]   (ablations)
                                         [--gpt-sizes 4x128x64,...]                   (the gpt peer's sizes)

Cases: tiny-shakespeare with its last 10% of characters held out (as nanoGPT's prepare.py does; the file is ASCII,
so characters are bytes), for 130 s and 600 s; the embedded default corpus (the Python standard library, split by
rpt's document hash) for 300 s and 600 s, without word_language_model (a whitespace vocabulary does not fit source
code); English prose, the prose of Python's documentation (`prose_text`: the tutorial, HOWTOs, FAQ and language
reference of Debian's python3.11-doc, their reStructuredText sources with code, directives and markup removed:
about 0.93 MB, 150K words), its last 10% held out, for 600 s. Issue 44 is judged by shakespeare-600 and the stdlib.

How each is run, never changing its code (each in a copy, since both write beside their code):
  gpt                    nanoGPT as a transformer of the same budget on rpt's own token files (rpt prepare's
                         byte-level BPE: the same tokens, which are nanoGPT's format, flat uint16):
                         config/train_shakespeare_char.py (AdamW 1e-3 decaying to 1e-4 over the run, beta2 0.99,
                         no gradient accumulation) with 50 warm-up iterations, no dropout, batch 12, at each of
                         GPT_SIZES (or --gpt-sizes; layers x width / block; from 1,200 s LARGE_GPT too), its
                         iterations fitted to the budget from a timing run as below; the best size counts. Its
                         best vocabulary at these budgets is 8,192 (`--vocab-size 8192 --peers gpt`: the same hash
                         split, so the same validation bytes), not rpt's 32,768. `--cases scaling`: the stdlib at
                         150, 300, 600 and 1,200 s, the points for benchmarks/quality/scaling.py.
                         Its score: the checkpoint it kept (the best of its own validations) over the whole held-out
                         split, sliding windows of its block at a stride of half a block, each token scored once.
  nanoGPT                its README's CPU recipe (config/train_shakespeare_char.py + the README's flags), on a
                         character vocabulary of the case's text; `max_iters` = `lr_decay_iters` set from a 30-step
                         timing so that the run fills the budget (a multiple of its eval_interval, so the last step
                         is evaluated; run once more, refitted, when its wall missed the budget by over 15%). Its
                         score: the best validation loss it printed (it keeps that checkpoint), an estimate from its
                         eval_iters = 20 random windows of 64 characters.
  word_language_model    its defaults, train.txt = the training text, valid.txt = test.txt = the held-out text (so it
                         selects and anneals on the held-out text, as it does on its own test file); `--epochs` set
                         from a one-epoch run so that the run fills the budget. Its score: the printed test loss.
  rpt                    `rpt prepare` with its defaults, then `rpt train --set data.path=D --set train.max_time=S`
                         and nothing else. Its score: summary.json's final validation bpb over the whole split.
                         For tiny-shakespeare rpt's own tail split starts at the first token boundary after 90% of
                         the bytes: the same held-out text but for its first few bytes.

Each peer's loss in nats per token becomes bits per byte with its own token count on the held-out text:
bpb = loss x tokens / bytes / ln 2 (tokens: characters for nanoGPT; words and one <eos> per line for
word_language_model). Walls are whole processes, start-up and evaluations included. Training FLOPs, where known:
rpt's summary.json's flops_per_token (already the training count: 3 x its model's forward products a token, an
mlstm's chunkwise products counted at its chunk size; tests/models/test_flops.py holds it to torch's counter) x
the tokens it trained; the gpt peer's by nanoGPT's own count (`gpt_flops_per_token`).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness.py
from harness import REPO, rpt_train  # noqa: E402
SHARED = REPO.parent / "shared"
PEERS = SHARED / "peers"
SHAKESPEARE = SHARED / "data" / "tinyshakespeare" / "input.txt"
NANOGPT_FLAGS = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
                 "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0"]
NANOGPT_EVAL_INTERVAL = 250  # config/train_shakespeare_char.py's
GPT_SIZES = ((4, 128, 64), (4, 192, 128), (6, 256, 128))  # layers, width, block: the three
LARGE_GPT = (8, 384, 256)  # and from LARGE_BUDGET s, one more: the peer's sizes grow with its budget (issue 59)
LARGE_BUDGET = 1200
SCALING = ("stdlib-150", "stdlib-300", "stdlib-600", "stdlib-1200")  # --cases scaling: the curve's budgets
DOCS = Path("/usr/share/doc/python3.11/html/_sources")  # Debian's python3.11-doc


# ------------------------------------------------------------------ conversions (tested in tests/test_benchmark_peers.py)
def bits_per_byte(loss_nats_per_token: float, tokens: int, n_bytes: int) -> float:
    """A loss in nats per token over `tokens` tokens of a text of `n_bytes` UTF-8 bytes, in bits per byte."""
    return loss_nats_per_token * tokens / n_bytes / math.log(2)


def word_tokens(path: Path) -> int:
    """word_language_model's token count of a file: its whitespace words plus one <eos> per line, reading the
    file as it does (text mode, UTF-8, universal newlines)."""
    with open(path, encoding="utf8") as f:
        return sum(len(line.split()) + 1 for line in f)


def char_tokens(text: str) -> int:
    """nanoGPT's character-level token count."""
    return len(text)


def nanogpt_best_val(log: str) -> float:
    """The best of the validation losses nanoGPT printed ('step N: train loss A, val loss B')."""
    losses = [float(v) for v in re.findall(r"step \d+: train loss [\d.]+, val loss ([\d.]+)", log)]
    if not losses:
        raise RuntimeError("nanoGPT printed no evaluation:\n" + log[-2000:])
    return min(losses)


def wlm_test_loss(log: str) -> float:
    """word_language_model's test loss from its last line, via the perplexity (printed with more digits)."""
    found = re.findall(r"End of training \| test loss\s+[\d.]+ \| test ppl\s+([\d.]+)", log)
    if not found:
        raise RuntimeError("word_language_model printed no test loss:\n" + log[-2000:])
    return math.log(float(found[-1]))


# ------------------------------------------------------------------ cases
@dataclass
class Case:
    name: str
    corpus: str  # "shakespeare" or "stdlib"
    seconds: int


CASES = {c.name: c for c in (Case("shakespeare-130", "shakespeare", 130), Case("shakespeare-600", "shakespeare", 600),
                             Case("stdlib-300", "stdlib", 300), Case("stdlib-600", "stdlib", 600),
                             Case("prose-600", "prose", 600),
                             # the scaling curve's other budgets (issue 59), and a data-limited one at twice 600 s
                             Case("stdlib-150", "stdlib", 150), Case("stdlib-1200", "stdlib", 1200),
                             Case("shakespeare-1200", "shakespeare", 1200),
                             Case("shakespeare-300", "shakespeare", 300))}  # gdn's budgets (issue 71)
ENGLISH = ("shakespeare", "prose")  # the corpora word_language_model's whitespace vocabulary fits


# ------------------------------------------------------------------ the prose corpus
ROLE = re.compile(r":[\w:+-]+:`(~?)([^`<]*?)(?:\s*<[^>]*>)?`")


def rst_prose(text: str) -> str:
    """The prose of a reStructuredText file: directives, comments, literal blocks, interactive examples, tables and
    heading underlines left out; roles, literals and links reduced to their text."""
    out, skip = [], None  # skip: the indent of a block being left out
    for line in text.splitlines():
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if skip is not None:
            if not stripped or indent > skip:
                continue
            skip = None
            if out and out[-1]:
                out.append("")  # the blank line that ended the block left out
        if stripped == ".." or stripped.startswith(".. "):
            skip = indent
            continue
        if re.fullmatch(r"([=\-~^*#+`'\"])\1{2,}", stripped) or stripped.startswith(("+--", "+==", "|", ">>>", "...")):
            continue
        if stripped.endswith("::"):  # a literal block follows
            skip = indent
            stripped = stripped[:-2].rstrip()
            if not stripped:
                continue
            stripped += ":"
        stripped = ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), stripped)
        stripped = re.sub(r"``([^`]*)``", r"\1", stripped)
        out.append(re.sub(r"`([^`<]*?)(?:\s*<[^>]*>)?`_{1,2}", r"\1", stripped))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def prose_text() -> str:
    """English prose: Python's documentation (tutorial, HOWTOs, FAQ, language reference), as prose."""
    if not DOCS.is_dir():
        raise SystemExit(f"{DOCS} is missing: the prose case reads Debian's python3.11-doc "
                         "(apt-get install python3.11-doc)")
    files = [f for part in ("tutorial", "howto", "faq", "reference") for f in sorted((DOCS / part).glob("*.rst.txt"))]
    return "\n".join(rst_prose(f.read_text(encoding="utf8")) for f in files)


def run(cmd: list[str], cwd: Path, log: Path) -> tuple[str, float]:
    """Run a process to its end; its output goes to `log`; returns (output, wall seconds)."""
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - began
    log.write_text(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}); see {log}:\n{done.stdout[-3000:]}")
    return done.stdout, wall


def prepare_rpt(case: Case, work: Path, vocab_size: str = "auto") -> tuple[Path, str, str, int]:
    """rpt's prepared folder (`rpt prepare`'s defaults, but for `vocab_size` in an ablation) and the (train,
    held-out) texts the peers get, with the held-out bytes."""
    data = work / f"rpt-{case.corpus}" if vocab_size == "auto" else work / f"rpt-{case.corpus}-v{vocab_size}"
    if case.corpus in ENGLISH:
        source = SHAKESPEARE
        if case.corpus == "prose":
            source = work / "prose.txt"
            source.write_text(prose_text(), encoding="utf8")
        cmd = [sys.executable, "-m", "rpt", "prepare", "--input", str(source), "--out", str(data),
               "--vocab-size", vocab_size]
        text = source.read_text(encoding="utf8")
        cut = int(len(text) * 0.9)
        train, held_out = text[:cut], text[cut:]
    else:
        cmd = [sys.executable, "-m", "rpt", "prepare", "--out", str(data), "--vocab-size", vocab_size]
    if not (data / "meta.json").exists():
        run(cmd, REPO, work / f"prepare-{case.corpus}.log")
    meta = json.loads((data / "meta.json").read_text())
    if case.corpus == "stdlib":  # the peers get rpt's own split, decoded (byte-level BPE is lossless)
        train, held_out = (decode_split(data, meta, split) for split in ("train", "val"))
    return data, train, held_out, meta["splits"]["val"]["bytes"]


def decode_split(data: Path, meta: dict, split: str) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    ids = np.fromfile(data / meta["splits"][split]["file"], dtype=meta["dtype"])
    cuts = np.flatnonzero(ids == meta["eot_id"])
    docs = np.split(ids, cuts)
    return "\n".join(tok.decode(d[d != meta["eot_id"]].tolist()) for d in docs if len(d))


def run_rpt(case: Case, data: Path, work: Path, sets: list[str] = ()) -> dict:
    """`rpt train` with the data and the time only; `sets`: more --set KEY=VALUE, for an ablation."""
    tag = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"rpt-{case.name}" + "".join(f"-{s}" for s in sets))  # (a path's /)
    run_dir = work / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    began = time.perf_counter()
    done = rpt_train(run_dir, [f"data.path={data}", f"train.max_time={case.seconds}", *sets])
    wall = time.perf_counter() - began
    (work / f"{tag}.log").write_text(done.stdout + done.stderr)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"peer": "rpt (default recipe)" + "".join(f" {s}" for s in sets), "wall_s": wall,
            "bpb": summary["val_bpb"], "summary": summary,
            "train_flops": summary["flops_per_token"] * summary["tokens"],  # (forward and backward already)
            "detail": f"{summary['steps']} steps, ended by {summary['ended_by']}"}


def run_nanogpt(case: Case, train: str, held_out: str, held_bytes: int, work: Path) -> dict:
    home = work / f"nanogpt-{case.name}"
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(PEERS / "nanoGPT", home)
    chars = sorted(set(train + held_out))  # as its prepare.py: one vocabulary over the whole text
    stoi = {c: i for i, c in enumerate(chars)}
    folder = home / "data" / "rpt_case"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("val", held_out)):
        np.array([stoi[c] for c in text], dtype=np.uint16).tofile(folder / f"{name}.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)

    log, wall, iters = fit_nanogpt(case, home, work, f"nanogpt-{case.name}", [*NANOGPT_FLAGS, "--dataset=rpt_case"])
    loss = nanogpt_best_val(log)
    return {"peer": "nanoGPT (char, CPU recipe)", "wall_s": wall, "loss": loss, "detail": f"{iters} iterations",
            "bpb": bits_per_byte(loss, char_tokens(held_out), held_bytes)}


SCORE_GPT = """
import sys, numpy as np, torch
from model import GPT, GPTConfig
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
model = GPT(GPTConfig(**ckpt["model_args"]))
model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
model.eval()
val = torch.from_numpy(np.fromfile(sys.argv[2], dtype=np.uint16).astype(np.int64))
N, B = len(val), model.config.block_size
starts = list(range(0, N - B, B // 2))
if starts[-1] + B < N - 1:
    starts.append(N - 1 - B)
done, nats, scored, batch = 0, 0.0, 0, []  # done: targets 1..done are scored
def flush():
    global nats, scored, batch
    x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
    with torch.no_grad():
        _, loss = model(x, y)
    n = int((y >= 0).sum())
    nats, scored, batch = nats + float(loss) * n, scored + n, []
for s in starts:  # each window predicts targets s+1 .. s+B; the ones an earlier window scored are left out
    y = val[s + 1:s + B + 1].clone()
    y[:max(0, done - s)] = -1
    done = s + B
    batch.append((val[s:s + B], y))
    if len(batch) == 16:
        flush()
if batch:
    flush()
print(f"scored {scored} tokens, nats {nats!r}")
"""


GPT_BATCH = 12  # the gpt peer's rows an iteration (its flags), one micro-batch (the config's accumulation is 1)


def gpt_flops_per_token(layers: int, width: int, block: int, vocab: int) -> int:
    """Training FLOPs a token of the gpt peer by nanoGPT's own count (model.py's estimate_mfu): 6 x its parameters
    but the position embeddings (bias-free, the head tied to the token embedding) + 12 x layers x width x block for
    attention."""
    params = vocab * width + layers * (12 * width * width + 2 * width) + width
    return 6 * params + 12 * layers * width * block


# nanoGPT's train.py runs no autocast on a CPU; the bf16 rows change this one line of its copy (and pass
# --dtype=bfloat16), so that its products run in bf16 as on a GPU
NANOGPT_CPU_CTX = "ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)"
NANOGPT_BF16_CTX = "ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype)  # rpt's benchmark: bf16 on the CPU too"


def run_gpt(case: Case, data: Path, work: Path, sizes=GPT_SIZES, precision: str = "fp32") -> dict:
    """nanoGPT on rpt's token files at each of `sizes` for the whole budget; the best size's result. `precision`
    bf16: its train.py changed to autocast on the CPU in bf16 (NANOGPT_BF16_CTX)."""
    meta = json.loads((data / "meta.json").read_text())
    if meta["dtype"] != "uint16" or any("shards" in meta["splits"][s] for s in ("train", "val")):
        raise SystemExit("the gpt peer reads one uint16 token file per split (rpt prepare's default)")
    results = []
    for layers, width, block in sizes:
        tag = f"{layers}x{width}-b{block}" + ("-bf16" if precision == "bf16" else "")
        home = work / f"gpt-{case.name}-{tag}"
        shutil.rmtree(home, ignore_errors=True)
        shutil.copytree(PEERS / "nanoGPT", home)
        if precision == "bf16":
            script = (home / "train.py").read_text()
            if NANOGPT_CPU_CTX not in script:
                raise SystemExit("nanoGPT's train.py no longer has the line the bf16 rows change: " + NANOGPT_CPU_CTX)
            (home / "train.py").write_text(script.replace(NANOGPT_CPU_CTX, NANOGPT_BF16_CTX))
        folder = home / "data" / "rpt_tokens"
        folder.mkdir(parents=True)
        for split in ("train", "val"):
            shutil.copyfile(data / meta["splits"][split]["file"], folder / f"{split}.bin")
        with open(folder / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": meta["vocab_size"]}, f)
        flags = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", f"--block_size={block}",
                 f"--batch_size={GPT_BATCH}", f"--n_layer={layers}", "--n_head=4", f"--n_embd={width}", "--dropout=0.0",
                 "--warmup_iters=50", "--dataset=rpt_tokens", *(["--dtype=bfloat16"] if precision == "bf16" else [])]
        log, wall, iters = fit_nanogpt(case, home, work, f"gpt-{case.name}-{tag}", flags)
        kept = next(p for p in (home / "out-rerun" / "ckpt.pt", home / "out-run" / "ckpt.pt") if p.exists())
        scored = run([sys.executable, "-c", SCORE_GPT, str(kept), str(folder / "val.bin")], home,
                     work / f"gpt-{case.name}-{tag}-score.log")[0]
        tokens, nats = re.findall(r"scored (\d+) tokens, nats ([\d.e+-]+)", scored)[-1]
        results.append({"peer": f"nanoGPT {tag} (rpt's BPE tokens)", "vocab": meta["vocab_size"], "wall_s": wall,
                        "loss": float(nats) / int(tokens),
                        "detail": f"{iters} iterations", "bpb": float(nats) / meta["splits"]["val"]["bytes"] / math.log(2),
                        "train_flops": gpt_flops_per_token(layers, width, block, meta["vocab_size"]) *
                        iters * GPT_BATCH * block})
        print(f"  gpt {tag}: {results[-1]['bpb']:.3f} bpb, {iters} iterations, {wall:.0f} s", flush=True)
    return {**min(results, key=lambda r: r["bpb"]), "sizes": results}


def fit_nanogpt(case: Case, home: Path, work: Path, name: str, flags: list[str]) -> tuple[str, float, int]:
    """nanoGPT's train.py with `flags`, its iterations fitted to the case's budget from a 30-step timing (a multiple
    of its eval_interval, so the last step is evaluated); run once more, refitted, when the wall missed the budget
    by over 15%. Returns (log, wall, iterations)."""
    def train_for(iters: int, tag: str) -> tuple[str, float]:
        return run([sys.executable, "train.py", "config/train_shakespeare_char.py", *flags, f"--max_iters={iters}",
                    f"--lr_decay_iters={iters}", f"--out_dir=out-{tag}"], home, work / f"{name}-{tag}.log")

    log, wall = train_for(30, "timing")
    per_iter = float(np.median([float(t) for t in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", log)][3:])) / 1e3
    start_up = max(0.0, wall - 31 * per_iter)
    eval_share = 1 + (2 * 20 / 3) / NANOGPT_EVAL_INTERVAL  # two splits of 20 forward passes each eval_interval
    fit = (case.seconds - start_up) / (per_iter * eval_share)
    iters = max(NANOGPT_EVAL_INTERVAL, int(round(fit / NANOGPT_EVAL_INTERVAL)) * NANOGPT_EVAL_INTERVAL)
    log, wall = train_for(iters, "run")
    if abs(wall - case.seconds) > 0.15 * case.seconds:  # the timing run misjudged it (a noisy machine): once more
        refit = int(round(iters * (case.seconds - start_up) / max(wall - start_up, 1.0) / NANOGPT_EVAL_INTERVAL))
        iters = max(NANOGPT_EVAL_INTERVAL, refit * NANOGPT_EVAL_INTERVAL)
        shutil.rmtree(home / "out-run", ignore_errors=True)
        log, wall = train_for(iters, "rerun")
    return log, wall, iters


def run_wlm(case: Case, train: str, held_out: str, held_bytes: int, work: Path) -> dict:
    home = work / f"wlm-{case.name}"
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(PEERS / "word_language_model", home)
    data = home / "data"
    data.mkdir()
    (data / "train.txt").write_text(train, encoding="utf8")
    for name in ("valid.txt", "test.txt"):
        (data / name).write_text(held_out, encoding="utf8")

    def train_for(epochs: int, tag: str) -> tuple[str, float]:
        return run([sys.executable, "main.py", "--data", "data", "--epochs", str(epochs), "--save", f"model-{tag}.pt"],
                   home, work / f"wlm-{case.name}-{tag}.log")

    log, wall = train_for(1, "timing")
    epoch = float(re.findall(r"end of epoch\s+1 \| time:\s+([\d.]+)s", log)[0])
    epochs = max(1, int(round((case.seconds - (wall - epoch)) / epoch)))
    log, wall = train_for(epochs, "run")
    loss = wlm_test_loss(log)
    return {"peer": "word_language_model (word, defaults)", "wall_s": wall, "loss": loss, "detail": f"{epochs} epochs",
            "bpb": bits_per_byte(loss, word_tokens(data / "test.txt"), held_bytes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(list(CASES)[:5]),
                        help=f"a subset of {', '.join(CASES)} (the first five by default), or scaling: "
                        f"{', '.join(SCALING)}")
    parser.add_argument("--peers", default="nanogpt,gpt,wlm,rpt", help="a subset of nanogpt, gpt, wlm, rpt")
    parser.add_argument("--work", default="runs/peers", help="where the copies, data and logs go")
    parser.add_argument("--rpt-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an ablation: rpt trains with this --set too (repeatable)")
    parser.add_argument("--gpt-precision", default="fp32", help="fp32, bf16 or fp32,bf16: the gpt peer's rows (bf16: "
                        "its train.py autocasts on the CPU too, a one-line change)")
    parser.add_argument("--vocab-size", default="auto", help="rpt prepare's --vocab-size (an ablation)")
    parser.add_argument("--gpt-sizes", help="the gpt peer's sizes, LAYERSxWIDTHxBLOCK,... (fewer: a partial row, said "
                        f"as such; by default GPT_SIZES, and {'x'.join(map(str, LARGE_GPT))} from {LARGE_BUDGET} s)")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in (",".join(SCALING) if args.cases == "scaling" else args.cases).split(","):
        case = CASES[name]
        data, train, held_out, held_bytes = prepare_rpt(case, work, args.vocab_size)
        chosen, results = args.peers.split(","), []
        if "nanogpt" in chosen:
            results.append(run_nanogpt(case, train, held_out, held_bytes, work))
        if "gpt" in chosen:
            sizes = [tuple(map(int, g.split("x"))) for g in args.gpt_sizes.split(",")] if args.gpt_sizes else \
                [*GPT_SIZES, *([LARGE_GPT] if case.seconds >= LARGE_BUDGET else [])]
            for precision in args.gpt_precision.split(","):
                results.append(run_gpt(case, data, work, sizes, precision))
        if "wlm" in chosen and case.corpus in ENGLISH:
            results.append(run_wlm(case, train, held_out, held_bytes, work))
        if "rpt" in chosen:
            results.append(run_rpt(case, data, work, args.rpt_set))
        rows[name] = results
        for r in results:
            print(f"{name:16s} {r['peer']:38s} {r['bpb']:.3f} bpb  {r['wall_s']:6.0f} s  {r['detail']}", flush=True)
        (work / "peers.json").write_text(json.dumps(rows, indent=1, default=str))
    print()
    print(f"{'case':16s} {'peer':38s} {'bpb':>6s} {'wall s':>7s} {'train FLOPs':>11s}")
    for name, results in rows.items():
        for r in results:
            flops = f"{r['train_flops']:11.3g}" if "train_flops" in r else f"{'':11s}"
            print(f"{name:16s} {r['peer']:38s} {r['bpb']:6.3f} {r['wall_s']:7.0f} {flops}  {r['detail']}")
    margins = []
    for name, results in rows.items():
        peers = [r["bpb"] for r in results if not r["peer"].startswith("rpt")]
        mine = [r["bpb"] for r in results if r["peer"].startswith("rpt")]
        if peers and mine:
            margins.append(f"{name} {min(peers) - mine[0]:+.3f}")
    print("rpt's margin over the best peer (bits per byte, positive = rpt ahead): " + ", ".join(margins))


if __name__ == "__main__":
    main()
