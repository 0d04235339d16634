"""The regularisers around the embedding and in the recurrence: each is the operation its docs name, drawn
from torch's generator like any dropout, and nothing at evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rpt.config import ModelConfig
from rpt.models import RecurrentLM
from rpt.models.cells.lstm import LSTM, lstm_step

V = 40


def model(**kw) -> RecurrentLM:
    torch.manual_seed(0)
    return RecurrentLM(ModelConfig(vocab_size=V, d_model=16, n_layers=2, **kw)).double()


def test_embed_dropout_drops_the_token_vectors_in_and_the_hidden_state_out():
    m = model(embed_dropout=0.3).train()
    x = torch.randint(0, V, (3, 9))
    torch.manual_seed(5)
    logits, _ = m(x)
    torch.manual_seed(5)  # by hand, the same draws in the same order
    h = F.dropout(m.embed(x), 0.3)
    for block, s in zip(m.blocks.values(), m.init_state(3)):
        h, _ = block(h, s)
    expected = m.head(F.dropout(m.norm(h), 0.3))
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    plain = model().eval()
    torch.testing.assert_close(m.eval()(x)[0], plain(x)[0], rtol=0, atol=0)  # nothing at evaluation


def test_weight_drop_runs_the_sequence_on_one_dropped_recurrent_matrix_and_its_gradient_flows():
    torch.manual_seed(0)
    cell = LSTM(8, weight_drop=0.4).double().train()
    x = torch.randn(2, 7, 8, dtype=torch.double)
    torch.manual_seed(11)
    y, state = cell(x)
    torch.manual_seed(11)
    w_hh = F.dropout(cell.w_hh, 0.4)  # one mask, the whole sequence
    s = cell.init_state(2)
    ys = []
    for t in range(7):
        h, s = lstm_step(x[:, t], s, cell.w_ih, w_hh, cell.b_ih, cell.b_hh)
        ys.append(h)
    torch.testing.assert_close(y, torch.stack(ys, 1))
    torch.testing.assert_close(state[1], s[1])
    assert (w_hh == 0).any() and (w_hh != 0).any()
    y.sum().backward()
    dropped = w_hh.detach() == 0
    assert (cell.w_hh.grad[dropped] == 0).all() and (cell.w_hh.grad[~dropped] != 0).any()
    cell.eval()
    torch.testing.assert_close(cell(x)[0], cell.reference(x)[0])  # no mask at evaluation
