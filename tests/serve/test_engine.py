"""The serving engine against `RecurrentLM.generate` (what `rpt generate` runs): the same tokens for a stream
whatever runs beside it, rows joining and leaving the batch, per-row sampling, resets, depths and stop strings."""

from __future__ import annotations

import pytest
import torch

from rpt.config import ModelConfig
from rpt.models import RecurrentLM
from rpt.models.decoder import Decoder
from rpt.models.loop_exit import Exit, RowDepths
from rpt.models.sampling import sample_next, sample_rows
from rpt.models.state import rows
from rpt.serve.engine import Engine, Sampling, Stream, TextOut

V, EOT = 64, 0
TABLE = [b""] + [bytes([32 + i]) for i in range(1, V)]  # token i: one printable byte; EOT: none


def model(dtype=torch.float64, **overrides) -> RecurrentLM:
    """A small model whose greedy continuations vary (untied head, weights drawn wider than at initialisation)."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{"cell": "lstm", "n_layers": 2, "d_model": 32, "vocab_size": V, "head_shortlist": 16,
                         "tie_embeddings": False,
                         **overrides})
    m = RecurrentLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return m


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (count,), generator=g)
    return [[EOT] + torch.randint(1, V, (int(n),), generator=g).tolist() for n in lengths]


def run(engine: Engine, streams: list[Stream], cancel_after: dict | None = None) -> None:
    for s in streams:
        engine.add(s)
    steps = 0
    while engine.active:
        engine.step()
        steps += 1
        for s, at in (cancel_after or {}).items():
            if steps == at:
                s.cancelled = True


def stream(prompt, events=None, **sampling) -> Stream:
    return Stream(prompt, Sampling(**sampling), lambda s, text, finish: events is not None and events.append(
        (s.id, text, finish)))


def reference(m, prompt, max_tokens, **kw) -> list[int]:
    return list(Decoder(m).generate(torch.tensor(prompt), max_tokens, reset_at=EOT, **kw))


def test_thirty_two_greedy_streams_together_give_rpt_generates_tokens_in_float64():
    m = model()
    engine = Engine(m, EOT, True, TABLE, prefill_chunk=7)  # prompts longer than a chunk: prefill in pieces
    ps = prompts(32)
    streams = [stream(p, max_tokens=40 + i % 9, temperature=0, ignore_eos=True) for i, p in enumerate(ps)]
    run(engine, streams)
    refs = [reference(m, p, 40 + i % 9, temperature=0) for i, p in enumerate(ps)]
    assert [s.tokens for s in streams] == refs
    assert len({tuple(r[:10]) for r in refs}) > 20  # the continuations really differ
    assert any(EOT in r for r in refs)  # an end of text inside a stream: its row's state started afresh there


def test_in_float32_batched_rows_differ_from_one_row_only_where_the_two_best_logits_are_within_the_tolerance():
    """Batched products differ from one row's in the last bits: the logits agree within TOL, and a greedy token
    may differ only where the reference's two best logits were that close."""
    TOL = 1e-4
    m = model(torch.float32)
    engine = Engine(m, EOT, True, TABLE)
    ps = prompts(32, seed=5)
    streams = [stream(p, max_tokens=30, temperature=0, ignore_eos=True) for p in ps]
    run(engine, streams)
    for p, s in zip(ps, streams):
        ref = reference(m, p, 30, temperature=0)
        if s.tokens == ref:
            continue
        at = next(i for i, (a, b) in enumerate(zip(s.tokens, ref)) if a != b)
        logits, _ = m.prefill(torch.tensor(p + ref[:at])[None], reset_mask=torch.tensor(p + ref[:at])[None] == EOT)
        best = logits[0].topk(2).values
        assert best[0] - best[1] < TOL, (at, best)
    tokens = torch.tensor([p[-1] for p in ps])
    decoder = Decoder(m)
    h, _ = m.step_hidden(tokens, m.init_state(32))
    batched = decoder.sampling_logits(h, 1)
    for row in range(32):
        h, _ = m.step_hidden(tokens[row:row + 1], m.init_state(1))
        alone = decoder.sampling_logits(h, 1)
        torch.testing.assert_close(batched[row:row + 1], alone, atol=TOL, rtol=0)


def test_a_seeded_stream_draws_the_same_tokens_alone_and_beside_others():
    m = model()
    p = prompts(1, seed=9)[0]
    settings = dict(max_tokens=25, temperature=0.9, top_k=20, top_p=0.9, seed=1234, ignore_eos=True)
    alone = stream(p, **settings)
    run(Engine(m, EOT, True, TABLE), [alone])
    crowd = [stream(q, max_tokens=10 + i, temperature=0.7 + 0.1 * (i % 3), top_k=i % 5, seed=i)
             for i, q in enumerate(prompts(12, seed=3))]
    again = stream(p, **settings)
    run(Engine(m, EOT, True, TABLE), [*crowd[:6], again, *crowd[6:]])
    assert again.tokens == alone.tokens
    other = stream(p, **{**settings, "seed": 99})
    run(Engine(m, EOT, True, TABLE), [other])
    assert other.tokens != alone.tokens


def test_rows_join_and_leave_without_touching_the_others():
    """Streams of different lengths finish at different steps, one is cancelled midway, and late arrivals join
    a running batch: every other stream still gives the reference's tokens."""
    m = model()
    engine = Engine(m, EOT, True, TABLE, prefill_chunk=4)
    ps = prompts(10, seed=11)
    first = [stream(p, max_tokens=5 + 4 * i, temperature=0, ignore_eos=True) for i, p in enumerate(ps[:6])]
    for s in first:
        engine.add(s)
    for _ in range(12):
        engine.step()
    late = [stream(p, max_tokens=20, temperature=0, ignore_eos=True) for p in ps[6:]]
    first[5].cancelled = True
    run(engine, late)
    assert first[5].finish_reason == "cancelled" and engine.state is None and engine.running == []
    for s, p in zip(first[:5] + late, ps[:5] + ps[6:]):
        assert s.tokens == reference(m, p, s.sampling.max_tokens, temperature=0)
        assert s.finish_reason == "length"


def test_a_step_prefills_prompts_of_many_lengths_in_pieces_up_to_its_token_budget():
    """One step runs a piece per remaining length until its prefill_tokens are spent: with a budget that holds
    them all, every prompt has its first token after one step, with a smaller one not; the tokens are the
    reference's either way."""
    m = model()
    ps = prompts(8, seed=5)
    assert len({len(p) for p in ps}) > 4
    for budget in (sum(map(len, ps)), 40):
        engine = Engine(m, EOT, True, TABLE, prefill_chunk=8, prefill_tokens=budget)
        streams = [stream(p, max_tokens=6, temperature=0, ignore_eos=True) for p in ps]
        engine.prefilling.extend(streams)
        engine.step()
        assert (len(engine.running) == len(ps)) == (budget > 40)
        run(engine, [])
        for s, p in zip(streams, ps):
            assert s.tokens == reference(m, p, 6, temperature=0)


def test_a_stream_ends_at_the_end_of_text_and_at_a_stop_string_which_it_never_sends():
    m = model()
    p = prompts(1, seed=21)[0]
    ref = reference(m, p, 60, temperature=0)
    ends = stream(p, max_tokens=60, temperature=0)
    run(Engine(m, EOT, True, TABLE), [ends])
    cut = ref.index(EOT) + 1 if EOT in ref else 60
    assert ends.tokens == ref[:cut] and ends.finish_reason == ("stop" if EOT in ref else "length")
    text = b"".join(TABLE[t] for t in ref[:cut]).decode()
    stop = text[5:7]
    events = []
    stopped = stream(p, events, max_tokens=60, temperature=0, stop=("\x00never", stop))
    run(Engine(m, EOT, True, TABLE), [stopped])
    sent = "".join(text for _, text, _ in events)
    assert sent == text[:text.index(stop)] and events[-1][2] == "stop"


def test_text_out_holds_back_what_may_begin_a_stop_string_and_whole_characters_only():
    out = TextOut(("END", "xy"))
    assert out.add(b"abcE") == ("abc", False)  # "E" may begin "END"
    assert out.add(b"Nd") == ("ENd", False)
    assert out.add("é".encode()[:1]) == ("", False)  # half a character
    assert out.add("é".encode()[1:] + b"x") == ("é", False)
    assert out.add(b"y tail") == ("", True)
    held = TextOut(("END",))
    assert held.add(b"oops EN") == ("oops ", False) and held.flush() == "EN"


def test_step_resets_only_the_rows_asked():
    m = model()
    tokens = torch.tensor([3, 4, 5])
    _, state = m.prefill(torch.tensor([[1, 2, 3]] * 3))
    reset = torch.tensor([False, True, False])
    got, _ = m.step(tokens, state, reset=reset)
    for row in range(3):
        want, _ = m.step(tokens[row:row + 1], None if reset[row] else rows(state, slice(row, row + 1)))
        torch.testing.assert_close(got[row:row + 1], want)


def test_looped_rows_at_their_own_depths_in_one_batch_equal_each_alone():
    m = model(loop_prelude=1, loop_core=1, n_layers=3, loop_mean=3.0, loop_max=4, loop_init="zero")
    prompt = torch.tensor([[EOT, 5, 9, 13]] * 3)
    _, state = m.prefill(prompt)
    token = torch.tensor([7, 7, 7])
    depths = torch.tensor([1, 2, 4])
    rules = [None, None, Exit("change", 1e-3)]
    got, _ = m.step(token, state, int(depths.max()), RowDepths(depths, rules))
    for row, depth in enumerate([1, 2, 4]):
        want, _ = m.step(token[row:row + 1], rows(state, slice(row, row + 1)), depth, rules[row])
        torch.testing.assert_close(got[row:row + 1], want)


def test_sampling_per_row_draws_from_sample_nexts_distribution():
    """Each row's tokens over evenly spread uniform numbers (its distribution's quantiles) against sample_next's
    draws under the same temperature, top-k and top-p: the same distribution (total variation within what 4,000
    draws allow), nothing beyond the k best; a greedy row takes its best token."""
    torch.manual_seed(3)
    logits = torch.randn(4, 40, dtype=torch.float64) * 2
    temperature = torch.tensor([0.0, 0.8, 1.0, 1.3])
    top_k = torch.tensor([0, 5, 0, 12])
    top_p = torch.tensor([1.0, 1.0, 0.7, 0.9])
    n = 4000
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for row in range(4):
        def spread(x):
            return x[row].expand(n)

        drawn = sample_rows(logits[row:row + 1].expand(n, -1), spread(temperature), spread(top_k), spread(top_p),
                            grid)
        if temperature[row] == 0:
            assert set(drawn.tolist()) == {int(logits[row].argmax())}
            continue
        g = torch.Generator().manual_seed(row)
        other = torch.cat([sample_next(logits[row:row + 1], float(temperature[row]), int(top_k[row]),
                                       float(top_p[row]), g) for _ in range(n)])
        ours, theirs = (torch.bincount(t, minlength=40).double() / n for t in (drawn, other))
        assert 0.5 * (ours - theirs).abs().sum() < 0.05
        if top_k[row]:
            assert set(drawn.tolist()) <= set(logits[row].topk(int(top_k[row])).indices.tolist())


def test_a_two_level_head_samples_each_row_as_alone():
    m = model()
    h = torch.randn(16, 32, dtype=torch.float64) * 3
    k = torch.tensor([1, 0, 3, 17, 1, 5, 2, 16] * 2)
    both = Decoder(m).sampling_logits(h, k)
    for row in range(16):
        torch.testing.assert_close(both[row:row + 1], Decoder(m).sampling_logits(h[row:row + 1], int(k[row])))
    assert torch.isinf(both).any() and not torch.isinf(both).all(dim=-1).any()


def test_abort_ends_every_stream_with_its_reason():
    m = model()
    engine = Engine(m, EOT, True, TABLE)
    streams = [stream(p, max_tokens=1000, temperature=0) for p in prompts(4)]
    for s in streams:
        engine.add(s)
    for _ in range(3):
        engine.step()
    engine.abort_all()
    assert {s.finish_reason for s in streams} <= {"abort", "stop"} and engine.active == 0
    assert engine.state_bytes(3) == 3 * engine.state_bytes(1) > 0


@pytest.mark.parametrize("cell", ["gru", "mingru", "mlstm", "gdn"])
def test_every_family_serves_as_it_generates(cell):
    m = model(cell=cell, **({"heads": 4} if cell in ("mlstm", "gdn") else {}))
    ps = prompts(6, seed=31)
    streams = [stream(p, max_tokens=12, temperature=0, ignore_eos=True) for p in ps]
    run(Engine(m, EOT, True, TABLE, prefill_chunk=5), streams)
    assert [s.tokens for s in streams] == [reference(m, p, 12, temperature=0) for p in ps]



def test_looped_streams_at_their_own_depths_give_generates_tokens_at_that_depth():
    """A looped model's streams with depths 1, 2 and 4 (its slots) and the default, prefilled and decoded in one
    batch: each gives `generate(depth=...)`'s tokens, as `rpt generate --depth` does."""
    m = model(loop_prelude=1, loop_core=1, n_layers=3, loop_mean=2.0, loop_max=4, loop_init="zero")
    ps = prompts(8, seed=41)
    depths = [1, 2, 4, None] * 2
    streams = [stream(p, max_tokens=12, temperature=0, ignore_eos=True, depth=d) for p, d in zip(ps, depths)]
    run(Engine(m, EOT, True, TABLE, prefill_chunk=6), streams)
    for p, d, s in zip(ps, depths, streams):
        assert s.tokens == reference(m, p, 12, temperature=0, depth=d if d is not None else 2)
    assert len({tuple(s.tokens) for s in streams[:3]}) > 1  # the depth changes what is generated
