"""The parallel plan: partitioning by cost, memory per rank, pp = auto, and `rpt plan` at scale."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rpt.config import Config
from rpt.errors import RptError
from rpt.parallel.plan import activation_bytes_per_token, balance, choose_plan, counted_costs, format_plan, make_plan
from rpt.train.resolve import check

GiB = 2**30


def test_equal_blocks_split_evenly():
    assert balance([1.0] * 12, 3) == [4, 4, 4]
    assert balance([1.0] * 8, 4) == [2, 2, 2, 2]


def test_uneven_blocks_shift_the_cut_to_balance_cost():
    # two heavy blocks in the middle: the middle stage takes fewer blocks
    assert balance([1, 1, 1, 1, 3, 3, 1, 1, 1, 1, 1, 1], 3) == [4, 2, 6]
    # a heavy output layer charged to the last stage: it holds fewer blocks
    assert balance([1.0] * 12, 3, last_extra=2.0) == [4, 5, 3]
    # and a heavy embedding charged to the first
    first = balance([1.0] * 12, 3, first_extra=2.0)
    assert first[0] < 4 and 2.0 + first[0] <= 5 and max(first[1:]) <= 5


def test_balance_minimises_the_costliest_stage():
    costs = [5, 1, 1, 1, 1, 1, 4, 2, 2]
    counts = balance(costs, 3)
    bounds, start = [], 0
    for n in counts:
        bounds.append(sum(costs[start:start + n]))
        start += n
    # brute force over all cuts
    best = min(max(sum(costs[:i]), sum(costs[i:j]), sum(costs[j:]))
               for i in range(1, len(costs)) for j in range(i + 1, len(costs)))
    assert max(bounds) == best and sum(counts) == len(costs) and min(counts) >= 1


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(RptError, match="cannot split 2 blocks"):
        balance([1.0, 1.0], 3)


def _cfg(*overrides: str) -> Config:
    return Config.load(None, ["model.vocab_size=512", "model.n_layers=8", "model.d_model=64",
                              "train.batch_size=8", "train.seq_len=32", "parallel.microbatches=4", *overrides])


def test_plan_divides_parameters_and_memory_among_stages():
    one = make_plan(_cfg(), 4, 1, 64 * GiB)
    two = make_plan(_cfg(), 4, 2, 64 * GiB)
    assert (one.dp, two.dp) == (4, 2)
    assert [s.blocks for s in two.stages] == [(0, 4), (4, 8)]
    # tied embedding: the last stage keeps its own copy as the head
    assert sum(s.params for s in two.stages) == one.params + 512 * 64
    assert two.peak_memory < one.peak_memory
    assert two.bubble_theory == pytest.approx(1 / 5)
    # 1F1B keeps fewer micro-batches in flight than GPipe on the first stage
    gpipe = make_plan(_cfg("parallel.schedule=gpipe"), 4, 2, 64 * GiB)
    assert gpipe.stages[0].memory["activations"] > two.stages[0].memory["activations"]


def test_activation_checkpointing_keeps_block_inputs_and_one_recompute():
    plain = make_plan(_cfg(), 4, 2, 64 * GiB)
    ckpt = make_plan(_cfg("model.activation_checkpointing=true"), 4, 2, 64 * GiB)
    cfg = _cfg()
    tokens = cfg.train.batch_size // cfg.parallel.microbatches * cfg.train.seq_len
    first, first_ckpt = plain.stages[0], ckpt.stages[0]  # 4 equal blocks, 2 micro-batches in flight (1F1B)
    per_block = first.memory["activations"] / (2 * 4 * tokens)
    assert first_ckpt.memory["activations"] == pytest.approx((2 * 4 * 4 * 64 + per_block) * tokens)
    assert first_ckpt.memory["activations"] < first.memory["activations"] / 3
    assert ckpt.params == plain.params and ckpt.peak_memory < plain.peak_memory


def test_a_looped_model_counts_its_core_at_the_depths_it_runs():
    """Core blocks cost (r forward + 2 min(r, k) backward) / 3 of an unlooped block's training FLOPs and keep
    min(r, k) copies of their activations; the loop's own parameters are counted."""
    loop = ["model.loop_prelude=2", "model.loop_core=4", "model.loop_mean=5", "model.loop_sampler=fixed",
            "model.loop_backprop=2", "model.loop_inject=linear"]
    plain, looped = make_plan(_cfg(), 1, 1, 64 * GiB), make_plan(_cfg(*loop), 1, 1, 64 * GiB)
    block = counted_costs(_cfg()).block[False]  # every block alike here (no attention)
    assert looped.stages[0].cost - plain.stages[0].cost == pytest.approx(4 * block * ((5 + 2 * 2) / 3 - 1))
    tokens = 8 // 4 * 32  # a micro-batch's, one in flight without a pipeline
    extra = looped.stages[0].memory["activations"] - plain.stages[0].memory["activations"]
    assert extra == pytest.approx(4 * (2 - 1) * activation_bytes_per_token(_cfg(), 0) * tokens, rel=1e-6)
    assert looped.params == plain.params + 2 * 64 * 64 + 2 * 64  # the adapter and the loop's two norms


def test_fsdp_gathers_a_looped_models_core_as_one_unit():
    """FSDP shards each block outside the core as its own unit; the core runs as one loop, so the root unit holds
    it whole (with the tied embedding): that is what a rank gathers at once."""
    from rpt.parallel.plan import _meta_model

    loop = ["model.loop_prelude=2", "model.loop_core=4", "model.loop_mean=3", "model.loop_sampler=fixed"]
    plan = make_plan(_cfg(*loop), 2, 1, 64 * GiB, fsdp=2)
    model = _meta_model(_cfg(*loop))
    root = sum(p.numel() for k, b in model.blocks.items() if 2 <= int(k) < 6 for p in b.parameters()) + \
        sum(p.numel() for part in (model.loop, model.norm, model.embed) for p in part.parameters())
    assert plan.stages[0].memory["gathered"] == 3 * 4 * root
    plain = make_plan(_cfg(), 2, 1, 64 * GiB, fsdp=2)  # without a loop: the largest of the blocks and the root
    assert plain.stages[0].memory["gathered"] == 3 * 4 * max(
        sum(p.numel() for p in model.blocks["0"].parameters()), sum(p.numel() for p in model.embed.parameters())
        + sum(p.numel() for p in model.norm.parameters()))


def test_a_pipeline_keeps_a_looped_models_core_inside_one_stage():
    loop = ["model.n_layers=6", "model.loop_prelude=1", "model.loop_core=3", "model.loop_mean=4"]
    for pp in (2, 3, 4):
        plan = make_plan(_cfg(*loop), pp, pp, 64 * GiB)
        holding = [s for s in plan.stages if s.blocks[0] <= 1 < s.blocks[1]]
        assert len(holding) == 1 and holding[0].blocks[1] >= 4 and plan.loop_blocks == (1, 4)
        assert [s.blocks for s in plan.stages][-1][1] == 6 and len(plan.stages) == pp
    with pytest.raises(RptError, match="inside one stage") as refused:
        make_plan(_cfg(*loop), 5, 5, 64 * GiB)
    assert "parallel.pp <= 4" in refused.value.fix


def test_ps_sharded_plan_partitions_optimizer_state():
    allreduce = make_plan(_cfg(), 4, 1, 64 * GiB)
    sharded = make_plan(_cfg("comm.mode=ps-sharded"), 4, 1, 64 * GiB)
    assert sharded.stages[0].memory["optimizer"] * 4 == pytest.approx(allreduce.stages[0].memory["optimizer"], rel=1e-3)
    assert allreduce.grad_bytes_per_step["allreduce"] == 2 * 3 * (4 * allreduce.params) // 4


def test_auto_takes_the_fewest_stages_that_fit():
    cfg = _cfg("parallel.pp=auto")
    roomy = choose_plan(cfg, 8, 64 * GiB)
    assert roomy.pp == 1
    need_one = make_plan(cfg, 8, 1, 64 * GiB).peak_memory
    need_two = make_plan(cfg, 8, 2, 64 * GiB).peak_memory
    tight = choose_plan(cfg, 8, int((need_one + need_two) / 2 / 0.9))
    assert tight.pp == 2 and tight.fits
    with pytest.raises(RptError, match="no layout of pp .* fits"):
        choose_plan(cfg, 8, 1000)


def test_world_size_not_divisible_by_pp_is_refused():
    with pytest.raises(RptError, match="not divisible"):
        make_plan(_cfg(), 6, 4, 64 * GiB)


def test_rpt_plan_for_ten_billion_parameters_on_4096_ranks_allocates_nothing():
    code = ("import resource, sys; from rpt.cli import main; "
            "main(['plan', '--config', 'configs/large-multinode.toml', '--world-size', '4096']); "
            "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "world size 4096: pp " in out
    params = int(out.split("; ")[1].split(" parameters")[0].replace(",", ""))
    assert params > 10e9
    maxrss_gib = int(out.rsplit("maxrss_kb", 1)[1]) / 2**20
    assert maxrss_gib < 2.0, f"planning {params:,} parameters used {maxrss_gib:.1f} GiB"  # fp32 weights: 46 GiB
    assert "fits" in out


def test_interleaved_plan_gives_each_rank_every_pp_th_stage_and_sums_its_memory():
    cfg = Config.load(None, ["model.n_layers=8", "model.d_model=64", "model.vocab_size=256", "parallel.pp=2",
                             "parallel.schedule=interleaved", "parallel.stages_per_rank=2", "parallel.microbatches=4",
                             "train.batch_size=8"])
    plan = make_plan(cfg, 2, 2, 80 * GiB)
    assert len(plan.stages) == 4 and plan.stages_per_rank == 2
    assert [s.index for s in plan.rank_stages(0)] == [0, 2] and [s.index for s in plan.rank_stages(1)] == [1, 3]
    assert [b for s in plan.stages for b in range(*s.blocks)] == list(range(8))  # contiguous, in order
    assert plan.bubble_theory == pytest.approx(1 / (2 * 4 + 1))  # (p - 1) / (v m + p - 1)
    per_rank = [sum(s.memory["total"] for s in plan.rank_stages(r)) for r in range(2)]
    assert plan.peak_memory == max(per_rank)
    one_f_one_b = make_plan(Config.load(None, ["model.n_layers=8", "model.d_model=64", "model.vocab_size=256",
                                               "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8"]),
                            2, 2, 80 * GiB)
    assert plan.bubble_theory < one_f_one_b.bubble_theory


@pytest.mark.parametrize("overrides, message", [
    (["parallel.microbatches=3", "train.batch_size=6"], "not a multiple of parallel.pp"),
    (["parallel.stages_per_rank=3"], "virtual stages"),
    (["parallel.stages_per_rank=1"], "stages_per_rank = 1"),
    (["parallel.pp=auto"], "interleaved"),
])
def test_interleaved_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(RptError, match=message):
        check(Config.load(None, ["model.n_layers=4", "parallel.pp=2", "parallel.schedule=interleaved",
                                 "parallel.microbatches=2", *overrides]))


def test_fsdp_divides_weights_gradients_and_optimiser_state_and_counts_its_traffic():
    from rpt.comm.accounting import fsdp_wire_bytes

    ddp, fsdp = make_plan(_cfg(), 4, 1, 64 * GiB), make_plan(_cfg(), 4, 1, 64 * GiB, fsdp=2)
    a, b = ddp.stages[0].memory, fsdp.stages[0].memory
    for key in ("weights", "grads", "optimizer"):
        assert b[key] == -(-a[key] // 2)
    assert a["gathered"] == 0 < b["gathered"] < a["weights"]  # one unit whole at a time, not the model
    assert b["activations"] == a["activations"] and (fsdp.fsdp, fsdp.replicas, fsdp.dp) == (2, 2, 4)
    from rpt.parallel.plan import _meta_model

    grads, last = 4 * fsdp.params, 4 * sum(p.numel() for p in _meta_model(_cfg()).blocks["7"].parameters())
    assert fsdp.grad_bytes_per_step == {"fsdp": sum(fsdp_wire_bytes(grads, 2, 2, 1, last).values())}
    assert fsdp.fsdp_bytes_per_step == fsdp_wire_bytes(grads, 2, 2, 1, last) and not ddp.fsdp_bytes_per_step
    # two all-gathers (one of the last block, which stays gathered for backward) and a reduce-scatter of half
    # the model, and the halves all-reduced over 2 replicas
    assert fsdp.bytes_per_step == (grads - last) // 2 * 2 + last // 2 + grads // 2 + grads // 2
    with pytest.raises(RptError, match="not divisible by parallel.pp x parallel.fsdp"):
        make_plan(_cfg(), 4, 1, 64 * GiB, fsdp=3)


def test_auto_takes_the_fewest_stages_then_the_smallest_fsdp_that_fits():
    cfg = _cfg("parallel.pp=auto", "parallel.fsdp=auto")
    assert (choose_plan(cfg, 8, 64 * GiB).pp, choose_plan(cfg, 8, 64 * GiB).fsdp) == (1, 1)
    need = [make_plan(cfg, 8, 1, 64 * GiB, fsdp=f).peak_memory for f in (1, 2, 4)]
    assert need[0] > need[1] > need[2]
    tight = choose_plan(cfg, 8, int((need[1] + need[2]) / 2 / 0.9))  # only fsdp 4 (or deeper pipelines) fits
    assert (tight.pp, tight.fsdp, tight.replicas) == (1, 4, 2) and tight.fits
    fixed = choose_plan(_cfg("parallel.fsdp=2"), 8, 64 * GiB)
    assert (fixed.pp, fixed.fsdp) == (1, 2)


def test_rpt_plan_for_a_hundred_billion_parameters_on_4096_ranks_in_80_gib():
    code = ("import resource, sys, time; t = time.perf_counter(); from rpt.cli import main; "
            "main(['plan', '--config', 'configs/100b-multinode.toml', '--world-size', '4096', '--json']); "
            "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    import json

    plan = json.loads(out.rsplit("maxrss_kb", 1)[0])
    assert 95e9 < plan["params"] < 105e9 and plan["fits"] and plan["peak_memory"] <= 0.9 * 80 * GiB
    assert plan["pp"] * plan["dp"] == 4096 and plan["fsdp"] > 1  # 16 bytes a parameter cannot sit on one rank
    assert plan["stages"][0]["memory"]["weights"] * plan["fsdp"] >= 4 * plan["params"] / plan["pp"] * 0.99
    assert int(out.rsplit("maxrss_kb", 1)[1]) / 2**20 < 2.0


def test_context_parallelism_splits_each_windows_activations_and_counts_the_state_exchange():
    lstm = ["model.attention_every=2", "model.attention_window=16", "train.seq_len=64"]
    one = make_plan(_cfg(*lstm), 4, 1, 64 * GiB)
    two = make_plan(_cfg(*lstm, "parallel.cp=2"), 4, 1, 64 * GiB)
    assert (one.dp, two.dp, two.cp) == (4, 2, 2)
    assert two.stages[0].memory["activations"] == pytest.approx(one.stages[0].memory["activations"] / 2, rel=0.01)
    assert two.grad_bytes_per_step == one.grad_bytes_per_step  # the gradients are averaged over every rank alike
    cfg = _cfg(*lstm)
    B, D, W, layers = cfg.train.batch_size, cfg.model.d_model, 16, cfg.model.n_layers
    # each block: (h, c) to the next rank and its gradient back; every second block the attention's window too
    assert two.context_bytes_per_step == layers * 2 * 4 * B * 2 * D + layers // 2 * 2 * 4 * B * W * (2 * D + 1)
    assert one.context_bytes_per_step == 0
    assert "cp 2 x dp 2" in format_plan(two) and "context states" in format_plan(two)



@pytest.mark.parametrize("cell", ["mingru", "mlstm", "gdn"])
def test_a_summarising_cell_counts_the_summaries_it_sends(cell):
    """The cells that fold their pieces' summaries send those (not their state) over the group: each rank's to
    every other, and the gradients of all of them summed (an all-reduce of cp summaries). `summary_numbers` is
    what its `piece_forward` hands to the exchange (recorded here, with resets in the piece)."""
    import torch

    from rpt.parallel.plan import allreduce_wire_bytes
    from rpt.models.lm import build_cell
    from rpt.config import ModelConfig

    options = {"heads": 4} if cell != "mingru" else {}
    model_cfg = ModelConfig(cell=cell, d_model=16, **options)
    one = build_cell(model_cfg)
    B, sent = 3, []

    def recording(own, state, fold):
        sent.append(sum(t.numel() for t in own) // B)
        return tuple(state)
    reset = torch.zeros(B, 8, dtype=torch.bool)
    reset[1, 2] = True
    one.piece_forward(torch.randn(B, 8, 16), one.init_state(B), reset, recording)
    assert sum(sent) == one.summary_numbers()

    cfg = _cfg(f"model.cell={cell}", *[f"model.{k}={v}" for k, v in options.items()], "parallel.cp=2")
    plan = make_plan(cfg, 4, 1, 64 * GiB)
    cells = [build_cell(cfg.model) for _ in range(cfg.model.n_layers)]
    summary = [4 * cfg.train.batch_size * c.summary_numbers() for c in cells]
    assert plan.context_bytes_per_step == sum(n + allreduce_wire_bytes(2 * n, 2) for n in summary)
