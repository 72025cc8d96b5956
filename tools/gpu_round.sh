#!/usr/bin/env bash
# One device call of the open GPU work, each under ten minutes, logs and results in $OUT.
# Run in the repository root of the device's copy, with gpu_bundle/ and vllm_bundle/
# carried (tools/stage_gpu_bundle.sh, tools/stage_vllm_bundle.sh):
#   bash tools/gpu_round.sh bench   # LBHNC 8 and 4 KiB, uniform and vLLM's pool ids, beside decode (~8 min)
#   bash tools/gpu_round.sh suite   # the GPU suite, the layouts' page reads, the prefill loop, the overlap hint (~9 min)
# Each step has a time limit, so a step that hangs leaves the others their time.
set -u
part=${1:?usage: tools/gpu_round.sh bench|suite}
source tools/gpu_host_setup.sh
export PYTHONUNBUFFERED=1
: "${OUT:?OUT: the folder whose files come back}"
case $part in
  bench)
    timeout 540 python3 bench/vllm_worker.py --layouts=tp8-8k,4k --kv_layouts=LBHNC \
      --block_ids=uniform,vllm_pool --directions=store,load \
      --methods=vllm_worker,pages,pages_rows8,pages_rows16 \
      --out="$OUT/vllm_worker_lbhnc_bands.json" > "$OUT/bench.log" 2>&1
    echo "bench exit $?"
    grep -E "beside|alone" "$OUT/bench.log" | cut -c1-200
    ;;
  suite)
    KVOFFLOAD_TEST_SCALE=0.2 timeout 230 python3 -m pytest -v -n 15 -p no:cacheprovider tests \
      --ignore=tests/meter_gpu_test.py > "$OUT/suite.log" 2>&1
    echo "suite exit $?"; tail -1 "$OUT/suite.log"; grep -E "FAILED|ERROR" "$OUT/suite.log" | head -20
    timeout 40 python3 bench/layout_reads.py --out="$OUT/layout_reads.json" > "$OUT/layout_reads.log" 2>&1
    echo "layout_reads exit $?"; grep "GB/s" "$OUT/layout_reads.log"
    timeout 150 python3 bench/vllm_worker.py --layouts=tp8-8k --kv_layouts=LBHNC --block_ids=uniform \
      --directions=store,load --methods=pages,pages_rows16 --workload=model \
      --out="$OUT/vllm_worker_lbhnc_prefill.json" > "$OUT/prefill.log" 2>&1
    echo "prefill exit $?"; grep -E "beside" "$OUT/prefill.log" | cut -c1-200
    timeout 100 python3 bench/vllm_worker.py --layouts=tp8-8k --kv_layouts=LBHNC --block_ids=uniform \
      --directions=store,load --methods=pages,pages_row_batches_overlap \
      --out="$OUT/vllm_worker_lbhnc_overlap.json" > "$OUT/overlap.log" 2>&1
    echo "overlap exit $?"; grep -E "beside" "$OUT/overlap.log" | cut -c1-200
    ;;
  *)
    echo "tools/gpu_round.sh: expected bench or suite, got $part" >&2
    exit 2
    ;;
esac
