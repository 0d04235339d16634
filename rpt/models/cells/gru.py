"""Classic GRU (Cho et al. 2014), PyTorch's formulation and gate layout (r, z, n).

This module holds the parameters (in torch's layout, so that cuDNN takes them as they are); the step is the spec,
rpt/ops/gru/spec.py, and the sequence runs in rpt/ops/gru/sequence.py in the form the backend picks (cuDNN or
a Triton loop on a GPU, rpt's fused kernel with C++ time loops on the CPU).
"""

from rpt.models.cells.base import GatedRNNCell
from rpt.models.registry import register_cell
from rpt.ops.gru import sequence
from rpt.ops.gru.spec import gru_step


@register_cell("gru")
class GRU(GatedRNNCell):
    n_gates = 3
    options = ("heads",)
    export_spec = "rpt.ops.gru.spec"
    native_loops = True

    def __init__(self, d_model: int, d_hidden: int = 0, heads: int = 1):
        super().__init__(d_model, d_hidden, heads=heads)

    def state_shapes(self):
        return [(self.d_hidden,)]

    def step(self, x_t, state):
        h, state = gru_step(x_t, state, self.w_ih, self.step_weight(), self.b_ih, self.b_hh, self.linear)
        return self._out(h), state

    def forward(self, x, state=None, reset=None):
        state = state if state is not None else self.init_state(x.shape[0], x.device, x.dtype)
        y, state = sequence.forward(self, x, state, reset)
        return self._out(y), state
