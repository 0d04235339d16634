"""The configuration of an rpt model exported for Hugging Face transformers (`model_type = "rpt"`).

Written by `rpt export` beside modeling_rpt.py; it holds the model section of the run's config.toml that the
forward needs, with the cell's state width resolved. It depends on transformers only, not on rpt.
"""

from transformers import PretrainedConfig

# The hash of the code an export ships (modeling_rpt.py and its spec files), which `rpt export` writes here.
# transformers keeps one config class per content of this file and, once it has loaded a model class with it,
# gives every later folder with that config class the same model class: two exports whose code differs (another
# family's spec_cell.py, another rpt's modeling file) loaded in one process must not share this file's bytes.
CODE = ""


class RptConfig(PretrainedConfig):
    model_type = "rpt"

    def __init__(self, vocab_size: int = 256, cell: str = "lstm", n_layers: int = 2, d_model: int = 256,
                 d_hidden: int = 256, norm: str = "rmsnorm", mlp_ratio: float = 0.0, attention_every: int = 0,
                 attention_window: int = 128, attention_heads: int = 4, head_shortlist: int = 0,
                 gate: str = "sigmoid", gate_norm: bool = False, coupled_gates: bool = False, peepholes: bool = False,
                 heads: int = 1, loop_prelude: int = 0, loop_core: int = 0, loop_depth: int = 4, loop_slots: int = 16,
                 loop_inject: str = "add",
                 reset_at_eot: bool = True, eot_token_id: int = 0, tie_word_embeddings: bool = True,
                 tokenizer_sha256: str = "", initializer_range: float = 0.02, use_cache: bool = True, **kwargs):
        self.vocab_size, self.cell, self.n_layers, self.d_model, self.d_hidden = vocab_size, cell, n_layers, d_model, d_hidden
        self.norm, self.mlp_ratio, self.head_shortlist = norm, mlp_ratio, head_shortlist
        self.attention_every, self.attention_window, self.attention_heads = attention_every, attention_window, attention_heads
        self.gate, self.gate_norm, self.coupled_gates, self.peepholes = gate, gate_norm, coupled_gates, peepholes
        self.heads = heads  # lstm, gru, modlstm: a block-diagonal recurrent matrix of this many heads; mlstm: its heads
        # depth recurrence (rpt's model.loop_*): the core's iterations by default (num_steps), the iterations a fresh
        # state holds, and how the prelude's output enters each iteration
        self.loop_prelude, self.loop_core, self.loop_depth = loop_prelude, loop_core, loop_depth
        self.loop_slots, self.loop_inject = loop_slots, loop_inject
        self.reset_at_eot, self.eot_token_id = reset_at_eot, eot_token_id
        self.tokenizer_sha256 = tokenizer_sha256  # of the tokenizer rpt trained with: `train.init_from` checks it
        self.initializer_range, self.use_cache = initializer_range, use_cache  # the cache: the recurrent state
        self.hidden_size, self.num_hidden_layers = d_model, n_layers  # the names tools look for
        kwargs.setdefault("bos_token_id", eot_token_id)
        kwargs.setdefault("eos_token_id", eot_token_id)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
