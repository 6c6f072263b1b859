#!/usr/bin/env bash
# Device sweeps for SBI-GeMM in CUDA C++ and the large-T / prefill work (issues 3 and 5),
# each under 10 minutes (one device call). Logs go to OUT (default $OUT, else
# bench/results/sweep), packed into one archive with the tables the run wrote.
#
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh dense [OUT]
#       the CUDA SBI-GeMM's tests first (a broken kernel stops the sweep), the other GPU
#       tests these changes touch, then bench_dense with --write-table (DENSE_TOKENS,
#       DENSE_MODELS and DENSE_LIMIT narrow it)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh decode [OUT]
#       the read ceiling of small weights (diag_read.py), the OLMoE dense table, then decode
#       (OLMoE, Qwen3; bf16 and int8) and the OLMoE prefill with the tables in place
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh tests [OUT]
#       the GPU tests of everything these changes touch, on the final tables
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh moedec [OUT]
#       the CUDA MoE decode kernels' tests first, OLMoE decode at batch 1 with parts
#       switched off (diag_decode_ab.py), decode with the profile (OLMoE, Qwen3; bf16, int8)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh normqkv [OUT]
#       the fused add + RMSNorm + QKV GEMM's tests, OLMoE decode A/B (that fusion and the
#       gating inside the MoE kernels switched on), Qwen3 decode, then decode-path tests
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh attn [OUT]
#       the one-launch decode attention's tests first, OLMoE decode A/B (the parts in $AB,
#       default: the early PDL trigger and the one-launch attention each switched off), then
#       decode_more (OLMoE int8, Qwen3 bf16 and int8)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh attntests [OUT]
#       the GPU tests of the decode path (attention, GEMMs, MoE, engine), then the OLMoE
#       decode profile at batch 1
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh moetests [OUT]
#       the GPU tests these changes touch, bench_moe at T = 1 and 8 with baselines
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh moesmall [OUT]
#       the CUDA MoE decode kernels' tests first, tune_moe --cuda-only at T = 2..16 (the
#       pair-major grid and the register caps among the candidates) for $TUNE_SHAPES
#       (default qwen3,olmoe: two shapes fill one call; dsmoe,mixtral in the next),
#       bench_moe at T = 1..16 on the new table
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh unit [OUT]
#       the CUDA MoE decode kernels' tests first (int8 widened by one permute among them),
#       tune_moe --cuda-only --verbose for int8 at T = 1 on Qwen3, OLMoE and DS-MoE (the
#       ``unit`` variants among the candidates), bench_moe at T = 1 on the new table
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh mma [OUT]
#       the int8 CUDA MoE kernels' tests on the tensor-core kernels first, tune_moe
#       --cuda-only --only mma for int8 at $TUNE_TOKENS (default 1) on $TUNE_SHAPES (default
#       Qwen3, OLMoE, DS-MoE), bench_moe at T = 1 on the new table
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh mixunit [OUT]
#       on an H200: the int8 SBI-GeMM widened by one permute and the Mixtral-sized int8 MoE
#       cases first, the Mixtral dense table at T = 1 (bench_dense --write-table), then
#       tune_moe --cuda-only --only mma for Mixtral int8 at T = 1
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh mmah100 [OUT]
#       the unit SBI-GeMM, quantization and int8 MoE graph tests, tune_moe --cuda-only
#       --only mma for int8 at T = 1 on $TUNE_SHAPES (default DS-MoE, Qwen3), bench_moe at
#       T = 1 twice
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh ncu [OUT]
#       Nsight Compute on the MoE experts at T = 1 (diag_profile.py): Qwen3 int8 and bf16 on
#       the table, Qwen3 int8 on the tensor-core pair, DS-MoE int8; each pair's graph time first
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh scales [OUT]
#       the CUDA MoE kernels' GPU tests (as moecheck), the int8 pairs of the table at T = 1 timed
#       (diag_profile.py: Qwen3, OLMoE, DS-MoE), bench_moe at T = 1, tune_moe --cuda-only --only
#       unit for int8 at T = 1 on $TUNE_SHAPES (default Qwen3, DS-MoE), bench_moe at T = 1 again,
#       then Nsight Compute on Qwen3's int8 pair
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh sbiscales [OUT]
#       the CUDA SBI-GeMM's GPU tests, bench_dense at T = 1 on OLMoE and Qwen3 (bf16 and int8
#       candidates, the table left as it is), bench_moe at T = 1
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh fit [OUT]
#       tune_moe --cuda-only for int8 at T = 1 on $TUNE_SHAPES (default DS-MoE; every CUDA
#       candidate), bench_dense at T = 1 on Qwen3 with --write-table, bench_moe at T = 1
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh t8 [OUT]
#       tune_moe --cuda-only --only unit for Qwen3 int8 at T = 8 (the CUDA kernels with the
#       one-permute widen, pair-major or not, against the table's Triton pair), bench_moe at
#       T = 8 on Qwen3, then OLMoE decode at batch 1 (bf16, int8)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh final13 [OUT]
#       the decode-path GPU tests (engine, default model), bench_moe at T = 1 and 8 on every
#       shape, Qwen3 decode at batch 1 (bf16, int8)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh context [OUT]
#       the decode context kernel's GPU tests and the decode-path tests (engine, default model,
#       fused decode), then OLMoE decode at batch 1 alternating: the one-launch context, and
#       torch's ops (diag_decode_ab.py --off fused-context), twice each
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh t8pair [OUT]
#       tune_moe --cuda-only --only unit for int8 at T = 8 on $TUNE_SHAPES (default Qwen3; each
#       CUDA up timed beside its companion CUDA down), then bench_moe at T = 8 on the new table
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh t8final [OUT]
#       the CUDA MoE kernels' GPU tests (as moecheck, with the several-pairs cases), t8pair's tune
#       for OLMoE, then bench_moe at T = 1 and 8 on Qwen3, OLMoE and DS-MoE
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh moecheck [OUT]
#       the CUDA MoE kernels' GPU tests (int8 cases with the tensor-core pairs, gating inside
#       the kernels, graphs, split-K, fallbacks) and the layer's graph test, bench_moe at T = 1
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh unit8 [OUT]
#       the int8 reference cases of the CUDA MoE decode kernels' tests, tune_moe --cuda-only
#       for int8 at T = 1 (Qwen3, a second pass) and 8 (Qwen3, OLMoE), bench_moe at T = 1
#       and 8 twice
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh caps8 [OUT]
#       the Qwen3 int8 case and graph tests, tune_moe --cuda-only for int8 at T = 1 (Qwen3,
#       DS-MoE) with a cap of 8 blocks an SM among the candidates, bench_moe at T = 1 twice
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh route [OUT]
#       the routing and CUDA MoE tests first, the host cost of each launch (diag_launch),
#       tune_moe for int8 at T = 8 (Qwen3, OLMoE; deeper int8 tiles), bench_moe at T = 1, 8
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh decodesizes [OUT]
#       the GPU tests of routing, the launcher, the MoE layer and graph decode, the host
#       cost of each launch, bench_moe at T = 1..16, OLMoE decode at batch 1 and 8
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh mixtral [OUT]
#       on an H200: tune_moe --cuda-only for Mixtral at T = 1 (bf16, int8), the Mixtral dense
#       table at T = 1, then Mixtral decode at batch 1, int8 (with the profile) and bf16
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh mixtralab [OUT]
#       on an H200: Mixtral decode at batch 1, int8 and bf16 in alternating processes, 3 each
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh mixtralon [OUT]
#       on an H200: tune_moe --cuda-only --verbose for Mixtral at T = 1, then Mixtral decode
#       at batch 1 (int8, bf16) with each routing fusion switched on in turn (diag_decode_ab)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh moe [OUT]
#       tune_moe at large T (TMA weight tiles among the candidates), bench_moe at large T,
#       the OLMoE prefill profile and decode at batch 1
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh ceiling [OUT]
#       the CUDA MoE kernels' GPU tests (as t8final), the decode step's pure-read ceiling per
#       launch structure (diag_step_ceiling.py: OLMoE, Qwen3), then OLMoE decode at batch 1
#       (bf16, int8) for the real step's replay beside it
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh critical [OUT]
#       the pure-read skeleton's critical path per kind of launch (OLMoE), then the real batch-1
#       step's per kernel (diag_step_ceiling.py --real: OLMoE bf16 and int8, Qwen3 bf16)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh preload [OUT]
#       the decode attention, norm + router and gating GPU tests, the real OLMoE step's critical
#       path, OLMoE decode at batch 1 alternating: as is, --off preload-kv, --off router-preload
#       (diag_decode_ab.py), then the real Qwen3 step's critical path
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh ncuattn [OUT]
#       Nsight Compute on the decode attention kernel inside the real batch-1 step (OLMoE, Qwen3)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh attn2 [OUT]
#       the decode attention's and the decode path's GPU tests, the real batch-1 step's critical
#       path and replay (OLMoE, Qwen3; bf16, int8), OLMoE decode at batch 1 (bf16)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh final14 [OUT]
#       the decode path's and gating's GPU tests, the real OLMoE step's critical path, OLMoE
#       decode at batch 1 (bf16, int8)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh final15 [OUT]
#       the decode path's GPU tests, the real batch-1 step's critical path (OLMoE, Qwen3; bf16, int8)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh final15b [OUT]
#       decode at batch 1, OLMoE and Qwen3, bf16 and int8 (bench_decode.py)
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh peer [OUT]
#       decode against the transformers peer (bench_decode.py --peer, our model freed before
#       the peer loads): OLMoE at batch 1 and 8, Qwen3 at batch 1
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sbi.sh peermix [OUT]
#       on an H200: Mixtral-8x7B at batch 1 against the transformers peer, as peer
set -uo pipefail
part=${1:?dense or moe}
out=${2:-${OUT:-bench/results/sweep}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_step.sh"
touch "$out/.start"  # the result files written after this come back with the logs
# decode_more NEW_TOKENS REPS [LIMIT]: OLMoE int8 at batch 1 and 8, Qwen3 bf16 and int8 at batch 1.
decode_more() {
    TAIL=6 step olmoe_int8 ${3:-60} python scripts/bench_decode.py --model olmoe-1b-7b --quantize int8 --batches 1,8 \
        --new-tokens "$1" --reps "$2"
    for q in "" int8; do
        TAIL=6 step qwen3_${q:-bf16} 100 python scripts/bench_decode.py --model qwen3-30b-a3b ${q:+--quantize $q} \
            --batches 1 --new-tokens "$1" --reps "$2"
    done
}
pytest_gpu="python -m pytest -q -p no:cacheprovider --color=no -m gpu"
# moe_cuda_tests LIMIT: the CUDA MoE kernels' GPU tests (int8 cases with every tensor-core pair
# where the shape allows, gating inside the kernels, graphs, split-K, fallbacks) and the layer's
# graph test.
moe_cuda_tests() {
    TAIL=8 step gpu_tests "$1" $pytest_gpu tests/test_moe_cuda.py \
        tests/test_moe_kernels.py::test_moe_layer_in_cuda_graph_matches_eager \
        -k "${SMOKE:-True and bfloat16 and (1-2048-768 or 1-528 or 3-2048 or 16-256) or gating or graph or split \
        or fall}"
}
# attention_paths TEST_LIMIT RUN_LIMIT: the decode attention's and the decode path's GPU tests, then
# the real batch-1 step's critical path (OLMoE, Qwen3; bf16, int8).
attention_paths() {
    TAIL=4 step gpu_tests "$1" $pytest_gpu tests/test_qkv_attention.py tests/test_fused_decode.py tests/test_engine.py \
        tests/test_default_model.py
    for model in olmoe-1b-7b qwen3-30b-a3b; do
        for q in bf16 int8; do
            TAIL=17 step "real_${model}_$q" "$2" python scripts/diag_step_ceiling.py --real --models $model \
                $([ $q = int8 ] && echo --quantize int8)
        done
    done
}
if [ "$part" = dense ]; then
    TAIL=6 step sbi_smoke 150 $pytest_gpu -x tests/test_sbi_cuda.py -k "graph or 1-200-24" || true
    if grep -q " passed" "$out/sbi_smoke.log" && ! grep -q "failed\|error" "$out/sbi_smoke.log"; then
        TAIL=8 step gpu_tests 200 $pytest_gpu tests/test_sbi_cuda.py tests/test_quant.py tests/test_fused_decode.py \
            tests/test_moe_kernels.py -k "not test_moe_kernels or weight_tiles or tile_order"
        TAIL=40 step dense ${DENSE_LIMIT:-230} python scripts/bench_dense.py --no-attention --write-table \
            ${DENSE_TOKENS:+--tokens $DENSE_TOKENS} ${DENSE_MODELS:+--models $DENSE_MODELS}
        cp kernels/configs/dense.json "$out/"
    fi
elif [ "$part" = moedec ]; then
    TAIL=6 step moe_smoke 150 $pytest_gpu -x tests/test_moe_cuda.py -k "gating or graph or table" || true
    if grep -q " passed" "$out/moe_smoke.log" && ! grep -q "failed\|error" "$out/moe_smoke.log"; then
        ab="python scripts/diag_decode_ab.py --model olmoe-1b-7b --batches 1 --new-tokens 128 --reps 5"
        for v in none moe-cuda route-in cuda-pdl none moe-cuda; do
            TAIL=3 step "ab_$v" 60 $ab $([ $v = none ] || echo --off $v)
            cat "$out/ab_$v.log" >> "$out/ab.log"
        done
        TAIL=45 step olmoe 100 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1,8 --new-tokens 128 \
            --reps 5 --profile
        decode_more 128 5 120
    fi
elif [ "$part" = normqkv ]; then
    TAIL=6 step norm_smoke 120 $pytest_gpu -x tests/test_sbi_cuda.py -k "norm_linear" || true
    if grep -q " passed" "$out/norm_smoke.log" && ! grep -q "failed\|error" "$out/norm_smoke.log"; then
        ab="python scripts/diag_decode_ab.py --model olmoe-1b-7b --batches 1 --new-tokens 128 --reps 5"
        for v in none norm-in-qkv none route-in none; do
            TAIL=3 step "ab_$v" 60 $ab $([ $v = none ] || echo --on $v)
            cat "$out/ab_$v.log" >> "$out/ab.log"
        done
        TAIL=6 step qwen3_bf16 100 python scripts/bench_decode.py --model qwen3-30b-a3b --batches 1 \
            --new-tokens 128 --reps 5
        TAIL=8 step gpu_tests 120 $pytest_gpu tests/test_fused_decode.py tests/test_engine.py -k "measured_off or graph"
    fi
elif [ "$part" = attn ]; then
    TAIL=6 step attn_smoke 200 $pytest_gpu -x tests/test_qkv_attention.py tests/test_fused_decode.py \
        tests/test_sbi_cuda.py tests/test_moe_cuda.py -k "${SMOKE:-qkv_attention and bf16 or one_launch or graph or table}" \
        || true
    if grep -q " passed" "$out/attn_smoke.log" && ! grep -q "failed\|error" "$out/attn_smoke.log"; then
        ab="python scripts/diag_decode_ab.py --model olmoe-1b-7b --batches 1 --new-tokens 128 --reps 5"
        for v in ${AB:-none off-pdl-early off-fused-attention none}; do
            TAIL=3 step "ab_$v" 70 $ab $([ $v = none ] || echo "--${v%%-*} ${v#*-}")
            cat "$out/ab_$v.log" >> "$out/ab.log"
        done
        decode_more 128 5 90
    fi
elif [ "$part" = attntests ]; then
    TAIL=10 step gpu_tests 400 $pytest_gpu tests/test_qkv_attention.py tests/test_fused_decode.py tests/test_engine.py \
        tests/test_default_model.py tests/test_quant.py tests/test_moe_cuda.py \
        tests/test_moe_kernels.py::test_moe_layer_in_cuda_graph_matches_eager tests/test_sbi_cuda.py \
        -k "not test_sbi_cuda or graph or 1-200-24"
    TAIL=45 step olmoe_profile 150 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1 --new-tokens 128 \
        --reps 3 --profile
elif [ "$part" = moetests ]; then
    TAIL=8 step gpu_tests 400 $pytest_gpu tests/test_moe_cuda.py tests/test_fused_decode.py tests/test_engine.py \
        tests/test_quant.py tests/test_moe_kernels.py::test_moe_layer_in_cuda_graph_matches_eager \
        tests/test_sbi_cuda.py -k "not test_sbi_cuda or graph or 1-200-24"
    TAIL=30 step moe 150 python scripts/bench_moe.py --tokens 1,8 --no-json
elif [ "$part" = moesmall ]; then
    TAIL=6 step moe_smoke 100 $pytest_gpu -x tests/test_moe_cuda.py -k "${SMOKE:-bfloat16 and 1-4096 or graph or table}" || true
    if grep -q " passed" "$out/moe_smoke.log" && ! grep -q "failed\|error" "$out/moe_smoke.log"; then
        TAIL=30 step tune 330 python scripts/tune_moe.py --cuda-only --shapes ${TUNE_SHAPES:-qwen3,olmoe} \
            --tokens 2,4,8,16 --int8-tokens 2,4,8,16
        cp kernels/configs/moe.json "$out/"
        TAIL=30 step moe 130 python scripts/bench_moe.py --tokens 1,2,4,8,16 --no-baselines --no-json
    fi
elif [ "$part" = unit ]; then
    TAIL=6 step moe_smoke 200 $pytest_gpu -x tests/test_moe_cuda.py -k "${SMOKE:-1-2048-768 and True and bfloat16 or graph}" || true
    if grep -q " passed" "$out/moe_smoke.log" && ! grep -q "failed\|error" "$out/moe_smoke.log"; then
        TAIL=12 step tune 250 python scripts/tune_moe.py --cuda-only --verbose --shapes qwen3,olmoe,dsmoe --tokens "" \
            --int8-tokens 1
        cp kernels/configs/moe.json "$out/"
        TAIL=12 step moe 80 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1 \
            --no-baselines --no-json
    fi
elif [ "$part" = caps8 ]; then
    TAIL=6 step moe_tests 100 $pytest_gpu tests/test_moe_cuda.py -k "1-2048-768 and True and bfloat16 or graph" || true
    TAIL=8 step tune 200 python scripts/tune_moe.py --cuda-only --shapes qwen3,dsmoe --tokens "" --int8-tokens 1
    cp kernels/configs/moe.json "$out/"
    for run in 1 2; do
        TAIL=10 step moe_$run 60 python scripts/bench_moe.py --shapes qwen3-30b-a3b,ds-moe-1.3b-e128 --tokens 1 \
            --no-baselines --no-json
    done
elif [ "$part" = mma ]; then
    TAIL=6 step moe_smoke 240 $pytest_gpu -x tests/test_moe_cuda.py \
        -k "${SMOKE:-1-2048-768 and True and bfloat16 or 1-528 and True and bfloat16}" || true
    if grep -q " passed" "$out/moe_smoke.log" && ! grep -q "failed\|error" "$out/moe_smoke.log"; then
        TAIL=12 step tune 220 python scripts/tune_moe.py --cuda-only --verbose --only mma \
            --shapes ${TUNE_SHAPES:-qwen3,olmoe,dsmoe} --tokens "" --int8-tokens ${TUNE_TOKENS:-1}
        cp kernels/configs/moe.json "$out/"
        TAIL=12 step moe 80 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1 \
            --no-baselines --no-json
    fi
elif [ "$part" = mixunit ]; then
    TAIL=6 step smoke 200 $pytest_gpu -x tests/test_sbi_cuda.py tests/test_moe_cuda.py \
        -k "${SMOKE:-cfg4 and dtype0 and not 4104 or 1-4096-1408 and True and bfloat16}" || true
    if grep -q " passed" "$out/smoke.log" && ! grep -q "failed\|error" "$out/smoke.log"; then
        TAIL=14 step dense 220 python scripts/bench_dense.py --models mixtral-8x7b --tokens 1 --no-attention \
            --write-table
        cp kernels/configs/dense.json "$out/"
        TAIL=10 step tune 120 python scripts/tune_moe.py --cuda-only --verbose --only mma --shapes mixtral --tokens "" \
            --int8-tokens 1
        cp kernels/configs/moe.json "$out/"
    fi
elif [ "$part" = mmah100 ]; then
    TAIL=6 step gpu_tests 200 $pytest_gpu tests/test_sbi_cuda.py tests/test_quant.py tests/test_moe_cuda.py \
        -k "${SMOKE:-cfg4 and dtype0 or test_quant or graph and True}" || true
    TAIL=10 step tune 200 python scripts/tune_moe.py --cuda-only --only mma --shapes ${TUNE_SHAPES:-dsmoe,qwen3} \
        --tokens "" --int8-tokens 1
    cp kernels/configs/moe.json "$out/"
    for run in 1 2; do
        TAIL=10 step moe_$run 60 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1 \
            --no-baselines --no-json
    done
elif [ "$part" = ncu ]; then
    sections="SpeedOfLight MemoryWorkloadAnalysis Occupancy LaunchStats WarpStateStats SchedulerStats SourceCounters"
    mma_pair='--up {"backend":"cuda","mma":true,"bn":16,"warps":4,"unroll":1}
              --down {"backend":"cuda","mma":true,"bn":16,"warps":4,"unroll":2,"split_k":1}'
    for case in "qwen3 int8" "qwen3 bf16" "qwen3 int8 mma" "dsmoe int8"; do
        set -- $case
        extra=$([ "${3:-}" = mma ] && echo "$mma_pair")
        name=${1}_${2}${3:+_$3}
        TAIL=2 step "time_$name" 60 python scripts/diag_profile.py --shape "$1" --dtype "$2" $extra
        TAIL=0 step "ncu_$name" 120 ncu --clock-control none -k regex:moe_ --launch-skip 8 --launch-count 2 \
            $(printf -- "--section %s " $sections) python scripts/diag_profile.py --no-graph --shape "$1" --dtype "$2" $extra
        grep -E "moe_|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|\
Warp Cycles Per Issued|No Eligible|Theoretical Occupancy|L2 Hit|Block Limit Registers" "$out/ncu_$name.log" | head -40
    done
elif [ "$part" = scales ]; then
    moe_cuda_tests 300
    for shape in qwen3 olmoe dsmoe; do
        TAIL=1 step "time_$shape" 60 python scripts/diag_profile.py --shape $shape --dtype int8
    done
    TAIL=10 step moe_1 60 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1 \
        --no-baselines --no-json
    TAIL=10 step tune 240 python scripts/tune_moe.py --cuda-only --only unit --shapes ${TUNE_SHAPES:-qwen3,dsmoe} \
        --tokens "" --int8-tokens 1
    cp kernels/configs/moe.json "$out/"
    TAIL=10 step moe_2 60 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1 \
        --no-baselines --no-json
    TAIL=0 step ncu 100 ncu --clock-control none -k regex:moe_ --launch-skip 8 --launch-count 2 --section SpeedOfLight \
        --section Occupancy python scripts/diag_profile.py --no-graph --shape qwen3 --dtype int8
    grep -E "^  moe_|Elapsed Cycles|SM Active Cycles|Duration|DRAM Throughput" "$out/ncu.log"
elif [ "$part" = sbiscales ]; then
    TAIL=6 step gpu_tests 240 $pytest_gpu tests/test_sbi_cuda.py tests/test_quant.py
    TAIL=14 step dense 200 python scripts/bench_dense.py --models olmoe-1b-7b,qwen3-30b-a3b --tokens 1 --no-attention
    TAIL=10 step moe 60 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1 \
        --no-baselines --no-json
elif [ "$part" = fit ]; then
    TAIL=6 step tune 270 python scripts/tune_moe.py --cuda-only --shapes ${TUNE_SHAPES:-dsmoe} --tokens "" \
        --int8-tokens 1 --verbose
    cp kernels/configs/moe.json "$out/"
    TAIL=10 step dense 150 python scripts/bench_dense.py --models qwen3-30b-a3b --tokens 1 --no-attention --write-table
    cp kernels/configs/dense.json "$out/"
    TAIL=10 step moe 60 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1 \
        --no-baselines --no-json
elif [ "$part" = t8 ]; then
    TAIL=6 step tune 300 python scripts/tune_moe.py --cuda-only --only unit --shapes qwen3 --tokens "" --int8-tokens 8
    cp kernels/configs/moe.json "$out/"
    TAIL=6 step moe 80 python scripts/bench_moe.py --shapes qwen3-30b-a3b --tokens 8 --no-baselines --no-json
    for q in "" int8; do
        TAIL=4 step olmoe_${q:-bf16} 80 python scripts/bench_decode.py --model olmoe-1b-7b ${q:+--quantize $q} \
            --batches 1 --new-tokens 64 --reps 3
    done
elif [ "$part" = final13 ]; then
    TAIL=4 step engine_tests 150 $pytest_gpu tests/test_engine.py tests/test_default_model.py
    TAIL=14 step moe 150 python scripts/bench_moe.py --tokens 1,8 --no-baselines --no-json
    for q in "" int8; do
        TAIL=4 step qwen3_${q:-bf16} 120 python scripts/bench_decode.py --model qwen3-30b-a3b ${q:+--quantize $q} \
            --batches 1 --new-tokens 64 --reps 3
    done
elif [ "$part" = context ]; then
    TAIL=4 step gpu_tests 200 $pytest_gpu tests/test_fused_decode.py tests/test_engine.py tests/test_default_model.py \
        tests/test_qkv_attention.py
    for run in 1 2; do
        for v in none fused-context; do
            TAIL=3 step "ab_${v}_$run" 90 python scripts/diag_decode_ab.py $([ $v = none ] || echo --off $v) \
                --model olmoe-1b-7b --batches 1 --new-tokens 64 --reps 3
        done
    done
elif [ "$part" = t8pair ]; then
    TAIL=6 step tune 420 python scripts/tune_moe.py --cuda-only --only unit --shapes ${TUNE_SHAPES:-qwen3} --tokens "" \
        --int8-tokens 8 --verbose
    cp kernels/configs/moe.json "$out/"
    TAIL=6 step moe 90 python scripts/bench_moe.py --shapes qwen3-30b-a3b --tokens 8 --no-baselines --no-json
elif [ "$part" = t8final ]; then
    SMOKE="True and bfloat16 and (1-2048-768 or 3-2048 or 8-512) or graph or split or fall" moe_cuda_tests 240
    TAIL=4 step tune 200 python scripts/tune_moe.py --cuda-only --only unit --shapes olmoe --tokens "" --int8-tokens 8
    cp kernels/configs/moe.json "$out/"
    TAIL=10 step moe 120 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1,8 \
        --no-baselines --no-json
elif [ "$part" = ceiling ]; then
    SMOKE="True and bfloat16 and (1-2048-768 or 3-2048 or 8-512) or graph or split or fall" moe_cuda_tests 200
    TAIL=30 step ceiling 170 python scripts/diag_step_ceiling.py
    for q in bf16 int8; do
        TAIL=4 step olmoe_$q 90 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1 --new-tokens 64 \
            --reps 3 $([ $q = int8 ] && echo --quantize int8)
    done
elif [ "$part" = critical ]; then
    TAIL=30 step ceiling 120 python scripts/diag_step_ceiling.py --models olmoe-1b-7b
    TAIL=40 step real_olmoe_bf16 120 python scripts/diag_step_ceiling.py --real --models olmoe-1b-7b
    TAIL=40 step real_olmoe_int8 120 python scripts/diag_step_ceiling.py --real --models olmoe-1b-7b --quantize int8
    TAIL=40 step real_qwen3_bf16 180 python scripts/diag_step_ceiling.py --real --models qwen3-30b-a3b
elif [ "$part" = preload ]; then
    TAIL=4 step gpu_tests 200 $pytest_gpu tests/test_qkv_attention.py tests/test_fused_decode.py \
        tests/test_gating_kernels.py
    TAIL=20 step real_olmoe_bf16 100 python scripts/diag_step_ceiling.py --real --models olmoe-1b-7b
    for i in 1 2; do
        for v in none preload-kv router-preload; do
            TAIL=3 step "ab_${v}_$i" 60 python scripts/diag_decode_ab.py $([ $v = none ] || echo --off $v) \
                --model olmoe-1b-7b --batches 1 --new-tokens 64 --reps 3
        done
    done
    TAIL=20 step real_qwen3_bf16 150 python scripts/diag_step_ceiling.py --real --models qwen3-30b-a3b
elif [ "$part" = ncuattn ]; then
    for model in olmoe-1b-7b qwen3-30b-a3b; do
        TAIL=0 step "ncu_$model" 240 ncu --clock-control none -k regex:qkv_attention --launch-skip 60 --launch-count 1 \
            --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
            --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters --import-source yes \
            python scripts/diag_step_ceiling.py --real --models $model
        grep -vE "UserWarning|_warn_once|^==PROF==" "$out/ncu_$model.log" | grep -A300 "qkv_attention" | head -150
    done
elif [ "$part" = attn2 ]; then
    attention_paths 220 120
    TAIL=3 step olmoe_bf16 60 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1 --new-tokens 64 --reps 3
elif [ "$part" = final14 ]; then
    TAIL=4 step gpu_tests 230 $pytest_gpu tests/test_qkv_attention.py tests/test_fused_decode.py tests/test_engine.py \
        tests/test_default_model.py tests/test_gating_kernels.py
    TAIL=17 step real_olmoe_bf16 100 python scripts/diag_step_ceiling.py --real --models olmoe-1b-7b
    for q in bf16 int8; do
        TAIL=3 step olmoe_$q 80 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1 --new-tokens 64 \
            --reps 3 $([ $q = int8 ] && echo --quantize int8)
    done
elif [ "$part" = final15 ]; then
    attention_paths 230 100
elif [ "$part" = final15b ]; then
    for model in olmoe-1b-7b qwen3-30b-a3b; do
        for q in bf16 int8; do
            TAIL=3 step "${model}_$q" 130 python scripts/bench_decode.py --model $model --batches 1 --new-tokens 64 \
                --reps 3 $([ $q = int8 ] && echo --quantize int8)
        done
    done
elif [ "$part" = peer ]; then
    TAIL=12 step decode_peer_olmoe 240 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1,8 \
        --new-tokens 64 --reps 3 --peer
    TAIL=12 step decode_peer_qwen3 330 python scripts/bench_decode.py --model qwen3-30b-a3b --batches 1 \
        --new-tokens 64 --reps 3 --peer
elif [ "$part" = peermix ]; then
    TAIL=12 step decode_peer_mixtral 560 python scripts/bench_decode.py --model mixtral-8x7b --batches 1 \
        --new-tokens 64 --reps 3 --peer
elif [ "$part" = moecheck ]; then
    moe_cuda_tests 420
    TAIL=10 step moe 60 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1 \
        --no-baselines --no-json
elif [ "$part" = unit8 ]; then
    TAIL=6 step moe_tests 150 $pytest_gpu tests/test_moe_cuda.py -k "True and bfloat16 or graph" || true
    TAIL=8 step tune 250 python scripts/tune_moe.py --cuda-only --shapes qwen3 --tokens "" --int8-tokens 1,8
    TAIL=8 step tune_olmoe 120 python scripts/tune_moe.py --cuda-only --shapes olmoe --tokens "" --int8-tokens 8
    cp kernels/configs/moe.json "$out/"
    for run in 1 2; do
        TAIL=16 step moe_$run 70 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 --tokens 1,8 \
            --no-baselines --no-json
    done
elif [ "$part" = mixtral ]; then
    TAIL=10 step tune 150 python scripts/tune_moe.py --cuda-only --shapes mixtral --tokens 1 --int8-tokens 1
    cp kernels/configs/moe.json "$out/"
    TAIL=14 step dense 150 python scripts/bench_dense.py --models mixtral-8x7b --tokens 1 --no-attention --write-table
    cp kernels/configs/dense.json "$out/"
    TAIL=50 step mixtral_int8 150 python scripts/bench_decode.py --model mixtral-8x7b --quantize int8 --batches 1 \
        --new-tokens 32 --reps 3 --profile
    TAIL=8 step mixtral_bf16 120 python scripts/bench_decode.py --model mixtral-8x7b --batches 1 --new-tokens 32 --reps 3
elif [ "$part" = mixtralab ]; then
    for i in 1 2 3; do
        for q in int8 bf16; do
            TAIL=2 step "mixtral_${q}_$i" 120 python scripts/bench_decode.py --model mixtral-8x7b --batches 1 \
                --new-tokens 64 --reps 5 $([ $q = int8 ] && echo --quantize int8)
        done
    done
elif [ "$part" = mixtralon ]; then
    TAIL=6 step tune 150 python scripts/tune_moe.py --cuda-only --verbose --shapes mixtral --tokens 1 --int8-tokens 1
    cp kernels/configs/moe.json "$out/"
    for q in int8 bf16; do
        for v in none route-in topk-in-router; do
            TAIL=2 step "ab_${q}_$v" 120 python scripts/diag_decode_ab.py --model mixtral-8x7b --batches 1 \
                --new-tokens 64 --reps 5 $([ $q = int8 ] && echo --quantize int8) $([ $v = none ] || echo --on $v)
        done
    done
elif [ "$part" = route ]; then
    TAIL=6 step route_smoke 200 $pytest_gpu -x tests/test_moe_kernels.py tests/test_moe_cuda.py \
        -k "${SMOKE:-route or gating or graph or table or pair}" || true
    if grep -q " passed" "$out/route_smoke.log" && ! grep -q "failed\|error" "$out/route_smoke.log"; then
        TAIL=20 step launch 60 python scripts/diag_launch.py
        TAIL=12 step tune 300 python scripts/tune_moe.py --shapes ${TUNE_SHAPES:-qwen3,olmoe} --tokens "" \
            --int8-tokens 8
        cp kernels/configs/moe.json "$out/"
        TAIL=24 step moe 130 python scripts/bench_moe.py --tokens 1,8 --no-baselines --no-json
    fi
elif [ "$part" = decodesizes ]; then
    TAIL=8 step gpu_tests 260 $pytest_gpu tests/test_moe_kernels.py tests/test_gating_kernels.py tests/test_launcher.py \
        tests/test_moe_cuda.py tests/test_engine.py tests/test_default_model.py \
        -k "route or gating or launcher or moe_layer or graph or table or pair or bfloat16 or engine or default"
    TAIL=20 step launch 60 python scripts/diag_launch.py
    TAIL=24 step moe 150 python scripts/bench_moe.py --tokens 1,2,4,8,16 --no-baselines --no-json
    TAIL=8 step olmoe 90 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1,8 --new-tokens 128 --reps 5
elif [ "$part" = tests ]; then
    TAIL=6 step tests 560 $pytest_gpu tests/test_parity.py tests/test_sbi_cuda.py tests/test_quant.py \
        tests/test_engine.py tests/test_moe_kernels.py -k "not test_moe_kernels or weight_tiles or tile_order or large \
        or grouped_mm or maps or graph or 4097"
elif [ "$part" = decode ]; then
    TAIL=25 step read 120 python scripts/diag_read.py
    TAIL=14 step dense_olmoe 90 python scripts/bench_dense.py --models olmoe-1b-7b --no-attention --write-table
    cp kernels/configs/dense.json "$out/"
    TAIL=4 step engine_tests 100 $pytest_gpu tests/test_engine.py tests/test_default_model.py
    TAIL=45 step olmoe 150 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1,8 --new-tokens 32 --reps 3 \
        --prefill 2048:8,512:8 --profile
    decode_more 32 3
else
    TAIL=12 step tune 200 python scripts/tune_moe.py --shapes qwen3,olmoe --tokens 4096,16384 --int8-tokens ""
    cp kernels/configs/moe.json "$out/"
    TAIL=8 step large_t 70 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe --tokens 4096,16384 --dtypes bf16 \
        --no-baselines --no-json
    TAIL=45 step prefill 150 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1 --new-tokens 8 --reps 3 \
        --prefill 2048:8,512:8 --profile
fi
find bench/results -newer "$out/.start" -name '*.json' -print0 | xargs -0 -r cp -t "$out"
rm -f "$out/.start"
tar czf /tmp/sweep.tgz -C "$out" . && rm -f "$out"/* && mv /tmp/sweep.tgz "$out/"
exit 0
