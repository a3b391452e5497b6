#!/bin/bash
# The next H200 session's runs, planned in session 12 (no device was lent then).
# Each stage fits one 10-minute device command; run from the repository root with
#   carry [".whl"] (../shared/tools/prep-device-wheels.sh) and ADVISOR_GIT_SHA set:
#   ADVISOR_GIT_SHA=<sha> bash benchmarks/next_gpu_session.sh tune
# with the sha written out here, before the call: `git rev-parse` on the device answers a
# stale commit (session 27 runs D-F recorded 94cfc9a for f4e13f1).
# Stages:
#   tune    analyze at 1/512 (ANALYZE_S=0 skips it); a tune seeded per bucket with RECIPE and
#           SEEDS (plan files), TRIALS per bucket (4), resuming JOURNAL if given
#           -> $OUT/llama_hf-<card>.json (h200 or h100)
#   bench   RECIPE (default the committed one; pass tune's output) vs eager and both
#           torch.compile modes at 1/128/512/2048: latency, kernels, cold start fields
#   ablate  each family of RECIPE toggled at 1/512, for predicted-vs-measured savings
#   predict issue 7's predicted-vs-measured: analyze at PREDICT_SHAPES (default 1,512), its probe
#           running RECIPE's kernel configs (analyze --recipe), then
#           each family of RECIPE timed alone on the unfused model there (bench --alone), and
#           the predicted-vs-measured table (advisor report); PREDICT_ABLATE=1 adds the
#           leave-one-out in the same bench (~190 s more at 1/512: raise ALONE_S); REPEATS=N
#           times each alone / leave-one-out row over N applies (median; ablate too)
#   all     one ~580 s command: analyze 1/512, bench RECIPE at 1/128/512/2048, the rope_table
#           plan at 1 token, ablate 1/512, four memory-bound kernels at 2048/8192
#   coldstart  benchmarks/cold_start.py in fresh processes at 1 token, cold then warm caches:
#           PLAN (default RECIPE: on another card, pass one whose environment is empty; per
#           COLD_THREADS confirmation-thread count; "manifest": PLAN with its kernels
#           recorded first, $OUT/recorded.json) and torch.compile reduce-overhead
#           -> $OUT/coldstart-*.json
#   attention  attention_probe.py at 512/2048/8192: ours + RoPE vs RoPE + SDPA, eager/compiled;
#           SDPA and ours reading the materialised causal mask, and ours on it marked causal
#   prefill profile_prefill.py: kernels per forward, RECIPE vs reduce-overhead (PROFILE_TOKENS;
#           PROFILE_ARGS=--compile-first profiles compile first, for order effects)
#   deep    profile_prefill.py of RECIPE and of the GEMM-family plan at 512/2048 (no compile)
#   pack    last: every file under $OUT into 0-all.tgz, first by name (the device returns 8
#           files at most, by name); JSONs kept beside it while they fit, logs dropped
#   gemmsites  each GEMM site of the GEMM-family plan (QKV, gate/up, o, down, lm_head) at
#           512/2048 rows: plain vs persistent TMA tiles, cuBLAS + ops, compile
#   order   profile_prefill.py at PROFILE_TOKENS (512) twice: advisor first, then compile first
#   otherplans  OTHER (a recipe tuned on another card) re-stamped with this device's
#           environment, benched without compile baselines (beside a `bench` of RECIPE)
#   explicit  benchmarks/explicit_attention_probe.py, then check_spellings.py on the written-out
#           attention models (Gemma2, GptOss, nanogpt-attention, LlamaMHAEager) (~220 s)
#   sweepdebug  family_sweep.py --ops --bisect on session 29's GPU-only failures (SWEEP_FAMILIES),
#           then the same with ADVISOR_CONFIRM_THREADS=1, then in fp32 (~350 s)
#   sweep   family_sweep.py over every causal-LM family of transformers (or SWEEP_FAMILIES)
#   gpt2    examples/gpt2_hf.py (GPT-2 medium): the GEMM-epilogue plan against eager and
#           reduce-overhead at 1/128/512, then GPT2_PLANS (norm-gemm: LayerNorm in c_attn's and
#           c_fc's GEMM; light; residual-epilogues) without compile (~330 s)
#   lnkernels  bench_kernels.py layernorm_linear at 1-512 rows, Llama-like and GPT-2 widths (~300 s)
#   gemmtiles  benchmarks/gemm_tile_probe.py: a grid of GEMM tiles / split-K at 128 and 512 rows on
#           GPT-2's narrow-N sites and Llama's o_proj, against the default and cuBLAS + op (~330 s)
#   plans   each of PLANS (plan or recipe files) benched at BENCH_SHAPES (128,512), no compile
#           baselines -> $OUT/bench-<name>.json
#   probetiming  benchmarks/probe_timing.py at PROBE_TOKENS (1): the probe's sites of PROBE_FAMILIES
#           timed interleaved / sequential / from cold / reversed / with RECIPE's configs; then
#           the kernels per forward (CUDA graph, no compile) of the unfused model and of
#           PROBE_FAMILIES alone with RECIPE's configs: what a site's kernels cost in a forward
#   spellings  benchmarks/check_spellings.py: the spellings matched since session 25 (Phi-3, partial
#           rotary, gpt-fast / Meta RoPE), apply vs eager on the GPU (SPELL_S, default 150 s)
#   fp32    benchmarks/fp32_probe.py: each matrix kernel in fp32 (GEMV, tl.dot, TMA paths) against
#           float64, beside eager's own error (the fp32 sites refused in check_spellings)
#   kernels issue 3's memory-bound kernels at 2048/8192 (default configs), then issue 6's
#           GEMM variants at 128/512/2048 against cuBLAS + ops and torch.compile (sweep 4)
set -u
# Several stages run in order in one command: ... next_gpu_session.sh coldstart tune
[ $# -ge 1 ] || { echo "stage: tune, bench, ablate, predict, coldstart, attention, prefill, deep, gemmsites, kernels, order, otherplans, probetiming, spellings, fp32, explicit, sweepdebug, sweep, gpt2, lnkernels, gemmtiles, plans, all or pack" >&2; exit 2; }
RECIPE=${RECIPE:-recipes/llama_hf-h200.json}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
: "${ADVISOR_GIT_SHA:?set ADVISOR_GIT_SHA, the git fallback on the device is stale}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
model=examples/llama_hf.py
card=$(grep -q H200 "$OUT/gpu.txt" && echo h200 || echo h100)  # a recipe is per card
for stage in "$@"; do
case $stage in
tune)
  if [ "${ANALYZE_S:-140}" != 0 ]; then
    timeout ${ANALYZE_S:-140} python3 -m advisor.cli analyze $model --shapes 1,512 \
      --json "$OUT/analysis.json" > "$OUT/analyze.log" 2>&1
    echo "analyze rc=$?" >> "$OUT/analyze.log"; tail -4 "$OUT/analyze.log"; fi
  # JOURNAL: an earlier call's study journal (from its 0-all.tgz, carried), resumed here
  [ -n "${JOURNAL:-}" ] && cp "$JOURNAL" "$OUT/llama_hf-$card.json.journal"
  # TUNE_S - 90 s of search, TUNE_S hard stop: the journal keeps finished trials past a kill
  timeout ${TUNE_S:-420} python3 -m advisor.cli tune $model --shapes 1,128,512,2048 --trials ${TRIALS:-4} \
    --time-budget $(( ${TUNE_S:-420} - 90 )) --seed-plan "$RECIPE" \
    $(for s in ${SEEDS-recipes/prefill-light-attention-cudagraph.plan.json recipes/decode-swiglu-table-pdl-cudagraph.plan.json}; do
        echo --seed-plan "$s"; done) \
    --out "$OUT/llama_hf-$card.json" > "$OUT/tune.log" 2>&1
  echo "tune rc=$?" >> "$OUT/tune.log"
  tail -30 "$OUT/tune.log" ;;
bench)
  timeout ${BENCH_S:-570} python3 -m advisor.cli bench $model --recipe "$RECIPE" --shapes ${BENCH_SHAPES:-1,128,512,2048} \
    --compile ${BENCH_COMPILE:-default,reduce-overhead} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" >> "$OUT/bench.log"; tail -40 "$OUT/bench.log" ;;
ablate)
  timeout ${ABLATE_S:-$(( 400 * ${REPEATS:-1} ))} python3 -m advisor.cli bench $model --recipe "$RECIPE" --shapes ${ABLATE_SHAPES:-1,512} \
    --compile none --ablate --repeats ${REPEATS:-1} --json "$OUT/ablate.json" > "$OUT/ablate.log" 2>&1
  echo "ablate rc=$?" >> "$OUT/ablate.log"
  tail -40 "$OUT/ablate.log" ;;  # then, here: advisor report --analysis … --bench ablate.json
predict)
  timeout ${ANALYZE_S:-200} python3 -m advisor.cli analyze $model --shapes ${PREDICT_SHAPES:-1,512} \
    --recipe "$RECIPE" --json "$OUT/analysis.json" > "$OUT/analyze.log" 2>&1
  echo "analyze rc=$?" >> "$OUT/analyze.log"; tail -2 "$OUT/analyze.log"
  timeout ${ALONE_S:-$(( 330 * ${REPEATS:-1} ))} python3 -m advisor.cli bench $model --recipe "$RECIPE" --shapes ${PREDICT_SHAPES:-1,512} \
    --compile none --alone ${PREDICT_ABLATE:+--ablate} --repeats ${REPEATS:-1} --json "$OUT/alone.json" \
    > "$OUT/alone.log" 2>&1
  echo "alone rc=$?" >> "$OUT/alone.log"; tail -3 "$OUT/alone.log"
  python3 -m advisor.cli report --analysis "$OUT/analysis.json" --bench "$OUT/alone.json" \
    --out "$OUT/predict.html" 2>&1 | tail -32 ;;
lnkernels)  # layernorm_linear (session 33) on the GPU: correctness against its reference, then
  # default vs a 4-config sweep vs eager LayerNorm + addmm and compile, at Llama-like widths
  # (LN -> QKV, 4096 -> 12288) and GPT-2 medium's c_fc (1024 -> 4096, a transposed view is
  # not what the registry makes: plain (N, K) here)
  timeout ${LN_S:-150} python3 benchmarks/bench_kernels.py --tokens 1,4,16,128,512 --sweep 4 \
    --kernels layernorm_linear > "$OUT/kernels-ln.log" 2>&1
  mv "$OUT/kernels.json" "$OUT/kernels-ln.json"
  timeout ${LN_S:-150} python3 benchmarks/bench_kernels.py --tokens 1,4,16,128,512 --sweep 4 \
    --kernels layernorm_linear --dims K=1024,N=4096 > "$OUT/kernels-ln-gpt2.log" 2>&1
  mv "$OUT/kernels.json" "$OUT/kernels-ln-gpt2.json"
  tail -24 "$OUT/kernels-ln.log" "$OUT/kernels-ln-gpt2.log" ;;
kernels)
  timeout ${MEMORY_S:-200} python3 benchmarks/bench_kernels.py --tokens 2048,8192 --sweep 0 \
    --kernels rms_norm,add_rms_norm,layer_norm,add_layer_norm,gated_act,gated_act_merged,bias_act,rope_qk,rope_qk_cache \
    > "$OUT/kernels-memory.log" 2>&1
  mv "$OUT/kernels.json" "$OUT/kernels-memory.json"
  timeout ${GEMM_S:-350} python3 benchmarks/bench_kernels.py --tokens 128,512,2048 --sweep 4 \
    --kernels gemm_epilogue,gemm_swiglu,gemm_rmsnorm,rmsnorm_swiglu > "$OUT/kernels-gemm.log" 2>&1
  mv "$OUT/kernels.json" "$OUT/kernels-gemm.json"
  tail -20 "$OUT/kernels-memory.log" "$OUT/kernels-gemm.log" ;;
all)  # one device command of ~580 s when the budget allows only one: measure, do not tune.
  # Each step's limit in seconds can be set (0 skips it): ANALYZE_S BENCH_S TABLE_S ABLATE_S KERNELS_S
  log="$OUT/run.log"; cat "$OUT/gpu.txt" > "$log"; rm "$OUT/gpu.txt"
  step() { echo "=== $(date +%T) $1" >> "$log"; }
  if [ "${ANALYZE_S:-130}" != 0 ]; then step analyze
    timeout "${ANALYZE_S:-130}" python3 -m advisor.cli analyze $model --shapes 1,512 --json "$OUT/analysis.json" >> "$log" 2>&1
    echo "analyze rc=$?" >> "$log"; fi
  if [ "${BENCH_S:-200}" != 0 ]; then step bench
    timeout "${BENCH_S:-200}" python3 -m advisor.cli bench $model --recipe "$RECIPE" --shapes 1,128,512,2048 \
      --compile default,reduce-overhead --json "$OUT/bench.json" >> "$log" 2>&1
    echo "bench rc=$?" >> "$log"; fi
  if [ "${TABLE_S:-60}" != 0 ]; then step bench-table1
    timeout "${TABLE_S:-60}" python3 -m advisor.cli bench $model --recipe recipes/decode-swiglu-table-pdl-cudagraph.plan.json \
      --shapes 1 --compile none --json "$OUT/bench-table1.json" >> "$log" 2>&1
    echo "bench-table1 rc=$?" >> "$log"; fi
  if [ "${ABLATE_S:-120}" != 0 ]; then step ablate
    timeout "${ABLATE_S:-120}" python3 -m advisor.cli bench $model --recipe "$RECIPE" --shapes 1,512 \
      --compile none --ablate --json "$OUT/ablate.json" >> "$log" 2>&1
    echo "ablate rc=$?" >> "$log"; fi
  if [ "${KERNELS_S:-60}" != 0 ]; then step kernels
    timeout "${KERNELS_S:-60}" python3 benchmarks/bench_kernels.py --tokens 2048,8192 --sweep 0 \
      --kernels gated_act_merged,gated_act,rms_norm,layer_norm >> "$log" 2>&1; fi
  step done; tail -60 "$log" ;;
attention)  # issue 6: ours + RoPE against RoPE + SDPA (eager and compiled), default config
  # ATTENTION_CONFIGS: tiles to time too, e.g. 128x64w8s3,128x64w8s3t (t: k, v by TMA)
  timeout ${ATTENTION_S:-90} python3 benchmarks/attention_probe.py --tokens ${ATTENTION_TOKENS:-512,2048,8192} \
    --configs ${ATTENTION_CONFIGS:-none} --no-check > "$OUT/attention.log" 2>&1
  tail -8 "$OUT/attention.log" ;;
prefill)  # kernels per forward, RECIPE vs torch.compile reduce-overhead, 128/512/2048
  timeout ${PROFILE_S:-200} python3 benchmarks/profile_prefill.py --recipe "$RECIPE" \
    --tokens ${PROFILE_TOKENS:-128,512,2048} ${PROFILE_ARGS:-} > "$OUT/profile-prefill.log" 2>&1
  echo "profile rc=$?" >> "$OUT/profile-prefill.log"; grep -v "^    " "$OUT/profile-prefill.log" | tail -8 ;;
deep)  # where the GEMM-family plan loses in the model (session 16 run D): kernels per forward
  for plan in "$RECIPE" recipes/prefill-deep-gemm-cudagraph.plan.json; do
    n=$(basename "$plan" .json)
    timeout ${DEEP_S:-120} python3 benchmarks/profile_prefill.py --recipe "$plan" --no-compile \
      --tokens ${PROFILE_TOKENS:-512,2048} --json "profile-$n.json" > "$OUT/profile-$n.log" 2>&1
    echo "$n rc=$?"; grep -v "^    " "$OUT/profile-$n.log" | tail -4
  done ;;
coldstart)
  PLAN=${PLAN:-$RECIPE}  # a recipe's one-token bucket is traced static (a plan file: symbolic)
  # COLD_THREADS: confirmation threads per advisor variant ("1 default": one at a time, then
  # rewrite.confirm_workers'; "default-nosetup": without Triton's setup thread); each
  # variant and compile get fresh cache folders, cold then warm; "manifest": see below
  # "manifest": PLAN with the kernels its buckets compile (record-kernels, in caches of its
  # own), so apply compiles them in forked workers while the first call traces
  if [[ " ${COLD_THREADS:-default} " == *" manifest "* ]]; then
    TRITON_CACHE_DIR=$(mktemp -d) timeout ${RECORD_S:-150} python3 -m advisor.cli record-kernels $model \
      --recipe "$PLAN" --out "$OUT/recorded.json" ${RECORD_SHAPES:+--shapes $RECORD_SHAPES} >> "$OUT/coldstart.log" 2>&1
    echo "record rc=$?"; tail -1 "$OUT/coldstart.log"
  fi
  for threads in ${COLD_THREADS:-default} compile; do
    export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    for cache in cold warm; do
      if [ "$threads" = manifest ]; then
        timeout 120 python3 benchmarks/cold_start.py --recipe "$OUT/recorded.json" --tokens 1 \
          --json "$OUT/coldstart-advisor-manifest-$cache.json" >> "$OUT/coldstart.log" 2>&1
      elif [ "$threads" = compile ]; then
        timeout 120 python3 benchmarks/cold_start.py --compile reduce-overhead --tokens 1 \
          --json "$OUT/coldstart-compile-ro-$cache.json" >> "$OUT/coldstart.log" 2>&1
      else
        ADVISOR_CONFIRM_THREADS=$([ "$threads" = default ] || echo "${threads%-nosetup}") \
          ADVISOR_TRITON_SETUP=$([[ "$threads" == *-nosetup ]] && echo 0 || echo 1) timeout 120 \
          python3 benchmarks/cold_start.py --recipe "$PLAN" --tokens 1 \
          --json "$OUT/coldstart-advisor-t$threads-$cache.json" >> "$OUT/coldstart.log" 2>&1
      fi
    done
  done
  unset TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR
  grep " to first forward" "$OUT/coldstart.log" ;;
gemmsites)  # each GEMM site of the deep plan at its in-model shape: default TMA tiles against
  # the plain and persistent TMA forms, cuBLAS + ops and torch.compile (SITE_TOKENS, SITE_ONLY)
  for site in "qkv gemm_rmsnorm" "gateup rmsnorm_swiglu" "o gemm_epilogue" \
              "down gemm_epilogue K=14336" "lmhead gemm_rmsnorm N=128256" \
              "gateup_plain gemm_epilogue N=28672,residual=0"; do  # gate/up's work, one accumulator
    read -r name kernel dims <<< "$site"
    [[ -z "${SITE_ONLY:-}" || ",$SITE_ONLY," == *",$name,"* ]] || continue
    timeout ${SITE_S:-110} python3 benchmarks/bench_kernels.py --tokens ${SITE_TOKENS:-512,2048} --sweep 0 \
      --kernels "$kernel" --dims "$dims" --over "${SITE_OVER:-TMA=1;TMA=2}" \
      --json "kernels-site-$name.json" > "$OUT/kernels-site-$name.log" 2>&1
    echo "== $name rc=$?"; grep -v "^/\|warn" "$OUT/kernels-site-$name.log" | tail -5
  done ;;
order)  # prefill profile at PROFILE_TOKENS in both orders (advisor first, then compile first):
  # is a GEMM slower in one variant's forward than in the other's because of its place in the run?
  for first in ours compile; do
    timeout ${PROFILE_S:-120} python3 benchmarks/profile_prefill.py --recipe "$RECIPE" \
      --tokens ${PROFILE_TOKENS:-512} $([ $first = compile ] && echo --compile-first) \
      --json "profile-prefill-$first-first.json" > "$OUT/profile-prefill-$first-first.log" 2>&1
    echo "$first first rc=$?"; grep -v "^    " "$OUT/profile-prefill-$first-first.log" | tail -4
  done ;;
otherplans)  # OTHER (a recipe tuned on another card) with this device's environment, no
  # compile baselines: its plans against RECIPE's (bench them in the same command)
  python3 -c "import json, sys, torch; from advisor.env import environment
r = json.load(open(sys.argv[1])); r['environment'] = {k: v for k, v in environment(torch.device('cuda')).items()
    if k in r['environment']}; json.dump(r, open(sys.argv[2], 'w'), indent=1)" "$OTHER" "$OUT/other-plans.json"
  timeout ${OTHER_S:-150} python3 -m advisor.cli bench $model --recipe "$OUT/other-plans.json" \
    --shapes ${BENCH_SHAPES:-1,128,512,2048} --compile none --json "$OUT/bench-other-plans.json" \
    > "$OUT/bench-other-plans.log" 2>&1
  echo "other plans rc=$?"; tail -12 "$OUT/bench-other-plans.log" ;;
explicit)  # session 28's written-out attention on the GPU: eager vs compile vs our kernel at
  # Gemma-2-9B / Llama-3-8B shapes, then the spellings that reach it (softcap, sinks, drops)
  timeout ${EXPLICIT_S:-100} python3 benchmarks/explicit_attention_probe.py > "$OUT/explicit-probe.log" 2>&1
  echo "explicit probe rc=$?"; tail -4 "$OUT/explicit-probe.log"
  timeout ${SPELL_S:-120} python3 benchmarks/check_spellings.py Gemma2 GptOss nanogpt-attention LlamaMHAEager \
    > "$OUT/spellings.log" 2>&1
  echo "spellings rc=$?"; grep "'model'" "$OUT/spellings.log" | cut -c1-300 ;;
sweepdebug)  # session 29's GPU-only sweep failures (doge SDPA, flex_olmo wrong; falcon SDPA
  # without attention): the traced attention ops and matches, each family alone, and the
  # same with confirmations one at a time (ADVISOR_CONFIRM_THREADS=1: threads are GPU-only)
  F=${SWEEP_FAMILIES:-doge,flex_olmo,falcon}
  OUT=$OUT/debug timeout ${SWEEP_S:-150} python3 benchmarks/family_sweep.py --only $F --jobs 6 --timeout 140 \
    --ops --bisect --alone attention_rope,attention,rope > "$OUT/sweepdebug.log" 2>&1
  echo "sweepdebug rc=$?"; cut -c1-300 "$OUT/sweepdebug.log"
  ADVISOR_CONFIRM_THREADS=1 OUT=$OUT/threads1 timeout 100 python3 benchmarks/family_sweep.py --only $F \
    --jobs 6 --timeout 95 > "$OUT/sweep-threads1.log" 2>&1
  echo "threads=1 rc=$?"; cut -c1-200 "$OUT/sweep-threads1.log"
  # (4) routing: both are MoE with top-2 of 4 experts; a bf16 rounding that flips a routing
  # is not a kernel's error. In fp32 a flip needs a near-tie.
  OUT=$OUT/fp32 timeout 100 python3 benchmarks/family_sweep.py --only $F --jobs 6 --timeout 95 \
    --dtype float32 > "$OUT/sweep-fp32.log" 2>&1
  echo "fp32 rc=$?"; cut -c1-200 "$OUT/sweep-fp32.log" ;;
sweep)  # benchmarks/family_sweep.py over every causal-LM family (SWEEP_FAMILIES to narrow)
  OUT=$OUT/sweep timeout ${SWEEP_S:-560} python3 benchmarks/family_sweep.py --jobs 8 --timeout 150 \
    ${SWEEP_FAMILIES:+--only $SWEEP_FAMILIES} > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$?"; grep -v '"ok"' "$OUT/sweep.log" | grep -v unbuilt | cut -c1-300; tail -1 "$OUT/sweep.log" ;;
gemmtiles)  # benchmarks/gemm_tile_probe.py: tiles and split-K at 128/512 rows, narrow N (session 32)
  timeout ${TILES_S:-330} python3 benchmarks/gemm_tile_probe.py --budget-s $(( ${TILES_S:-330} - 60 )) \
    ${TILE_SITES:+--sites $TILE_SITES} ${TILE_ROWS:+--rows $TILE_ROWS} \
    > "$OUT/gemm-tile-probe.log" 2>&1
  echo "gemmtiles rc=$?"; grep " M=" "$OUT/gemm-tile-probe.log" | cut -c1-300 ;;
gpt2)  # a second family end to end: Conv1D epilogues, LayerNorm, attention (session 31)
  timeout ${GPT2_S:-220} python3 -m advisor.cli bench examples/gpt2_hf.py \
    --recipe recipes/gpt2-epilogues-cudagraph.plan.json --shapes 1,128,512 --compile reduce-overhead \
    --json "$OUT/bench-gpt2-epilogues.json" > "$OUT/bench-gpt2-epilogues.log" 2>&1
  echo "gpt2 rc=$?"; tail -8 "$OUT/bench-gpt2-epilogues.log"
  for p in ${GPT2_PLANS:-norm-gemm light residual-epilogues}; do
    timeout 80 python3 -m advisor.cli bench examples/gpt2_hf.py --recipe recipes/gpt2-$p-cudagraph.plan.json \
      --shapes 1,128,512 --compile none --no-truth --json "$OUT/bench-gpt2-$p.json" > "$OUT/bench-gpt2-$p.log" 2>&1
    echo "gpt2 $p rc=$?"; done ;;
plans)  # each plan or recipe in PLANS benched at BENCH_SHAPES, no compile baselines: plans
  # side by side in one command (put the recipe they should beat first)
  for p in $PLANS; do n=$(basename "$p" .json)
    timeout ${PLAN_S:-120} python3 -m advisor.cli bench $model --recipe "$p" --shapes ${BENCH_SHAPES:-128,512} \
      --compile none --no-truth --json "$OUT/bench-$n.json" > "$OUT/bench-$n.log" 2>&1
    echo "$n rc=$?"; tail -6 "$OUT/bench-$n.log"; done ;;
probetiming)  # does the probe's timing method (or its default config) move a site's saving?
  fams=${PROBE_FAMILIES:-linear_residual,add_rms_norm_swiglu,add_rms_norm_linear}
  timeout ${PROBE_S:-200} python3 benchmarks/probe_timing.py --recipe "$RECIPE" --tokens ${PROBE_TOKENS:-1} \
    --families $fams > "$OUT/probe-timing.log" 2>&1
  echo "probe timing rc=$?"; tail -3 "$OUT/probe-timing.log"
  python3 -c "import json, sys; from advisor.runtime.recipe import load_recipe
bucket = load_recipe(sys.argv[1]).bucket_for(int(sys.argv[2])); fams = sys.argv[3].split(',')
plan = bucket.plan if bucket else sys.exit('the recipe runs unfused at this length')
for name, on in (('unfused', []), ('alone', fams)):
    json.dump({'schema_version': 1, 'kind': 'advisor.plan', 'fusions': on, 'cuda_graph': True,
               'configs': {f: c for f, c in plan.configs.items() if f in on}}, open(f'/tmp/{name}.plan.json', 'w'))
" "$RECIPE" ${PROBE_TOKENS:-1} $fams
  for n in unfused alone; do
    timeout ${PROFILE_S:-90} python3 benchmarks/profile_prefill.py --recipe /tmp/$n.plan.json --no-compile \
      --tokens ${PROBE_TOKENS:-1} --json "profile-probe-$n.json" > "$OUT/profile-probe-$n.log" 2>&1
    echo "$n rc=$?"; grep -v "^    " "$OUT/profile-probe-$n.log" | tail -2
  done ;;
spellings)  # session 25's spellings (Phi-3, partial rotary, gpt-fast/Meta RoPE) on the GPU
  timeout ${SPELL_S:-150} python3 benchmarks/check_spellings.py > "$OUT/spellings.log" 2>&1
  echo "spellings rc=$?" >> "$OUT/spellings.log"; tail -3 "$OUT/spellings.log" ;;
fp32)  # why fp32 GEMM-family sites fail confirmation on the GPU (benchmarks/fp32_probe.py)
  timeout ${FP32_S:-120} python3 benchmarks/fp32_probe.py --json "$OUT/fp32-probe.json" > "$OUT/fp32.log" 2>&1
  echo "fp32 rc=$?" >> "$OUT/fp32.log"; grep -c -- "<--" "$OUT/fp32.log"; tail -3 "$OUT/fp32.log" ;;
pack)
  (cd "$OUT" && tar czf /tmp/0-all.tgz . && mv /tmp/0-all.tgz . \
    && find . -type f ! -name 0-all.tgz ! -name '*.json' -delete \
    && ls *.json 2>/dev/null | tail -n +8 | xargs -r rm -f; ls) ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
done
