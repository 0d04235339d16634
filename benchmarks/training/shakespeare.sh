#!/usr/bin/env bash
# Quality per second on tiny-shakespeare (issue 4): prepare, train for 130 s, print the summary path last.
# Target: val_bpb <= 2.05 (nanoGPT's CPU recipe: 2.72 bits/byte in the same 130 s on this machine).
#
#   bash benchmarks/training/shakespeare.sh [extra rpt train flags, e.g. --set model.cell=mingru]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TEXT=${RPT_SHAKESPEARE:-../shared/data/tinyshakespeare/input.txt}
"$PY" -m rpt prepare --input "$TEXT" --out data/shakespeare-512 --vocab-size 512 >&2
RUN=runs/shakespeare-bench-$(date +%Y%m%d-%H%M%S)
"$PY" -m rpt train --config configs/shakespeare-bench.toml --run-dir "$RUN" --set train.max_time=130 "$@" | tail -n 1
