"""The stack around the recurrent cells: spec.py (the recurrent matrix of heads, sliding-window attention, the gated
MLP, the two-level head's log-probabilities, the depth loop's injection, in plain torch)."""
