"""The language model: causality (attention included), state carry, generation by steps, resets, deep stacks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from rpt.config import ModelConfig
from rpt.models import RecurrentLM
from rpt.models.decoder import Decoder
from rpt.models.sampling import sample_next

CELLS = ["lstm", "gru", "modlstm", "mingru", "minlstm", "mlstm", "gdn"]
V = 50


def lm(cell: str, **kw) -> RecurrentLM:
    torch.manual_seed(0)
    cfg = ModelConfig(cell=cell, vocab_size=V, d_model=16, n_layers=3, attention_every=2, attention_window=4,
                      attention_heads=2, mlp_ratio=2.0, **kw)
    return RecurrentLM(cfg).double().eval()


@pytest.mark.parametrize("cell", CELLS)
def test_causal_changing_a_token_changes_no_earlier_logit(cell):
    model = lm(cell)
    x = torch.randint(0, V, (2, 14))
    base, _ = model(x)
    for t in (0, 5, 13):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1) % V
        out, _ = model(x2)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
        assert not torch.allclose(out[:, t], base[:, t])


@pytest.mark.parametrize("cell", CELLS)
def test_chunks_with_state_equal_one_pass_and_steps_equal_forward(cell):
    model = lm(cell)
    x = torch.randint(0, V, (2, 15))
    reset = torch.zeros(2, 15, dtype=torch.bool)
    reset[0, 9] = True
    whole, _ = model(x, reset_mask=reset)
    state, outs = None, []
    for a in range(0, 15, 4):  # chunks shorter than, equal to and not aligned with the attention window
        out, state = model(x[:, a:a + 4], state, reset[:, a:a + 4])
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), whole)
    state = None
    for t in range(9):  # the single-step forms (no reset before t=9)
        out, state = model.step(x[:, t], state)
        torch.testing.assert_close(out, whole[:, t])


@pytest.mark.parametrize("cell", CELLS)
def test_reset_mask_starts_a_fresh_document(cell):
    model = lm(cell)
    x = torch.randint(0, V, (1, 12))
    reset = torch.zeros(1, 12, dtype=torch.bool)
    reset[0, 7] = True
    out, _ = model(x, reset_mask=reset)
    fresh, _ = model(x[:, 7:])
    torch.testing.assert_close(out[:, 7:], fresh)


def test_generation_memory_is_constant_in_length():
    model = lm("lstm")
    state_sizes = []
    for n in (5, 60):
        prompt = torch.randint(0, V, (3,))
        _, state = model(prompt[None])
        for _ in range(n):
            _, state = model.step(torch.tensor([1]), state)
        state_sizes.append(sum(t.numel() for block in state for part in block for t in part))
    assert state_sizes[0] == state_sizes[1]
    g = torch.Generator(torch.get_default_device()).manual_seed(0)  # the GPU run of these tests too
    tokens = list(Decoder(model).generate(torch.tensor([1, 2, 3]), 20, temperature=0.8, top_k=10, top_p=0.9, generator=g))
    assert len(tokens) == 20 and all(0 <= t < V for t in tokens)


@pytest.mark.parametrize("cell", ["lstm", "mingru"])
def test_generation_starts_a_new_document_at_the_reset_token(cell):
    """With reset_at, the state starts afresh before that token, in the prompt and after it is generated, as
    training resets it between documents: what follows is what a prompt of that token alone gives."""
    model = lm(cell)  # attention in some blocks: its window starts afresh too
    prompt = torch.tensor([5, 11, 2, 7])
    first = next(Decoder(model).generate(prompt, 1, temperature=0))
    assert first not in prompt.tolist()
    after = list(Decoder(model).generate(prompt, 12, temperature=0, reset_at=first))[1:]
    assert after == list(Decoder(model).generate(torch.tensor([first]), 11, temperature=0, reset_at=first))
    assert after != list(Decoder(model).generate(prompt, 12, temperature=0))[1:]  # without the reset the prompt matters
    in_prompt = list(Decoder(model).generate(torch.cat([prompt, torch.tensor([first])]), 11, temperature=0, reset_at=first))
    assert in_prompt == after


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample_next(logits, temperature=0).item() == 1
    g = torch.Generator(torch.get_default_device()).manual_seed(0)  # the GPU run of these tests too
    drawn = {sample_next(logits, top_k=2, generator=g).item() for _ in range(200)}
    assert drawn == {1, 3}
    # top_p = 0.6: token 1 alone holds ~64% of the mass, so only it survives
    drawn = {sample_next(logits, top_p=0.6, generator=g).item() for _ in range(100)}
    assert drawn == {1}


@pytest.mark.parametrize("cell", ["lstm", "mingru", "modlstm"])
def test_48_block_stack_trains(cell):
    torch.manual_seed(0)
    cfg = ModelConfig(cell=cell, vocab_size=64, d_model=32, n_layers=48)
    model = RecurrentLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (4, 17))
    losses = []
    for _ in range(50):
        logits, _ = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_flops_per_token_counts_cells_attention_mlp_and_head():
    model = lm("lstm")
    D = 16
    cell = 2 * 4 * D * (D + D)
    attn = 2 * 4 * D * D + 2 * 2 * 4 * D
    mlp = 2 * 3 * D * 32
    assert model.flops_per_token(training=False) == 3 * cell + attn + 3 * mlp + 2 * D * V
    assert model.flops_per_token() == 3 * model.flops_per_token(training=False)


def test_models_never_import_torch_distributed():
    root = Path(__file__).resolve().parents[2] / "rpt" / "models"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = node.module if isinstance(node, ast.ImportFrom) else ""
            assert not any("torch.distributed" in n for n in names + [module or ""]), path


@pytest.mark.parametrize("tied", [True, False])
def test_a_part_built_alone_has_the_values_of_the_whole_model(tied):
    """What a pipeline rank does: build its parts only (blocks keep their global names), with the values the whole
    model gives them; a tied head on a stage without the embedding is a copy of the embedding's matrix."""
    cfg = ModelConfig(cell="modlstm", vocab_size=V, d_model=16, n_layers=5, attention_every=2, mlp_ratio=2.0,
                      tie_embeddings=tied)
    torch.manual_seed(3)
    whole = RecurrentLM(cfg)
    after_whole = torch.rand(1)
    mine = {"blocks.1", "blocks.2", "norm", "head"}
    torch.manual_seed(3)
    part = RecurrentLM(cfg, parts=mine)
    assert torch.equal(torch.rand(1), after_whole)  # the global generator moved as a whole build moves it
    want = dict(whole.named_parameters(remove_duplicate=False))
    held = {name for name in want if any(name.startswith(m + ".") for m in mine)}
    assert {name for name, _ in part.named_parameters(remove_duplicate=False)} == held
    for name, p in part.named_parameters(remove_duplicate=False):
        assert torch.equal(p, want[name]), name
    assert part.embed is None and list(part.blocks) == ["1", "2"]
    if tied:
        assert torch.equal(part.head.weight, whole.embed.weight)
    torch.manual_seed(4)
    other = RecurrentLM(cfg)
    assert not torch.equal(other.blocks["1"].cell.w_h, whole.blocks["1"].cell.w_h)  # the seed still decides
    assert not torch.equal(whole.blocks["1"].cell.w_h, whole.blocks["2"].cell.w_h)  # and each part has its own draw


def test_a_stage_without_embedding_or_head_passes_activations_through():
    """The whole model's forward equals its first part's forward followed by the rest's, on activations."""
    cfg = ModelConfig(cell="lstm", vocab_size=V, d_model=16, n_layers=4, attention_every=2, attention_window=4)
    torch.manual_seed(1)
    whole = RecurrentLM(cfg).eval()
    first = whole.view({"embed", "blocks.0", "blocks.1"})
    rest = whole.view({"blocks.2", "blocks.3", "norm", "head"})
    x = torch.randint(0, V, (2, 10))
    logits, state = whole(x)
    h, s1 = first(x)
    assert h.shape == (2, 10, 16)
    logits_2, s2 = rest(h)
    torch.testing.assert_close(logits_2, logits, rtol=0, atol=0)
    for a, b in zip(torch.utils._pytree.tree_leaves(state), torch.utils._pytree.tree_leaves(s1 + s2)):
        assert torch.equal(a, b)
    step_logits, _ = rest.step(first.step(x[:, 0])[0])
    torch.testing.assert_close(step_logits, logits[:, 0], rtol=1e-5, atol=1e-5)




@pytest.mark.parametrize("cell", CELLS)
def test_blocks_and_the_model_return_no_views(cell):
    """FSDP hooks every output of a block (and of the model) for backward, and warns at each view it is handed
    (an in-place op on one would lose the hook): the state and the losses are tensors of their own."""
    model = RecurrentLM(ModelConfig(cell=cell, vocab_size=V, d_model=16, n_layers=2, attention_every=2,
                                    attention_window=4))
    outputs = []
    for block in model.blocks.values():
        block.register_forward_hook(lambda _m, _args, out: outputs.append(out))
    x = torch.randint(0, V, (2, 6))
    outputs += [model(x, targets=x), model(x)]
    views = [t for t in torch.utils._pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t._is_view()]
    assert not views
