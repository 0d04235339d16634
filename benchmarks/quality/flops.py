"""The FLOP counts the per-FLOP figures stand on, against torch's own counter (issue 70).

    .venv/bin/python benchmarks/quality/flops.py

For each family, `RecurrentLM.flops_per_token` (the model's matrix products, forward; x3 for training: what
summary.json's flops_per_token holds and peers.py multiplies by the tokens trained, once) against
`torch.utils.flop_counter.FlopCounterMode` on the plain-torch form of the same model: its step form (the ops'
spec.py, which generation runs and the export ships) token by token, since the sequence forms' library kernel
(oneDNN's LSTM) and C++ loops hide their products from the counter; an mlstm and a gdn in their chunkwise forms,
what their counts describe (the gdn's triangular solve counted as L^2 n / 2 multiply-adds). Then the gpt peer's count (`peers.gpt_flops_per_token`, nanoGPT's own formula) against the counter on
nanoGPT's model.py (the CPU's flash attention, absent from the counter's table, counted by torch's formula for
attention), and against nanoGPT's own reckoning (6 x its parameters + 12 L d T). tests/models/test_flops.py holds
rpt's families within 5%; the peer's checks read nanoGPT from ../shared, which a clone of rpt alone lacks, so they
are this script's: it exits non-zero where a count is off.
"""

from __future__ import annotations

import argparse
import math
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from rpt import kernels
from rpt.config import ModelConfig
from rpt.kernels.backend import Form
from rpt.models.lm import RecurrentLM

B, T, V = 2, 48, 512
FAMILIES = {  # counted token by token (`stepped`), but the chunkwise families
    "lstm": dict(cell="lstm"),
    "lstm, projected": dict(cell="lstm", d_hidden=96),
    "gru": dict(cell="gru"),
    "modlstm": dict(cell="modlstm"),
    "mingru": dict(cell="mingru"),
    "minlstm": dict(cell="minlstm"),
    "lstm with a gated MLP": dict(cell="lstm", mlp_ratio=2.0),
    "gru with attention": dict(cell="gru", attention_every=2, attention_window=32, attention_heads=2),
    "mlstm": dict(cell="mlstm", heads=2, chunk_size=16),
    "gdn": dict(cell="gdn", heads=2, chunk_size=16),
}
CHUNKWISE = ("mlstm", "gdn")  # counted in the form their counts describe


# the CPU's flash attention, absent from the counter's table: counted by torch's own formulas for attention
_aten = torch.ops.aten
CPU_ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_flop_count(q, k, v),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *a, out_shape=None, **kw: flop_counter.sdpa_backward_flop_count(g, q, k, v),
    # absent too: a triangular solve of [..., L, L] against [..., L, n] is L^2 n / 2 multiply-adds
    _aten.linalg_solve_triangular: lambda A, B, *a, out_shape=None, **kw: math.prod(A) * B[-1]}


def tokens() -> torch.Tensor:
    return torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(0))


def model_of(family: str, **more) -> RecurrentLM:
    torch.manual_seed(0)
    return RecurrentLM(ModelConfig(**{"n_layers": 2, "d_model": 64, "vocab_size": V, **FAMILIES[family], **more}))


def per_token(run, rows: int = B, length: int = T) -> float:
    """The FLOPs torch counts in `run()`, per token of a rows x length batch."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        run()
    return counter.get_total_flops() / (rows * length)


def counted(model: RecurrentLM, backward: bool) -> float:
    """Torch's count a token of `model` on its plain-torch form, forward (and backward)."""
    x = tokens()

    def stepped():
        state, loss = None, 0.0
        for t in range(T):
            logits, state = model.step(x[:, t], state)
            loss = loss + F.cross_entropy(logits, x[:, t + 1])
        if backward:
            loss.backward()

    def chunkwise():
        with kernels.use(force=Form.CHUNKWISE):
            nats, _ = model(x[:, :-1], targets=x[:, 1:])
        if backward:
            nats.mean().backward()
    return per_token(chunkwise if model.cfg.cell in CHUNKWISE else stepped)


def gpt_counted(model_py: Path, layers: int, width: int, block: int, vocab: int, rows: int = 2) -> float:
    """Torch's count a token of nanoGPT's model.py, one training step (forward and backward) of rows x block."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    gpt = module.GPT(module.GPTConfig(n_layer=layers, n_head=4, n_embd=width, block_size=block, vocab_size=vocab,
                                      bias=False, dropout=0.0))
    x = torch.randint(0, vocab, (rows, block + 1))

    def step():
        _, loss = gpt(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        loss.backward()
    return per_token(step, rows, block)


def main() -> None:
    argparse.ArgumentParser(description="Each family's FLOP count, and the gpt peer's, against torch's "
                            "FlopCounterMode (a markdown table).").parse_args()
    print("| model | rpt's count (forward) | torch's | ratio | rpt's count (training) | torch's | ratio |")
    print("|---|---|---|---|---|---|---|")
    for family in FAMILIES:
        model = model_of(family)
        ours, theirs = model.flops_per_token(training=False), counted(model, backward=False)
        ours3, theirs3 = model.flops_per_token(), counted(model_of(family), backward=True)
        print(f"| {family} | {ours:,} | {theirs:,.0f} | {ours / theirs:.4f} | {ours3:,} | {theirs3:,.0f} | "
              f"{ours3 / theirs3:.4f} |")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import peers

    model_py = peers.PEERS / "nanoGPT" / "model.py"  # (../shared: the peers are beside a checkout, not in it)
    off = [family for family in FAMILIES if not 0.95 <= model_of(family).flops_per_token() / counted(
        model_of(family), backward=True) <= 1.05]
    if not model_py.is_file():
        raise SystemExit(f"the gpt peer's checks need {model_py}: run beside ../shared")
    for layers, width, block, vocab in ((2, 64, 32, 512), (4, 128, 64, 8192), (6, 256, 128, 32768)):
        ours, theirs = peers.gpt_flops_per_token(layers, width, block, vocab), gpt_counted(
            model_py, layers, width, block, vocab)
        own = nanogpt_own_count(model_py, layers, width, block, vocab)  # its params x 6 and estimate_mfu's term
        print(f"| gpt peer {layers} x {width}, block {block}, vocabulary {vocab:,} | | | | {ours:,} | "
              f"{theirs:,.0f} | {ours / theirs:.4f} | (nanoGPT's own count {own:,})")
        if ours != own or not 0.95 <= ours / theirs <= 1.05:
            off.append(f"gpt peer {layers} x {width}")
    if off:
        raise SystemExit(f"counts more than 5% from torch's (or the peer's from nanoGPT's own): {', '.join(off)}")


def nanogpt_own_count(model_py: Path, layers: int, width: int, block: int, vocab: int) -> int:
    """nanoGPT's training FLOPs a token by its own reckoning: 6 x its parameters (get_num_params) + 12 L d T, as
    its estimate_mfu counts them, on a meta model."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        gpt = module.GPT(module.GPTConfig(n_layer=layers, n_head=4, n_embd=width, block_size=block,
                                          vocab_size=vocab, bias=False, dropout=0.0))
    return 6 * gpt.get_num_params() + 12 * layers * width * block

if __name__ == "__main__":
    main()
