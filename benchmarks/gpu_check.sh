#!/usr/bin/env bash
# The device check of a session that is lent a GPU: one prepared script, every part under its own
# timeout, its logs packed into $OUT, a short table last. It runs under the GPU machine's own python3 and torch
# (not the CPU pin of the Makefile); rpt is used from the working tree.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh             # on the GPU machine
#   OUT=/tmp/gpu QUICK=1 bash benchmarks/gpu_check.sh     # a dry run of the script itself on the CPU
#   ONLY="prepare train-bf16" bash benchmarks/gpu_check.sh  # some parts only (a second call of a lease)
#
# The GPU machine has no network and its image lacks tomli_w (ninja, tokenizers, triton are there): carry its
# wheel in .whl/ (git-ignored through .git/info/exclude), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl tomli_w==1.2.0 fla-core==0.6.0 einops==0.8.2
# and the device tool's call (carry [".whl"], timeout_s 560):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site && OUT=$OUT bash benchmarks/gpu_check.sh
#
# $OUT ends with two files (the device tool brings back only a few): summary.md, and logs.tgz with
# every part's log and the runs (metrics stores, summaries, profiler traces; no checkpoints).
#
# Parts, in order of what matters most if time runs out:
#   1. probe: the GPU, torch, and the measured matmul peaks (fp32, tf32, bf16)
#   2. benchmarks/cells/triton_speed.py: rpt's cells on their GPU paths (issue 27's Triton loops, the modlstm's CUDA-graph
#      step loop) against cuDNN's nn.LSTM, each path first checked against its reference loop
#   3. training runs at a GPU-sized shape (4 x 1024, bf16): lstm, mingru, modlstm with 16 heads, dense modlstm,
#      each with its top GPU kernels over three profiled steps (tools/trace_top.py)
#   4. tests/models, the scan and the mlstm forms on the GPU (RPT_TEST_DEVICE=cuda): every cell's fast path against its reference
#   5. benchmarks/cells/speed.py on the GPU (issue 3's table, generation memory); benchmarks/cells/gdn_library.py
#      (flash-linear-attention's gdn kernel against rpt's chunkwise form); benchmarks/cells/compiled.py
#   6. rpt train on the GPU: fp32, bf16 (with a profiled range), fp16 with loss scaling; exact resume; a mixed job
#   7. the run report of every run, and trainer overhead against a minimal loop
set -u
OUT=${OUT:-/tmp/rpt-gpu-check}
WORK=${WORK:-/tmp/rpt-gpu-work}
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
QUICK=${QUICK:-0}
if [ "$QUICK" = 1 ]; then DEV=cpu; STEPS=40; BIG="model.d_model=64"; else DEV=cuda; STEPS=300; BIG="model.d_model=1024"; fi
SUMMARY=$OUT/summary.md
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
DEADLINE=${DEADLINE:-480}  # seconds: later parts are skipped so that the logs are packed in time
part() {  # part NAME SECONDS COMMAND...: run one part under a timeout, its log in $WORK/NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 1; fi
    if [ $((SECONDS + 10)) -ge "$DEADLINE" ]; then note "- $name: skipped (deadline)"; return 1; fi
    [ $((SECONDS + limit)) -le "$DEADLINE" ] || limit=$((DEADLINE - SECONDS))
    timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    note "- $name: exit $rc in $((SECONDS - t0)) s"
    return $rc
}

part probe 150 $PY - <<EOF
import torch, time
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "available", torch.cuda.is_available())
dev = torch.device("$DEV")
if dev.type == "cuda":
    print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(dev).total_memory / 2**30, "GiB")
def peak(dtype, n, tf32=False):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    for _ in range(3): a @ b
    if dev.type == "cuda": torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10): a @ b
    if dev.type == "cuda": torch.cuda.synchronize()
    return 10 * 2 * n ** 3 / (time.perf_counter() - t) / 1e12
n = 8192 if dev.type == "cuda" else 512
print(f"PEAK fp32 {peak(torch.float32, n):.1f} tf32 {peak(torch.float32, n, True):.1f} "
      f"bf16 {peak(torch.bfloat16, n):.1f} TFLOP/s (n={n}, random data, mean of 10 after 3 warm-ups)")
import rpt.models  # noqa: F401  (registers the loops' check)
from rpt import kernels  # gru/modlstm time loops in C++: needs g++ and ninja (carry ninja's wheel)
t = time.perf_counter()
print(f"NATIVE loops built: {kernels.current().loops() is not None} ({time.perf_counter() - t:.0f} s)")
EOF
if [ -f "$WORK/probe.log" ]; then  # PEAK_BF16=797 stands in when the probe is not among ONLY's parts
    note "$(grep -E "^torch|PEAK|NATIVE" "$WORK/probe.log")"
    PEAK_BF16=$(sed -n 's/.*bf16 \([0-9.]*\) TFLOP.*/\1/p' "$WORK/probe.log")
fi
BF16_PEAK=${PEAK_BF16:-}

# the head-wise modlstm, lstm and gru on rpt's Triton loops against cuDNN's nn.LSTM (issue 27); a dry run: the interpreter
if [ "$QUICK" = 1 ]; then TRITON_RUN=(env TRITON_INTERPRET=1 $PY benchmarks/cells/triton_speed.py --quick --repeats 1)
else TRITON_RUN=($PY benchmarks/cells/triton_speed.py); fi
part triton-cells 300 "${TRITON_RUN[@]}"
grep -E "^\||reference|^tuned" "$WORK/triton-cells.log" >>"$SUMMARY"

part prepare 60 $PY -m rpt prepare --out data/stdlib
RUNS=$WORK/runs
rm -rf "$RUNS"
COMMON=(--config configs/demo-cpu.toml --device "$DEV" --set train.max_time=0 --set train.eval_interval=0
        --set train.eval_tokens=65536 --set monitor.log_interval=25)
BIGSET=(--set "$BIG" --set model.n_layers=4 --set train.batch_size=64 --set train.seq_len=256
        --set train.precision=bf16 --set monitor.log_interval=10 --profile 60:62)
part big-lstm 75 $PY -m rpt train "${COMMON[@]}" "${BIGSET[@]}" --set train.max_steps=80 --run-dir "$RUNS/big-lstm"
part big-mingru 75 $PY -m rpt train "${COMMON[@]}" "${BIGSET[@]}" --set model.cell=mingru --set train.max_steps=80 \
    --run-dir "$RUNS/big-mingru"
# the modlstm with 16 heads of 64 units: its time loop in rpt/ops/modlstm/triton.py (issue 27)
part big-modlstm-heads 75 $PY -m rpt train "${COMMON[@]}" "${BIGSET[@]}" --set model.cell=modlstm \
    --set model.heads=16 --set train.max_steps=80 --run-dir "$RUNS/big-modlstm-heads"
# the dense modlstm (one head of 1024 units): a product and one Triton kernel a step, each loop one CUDA graph
part big-modlstm 75 $PY -m rpt train "${COMMON[@]}" "${BIGSET[@]}" --set model.cell=modlstm --set train.max_steps=80 \
    --run-dir "$RUNS/big-modlstm"
for run in big-lstm big-mingru big-modlstm-heads big-modlstm; do  # where each big step's GPU time went
    if [ -f "$RUNS/$run/traces/rank0.json" ]; then
        $PY tools/trace_top.py "$RUNS/$run" --top 8 >>"$SUMMARY" 2>&1
        rm -rf "$RUNS/$run/traces"  # tens of MB: logs.tgz must stay under the device tool's 16 MiB a file
    fi
done

if [ "$QUICK" = 1 ]; then
    note "- models-tests: skipped in a dry run"
else
    RPT_TEST_DEVICE=cuda part models-tests 150 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/models tests/ops/minrnn/test_minrnn_scan.py tests/ops/mlstm
    note "  $(tail -1 "$WORK/models-tests.log")"
    grep -E "^FAILED|Error" "$WORK/models-tests.log" | head -20 | tee -a "$SUMMARY"
fi

if [ "$QUICK" = 1 ]; then CELLS_ARGS="--repeats 1 --gen-tokens 10,50 --device cpu"; else CELLS_ARGS="--repeats 3"; fi
part cells 130 $PY benchmarks/cells/speed.py $CELLS_ARGS
grep -E "^\||matmul peak" "$WORK/cells.log" >>"$SUMMARY"

# modlstm's fused kernel compiled whole with CUDA graphs (mode="reduce-overhead") against eager: its per-step launches
part gdn-fla 90 $PY benchmarks/cells/gdn_library.py  # flash-linear-attention's gdn kernel against rpt's form
part compiled-cells 90 $PY benchmarks/cells/compiled.py --device "$DEV" --repeats $([ "$QUICK" = 1 ] && echo 2 || echo 10)
grep -E "^\|" "$WORK/compiled-cells.log" >>"$SUMMARY"

part train-fp32 60 $PY -m rpt train "${COMMON[@]}" --set train.max_steps=$STEPS --run-dir "$RUNS/fp32"
part train-bf16 60 $PY -m rpt train "${COMMON[@]}" --set train.max_steps=$STEPS --set train.precision=bf16 \
    --profile 20:23 --run-dir "$RUNS/bf16"
part train-fp16 60 $PY -m rpt train "${COMMON[@]}" --set train.max_steps=$STEPS --set train.precision=fp16 \
    --run-dir "$RUNS/fp16"
for cell in gru modlstm; do  # their CUDA paths under autocast: cuDNN GRU, the fused modlstm kernel
    part "train-$cell" 60 $PY -m rpt train "${COMMON[@]}" --set train.max_steps=$STEPS --set train.precision=bf16 \
        --set model.cell=$cell --run-dir "$RUNS/$cell-bf16"
done
# the same fp32 run again: how far two uninterrupted GPU runs drift apart (the floor for the resume check)
part train-fp32-again 60 $PY -m rpt train "${COMMON[@]}" --set train.max_steps=$STEPS --run-dir "$RUNS/fp32-again"
# exact resume: the fp32 run again, SIGKILLed after its checkpoint at half the steps (same schedule:
# the learning rate follows max_steps), then resumed, against the uninterrupted fp32 run above
HALF=$((STEPS / 2))
RPT_FAULT=kill@$HALF part resume-a 60 $PY -m rpt train "${COMMON[@]}" --set train.max_steps=$STEPS \
    --set checkpoint.interval=$HALF --run-dir "$RUNS/resumed"
part resume-b 60 $PY -m rpt train --run-dir "$RUNS/resumed" --resume --device "$DEV"
$PY - "$RUNS" <<'EOF' | tee -a "$SUMMARY"
import json, sqlite3, sys
from pathlib import Path
runs = Path(sys.argv[1])
def losses(run):
    db = sqlite3.connect(f"file:{runs / run / 'metrics.sqlite'}?mode=ro", uri=True)
    return dict(db.execute("SELECT step, loss FROM train"))
for other in ("resumed", "fp32-again"):
    try:
        a, b = losses("fp32"), losses(other)
        common = sorted(set(a) & set(b))
        late = [s for s in common if s > max(common) // 2]
        diff = max(abs(a[s] - b[s]) for s in late)
        va, vb = (json.loads((runs / r / "summary.json").read_text())["val_loss"] for r in ("fp32", other))
        print(f"- {other} vs fp32: max |train loss difference| over steps {late[0]}..{late[-1]}: {diff:.3g}; "
              f"final val loss {va:.6f} vs {vb:.6f}")
    except Exception as exc:
        print(f"- {other} vs fp32: could not compare: {exc}")
EOF

# a job that mixes a GPU rank and a CPU rank (issue 4): both on gloo, started by hand as torchrun would start them
mixed_rank() {  # mixed_rank RANK DEVICE
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29617 WORLD_SIZE=2 RANK=$1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
        $PY -m rpt train "${COMMON[@]/$DEV/$2}" --set train.max_steps=40 --run-dir "$RUNS/mixed"
}
mixed_pair() { mixed_rank 1 cpu & local other=$!; mixed_rank 0 "$DEV"; local rc=$?; wait $other || rc=$?; return $rc; }
part mixed 120 bash -c "$(declare -p COMMON RUNS PY DEV); $(declare -f mixed_rank mixed_pair); mixed_pair"
note "  $(grep -h -o 'mixes CPU and GPU ranks' "$WORK/mixed.log" | head -1); digests: \
$(grep -h -o 'parameter digest [0-9a-f]\{12\}' "$RUNS"/mixed/logs/rank*.log | tr '\n' ' ')"

$PY tools/run_report.py "$RUNS"/{fp32,fp32-again,bf16,fp16,gru-bf16,modlstm-bf16,resumed,mixed,big-lstm,big-mingru,big-modlstm-heads,big-modlstm} \
    ${BF16_PEAK:+--peak-tflops $BF16_PEAK} | tee -a "$SUMMARY"

part overhead 75 $PY benchmarks/architecture/train_overhead.py --data data/stdlib --device "$DEV" --steps $((STEPS / 2)) --rounds 2
tail -3 "$WORK/overhead.log" | tee -a "$SUMMARY"
part overhead-big 75 $PY benchmarks/architecture/train_overhead.py --data data/stdlib --device "$DEV" --steps 40 --rounds 2 \
    --set "$BIG" --set model.n_layers=4 --set train.batch_size=64 --set train.seq_len=256 --set train.precision=bf16
tail -3 "$WORK/overhead-big.log" | tee -a "$SUMMARY"
tar czf "$OUT/logs.tgz" --exclude checkpoints -C "$WORK" .
echo "=============== summary"
cat "$SUMMARY"
