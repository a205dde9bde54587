#!/usr/bin/env bash
# The prepared GPU check, run once on a CUDA machine (about 8 minutes on an H200):
#   1. the CUDA tests (pytest -m cuda): the strategy x storage matrix eager and as CUDA graphs against the
#      CPU's kept positions, adakv, --rerotate_positions and --prefill_chunk eager against the CPU (a batch's
#      rows with their chunks packed too, never run on a GPU), the
#      batched step's graph, no recompilation over 256 steps, logits parity with transformers, a left-padded
#      batch through transformers' generate and the adapter's cache against the CPU (never run on a GPU yet);
#   1b. H2O's received attention (heavy_hitter's prefill) at the 8B heads: the blocks against the fused passes;
#   1c. prompts of different lengths prefilled packed into one forward pass against row by row (8B shapes,
#      16 prompts of 64-544 tokens, heavy_hitter at 0.25): prefill tokens/s, kept positions and logits equal;
#      then the batch decoded 16 steps against each prompt's batch-1 run (greedy tokens, held positions,
#      logits): whether a GPU batch's bf16 rows keep what they keep alone (cuBLAS picks its kernels by the
#      batch's shape, so they may not; never measured);
#   2. eval.bench on random weights with Llama-3.1-8B's shapes in bf16: ours eager and compiled, the full
#      cache at 4k and 32k and recent_global at 10% at 32k, then the strategies whose prefill needs the
#      prompt's attention or whose step was the slowest (heavy_hitter, hybrid, duo_attention, qfilters,
#      kvzip, lagkv, rkv; compactor, simlayerkv, curdkv, capkv, cam, keyformer, vatp, sepllm, morphkv, lacache and d2o,
#      never run on a GPU, last) at 10% at 4k;
#      decode tok/s, ms/step, compile seconds, peak GPU memory, fraction of the bandwidth bound (measured in the
#      same run), and torch.profiler's kernel time by kind for the full cache and the 10% rows (--profile_steps).
#      transformers' rows and every other strategy were measured on 2026-12-04 (docs/gpu_check_2026-12-04)
#      and left out to fit the lent time;
#   3. the batched bench under a memory cap, same shapes, 32k-token prompts: the full cache and
#      recent_global at 10%, each at the largest batch whose caches fit the GPU's memory less the
#      weights and a headroom for prefill (the cap in the report), compiled and replayed as a CUDA graph
#      per configuration, tokens/s summed over the rows, the ratio to the full cache and the bandwidth
#      bound's prediction;
#   4. chunked vs one-shot prefill of 32k and 128k-token prompts at a budget of 8192 (benchmarks.prefill_memory):
#      peak CUDA memory and prefill tokens/s, and the 32k rows' kernel time by kind (torch.profiler, one more
#      prefill each: where the chunked prefill's time goes, unprofiled so far).
# The timeouts sum to 685 s; on 2026-12-04 (second run) the parts took 92 s, 188 s, 34 s and over 100 s (the chunked
# prefill's last row, heavy_hitter at 128k, still running when a 110 s limit cut it in the follow-up); the
# received-attention part (after the tests) came later, estimated at 20-30 s, unmeasured.
# The bench's rows come in order of importance, so a run cut by its timeout keeps the first.
# Writes gpu_check.md (and the raw files, ~40 of them) into out_dir (default $OUT, else results/gpu_check).
# Nothing is downloaded. Where only a few files come back from a lent machine, run it into a scratch folder and
# bring back one archive (as on 2026-12-04):
#   bash benchmarks/gpu_check.sh /tmp/gc; tar czf "$OUT/gpu_check.tgz" -C /tmp gc; cp /tmp/gc/gpu_check.md "$OUT"
#   bash benchmarks/gpu_check.sh [out_dir]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-results/gpu_check}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
REPORT="$OUT_DIR/gpu_check.md"
{
  echo "# GPU check, $(date -u +%Y-%m-%d)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  echo '```'
} > "$REPORT"

# The CUDA tests in 8 processes (the device machine has 16 cores; each compiled case is a cold triton compile
# of a few seconds, ~65 of them), round-robin over the collected test ids; no pytest plugin needed. Two torch
# threads each: with torch's default (every core) the 8 processes' CPU references oversubscribed the 16
# cores, and on 2026-12-04 each got through about a third of its tests in 150 s (all of them in 55-72 s with 2).
# 120 s each: eval's compiled run on CUDA (three more compiles in one process) joined after that run.
start=$(date +%s)
$PY -m pytest --collect-only -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>/dev/null | grep '::' \
  > "$OUT_DIR/cuda_test_ids.txt"
WORKERS=8
for i in $(seq 0 $((WORKERS - 1))); do
  awk -v n=$WORKERS -v i="$i" 'NR % n == i' "$OUT_DIR/cuda_test_ids.txt" > "$OUT_DIR/cuda_tests_$i.ids"
  (
    mapfile -t ids < "$OUT_DIR/cuda_tests_$i.ids"
    OMP_NUM_THREADS=2 TORCHINDUCTOR_COMPILE_THREADS=2 timeout 120 $PY -m pytest -q -m cuda -p no:cacheprovider -rfE "${ids[@]}" \
      > "$OUT_DIR/cuda_tests_$i.txt" 2>&1
    echo $? > "$OUT_DIR/cuda_tests_$i.rc"
  ) &
done
wait
tests_rc=$(cat "$OUT_DIR"/cuda_tests_*.rc | sort -n | tail -1)
cat "$OUT_DIR"/cuda_tests_[0-9]*.txt > "$OUT_DIR/cuda_tests.txt"
{
  echo
  echo "## CUDA tests (pytest -m cuda tests/test_cuda.py, $(wc -l < "$OUT_DIR/cuda_test_ids.txt") collected, \
$WORKERS processes, worst exit $tests_rc, $(( $(date +%s) - start )) s)"
  echo
  echo '```'
  grep -hE "^(FAILED|ERROR)" "$OUT_DIR/cuda_tests.txt" | head -40
  grep -hE "(passed|failed|skipped|error).* in [0-9.]+s" "$OUT_DIR"/cuda_tests_[0-9]*.txt
  echo '```'
} >> "$REPORT"

# H2O's received attention at the 8B heads, blocks against the fused passes (the GPUs' default since
# 2026-12-04, never timed on a GPU before this): a whole prompt of 4k and 32k tokens, and a chunked prefill's
# re-prefill (8192 held tokens + a chunk of 4096, the chunk's queries counted). Random q and k, no model.
start=$(date +%s)
{
  timeout 25 $PY -m benchmarks.received_attention --device cuda --dtype bfloat16 --lengths 4096 32768 \
    --repeats 3 --out "$OUT_DIR/received_attention.json" --overwrite
  timeout 20 $PY -m benchmarks.received_attention --device cuda --dtype bfloat16 --lengths 12288 \
    --first_query 8192 --repeats 3 --out "$OUT_DIR/received_attention_chunk.json" --overwrite
} > "$OUT_DIR/received_attention.txt" 2>&1
{
  echo
  echo "## benchmarks.received_attention, Llama-3.1-8B's heads, bf16, ms per layer ($(( $(date +%s) - start )) s)"
  echo
  cat "$OUT_DIR/received_attention.txt"
} >> "$REPORT"

# Prompts of different lengths prefilled packed into one forward pass against row by row (heavy_hitter at 0.25).
start=$(date +%s)
timeout 75 $PY -m benchmarks.batched_prefill --device cuda --random_weights llama-3.1-8b --dtype bfloat16 \
  --prompts 16 --min_tokens 64 --step_tokens 32 --rounds 3 --decode_steps 16 \
  --out "$OUT_DIR/batched_prefill.json" --overwrite \
  > "$OUT_DIR/batched_prefill.txt" 2>&1
packed_rc=$?
{
  echo
  echo "## benchmarks.batched_prefill, llama-3.1-8b shapes, bf16, 16 prompts of 64-544 tokens, 16 steps decoded (exit $packed_rc, \
$(( $(date +%s) - start )) s)"
  echo
  echo '```'
  tail -6 "$OUT_DIR/batched_prefill.txt"
  echo '```'
} >> "$REPORT"

start=$(date +%s)
timeout 225 $PY -m eval.bench --device cuda --random_weights llama-3.1-8b --dtype bfloat16 \
  --contexts 4096 --no_hf --strategy_contexts 4096 --budgets 0.1 --speedup_budget 0.1 \
  --strategies recent_global heavy_hitter hybrid duo_attention qfilters kvzip lagkv rkv compactor simlayerkv curdkv capkv cam keyformer vatp sepllm morphkv lacache d2o \
  --speedup_contexts 32768 --bound_contexts --new_tokens 128 --recompile_steps 256 --profile_steps 16 \
  --out_dir "$OUT_DIR/bench" --overwrite > "$OUT_DIR/bench_log.txt" 2>&1
bench_rc=$?
{
  echo
  echo "## eval.bench, llama-3.1-8b shapes, random bf16 weights (exit $bench_rc, $(( $(date +%s) - start )) s)"
  echo
  if [ -f "$OUT_DIR/bench/bench.md" ]; then
    grep -E "read bandwidth" "$OUT_DIR/bench_log.txt"
    echo
    cat "$OUT_DIR/bench/bench.md"
  else
    echo "The run did not finish; the rows it measured:"
    echo '```'
    cat "$OUT_DIR/bench/bench.partial.jsonl" 2>/dev/null
    echo '```'
  fi
  echo
  echo '```'
  grep -iE "warning|error|Traceback" "$OUT_DIR/bench_log.txt" | tail -20
  echo '```'
} >> "$REPORT"

# The cap: the GPU's memory, less the 8B weights (16.1e9 bytes in bf16) and 12e9 bytes for prefill's
# activations and the batch-1 row a batch is copied from (eval/bench/batched.py).
CAP=$($PY -c "import torch; print(round(torch.cuda.get_device_properties(0).total_memory / 1e9 - 16.1 - 12, 1))")
start=$(date +%s)
timeout 60 $PY -m eval.bench --device cuda --random_weights llama-3.1-8b --dtype bfloat16 \
  --batch_sizes 1 8 16 24 28 32 64 128 256 --kv_memory_gb "$CAP" --batch_context 32768 \
  --strategies recent_global --budgets 0.1 --speedup_budget 0.1 --new_tokens 32 \
  --out_dir "$OUT_DIR/batched" --overwrite > "$OUT_DIR/batched_log.txt" 2>&1
batched_rc=$?
{
  echo
  echo "## eval.bench --batch_sizes, llama-3.1-8b shapes, bf16, 32k prompts, cap $CAP GB (exit $batched_rc, $(( $(date +%s) - start )) s)"
  echo
  if [ -f "$OUT_DIR/batched/bench.md" ]; then
    grep -E "read bandwidth" "$OUT_DIR/batched_log.txt"
    echo
    cat "$OUT_DIR/batched/bench.md"
  else
    echo '```'
    tail -20 "$OUT_DIR/batched_log.txt"
    echo '```'
  fi
} >> "$REPORT"

# Chunked prefill at the 8B shape: peak CUDA memory and prefill speed at 4x and 16x a budget of 8192 tokens
# (32k and 128k-token prompts), one shot where it runs in reasonable time (32k), chunks of 4096; the 32k rows
# profiled (one more prefill per row: 1.5-8.5 s at the speeds of the last run, an estimate).
start=$(date +%s)
timeout 160 $PY -m benchmarks.prefill_memory --device cuda --random_weights llama-3.1-8b --dtype bfloat16 \
  --strategies recent_global heavy_hitter --budget 8192 --chunk 4096 --lengths 32768 131072 --one_shot_max 32768 \
  --profile_lengths 32768 --out "$OUT_DIR/prefill_memory.json" --overwrite > "$OUT_DIR/prefill_memory.txt" 2> "$OUT_DIR/prefill_memory_log.txt"
memory_rc=$?
{
  echo
  echo "## benchmarks.prefill_memory, llama-3.1-8b shapes, bf16, budget 8192, chunks of 4096 (exit $memory_rc, \
$(( $(date +%s) - start )) s)"
  echo
  cat "$OUT_DIR/prefill_memory.txt"
  grep -E '^\{' "$OUT_DIR/prefill_memory_log.txt" | tail -6
  grep -iE "error|Traceback" "$OUT_DIR/prefill_memory_log.txt" | tail -5
} >> "$REPORT"
cat "$REPORT"
