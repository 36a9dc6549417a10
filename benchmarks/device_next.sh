#!/usr/bin/env bash
# The three compiled training runs in one call (one H200, about 6 minutes cold) for same-call ratios:
# the NAtS-L Hybrid, the Transformer and the GDN Hybrid, 30 steps with 5 untimed (a step is ~0.2 s at
# micro-batch 4, compiling ~1-2 min). MBS=8 gives the recipes' own micro-batch (the tenth session ran
# both); RUNS="800m_gdn:170 800m_natsl:200" the other two systems (last measured in the seventh session).
# Every @gpu test in a call of its own: bash benchmarks/device_gpu_tests.sh
# grad_wy's TMA descriptors (config.GRAD_WY["descriptors"]; 2026-12-01: the test passed, 0.211 against
# 0.191 ms without them, so they stay off):
#   python3 benchmarks/device_gated_delta.py --skip check,time --modes input --sweep-shape 4,4096 --stages GRAD_WY
#   python3 -m pytest -q -m gpu tests/test_fast_gated_delta.py -k descriptors
# The twelfth session (fused LM loss): MBS=8 bash benchmarks/device_next.sh gave hybrid 83.7K (40.6% MFU),
# Transformer 89.7K, GDN Hybrid 87.6K tokens/s; RUNS="800m_gdn:170 800m_natsl:210" MBS=8: 91.3K, 73.5K.
# The thirteenth session (calls 5, 6; per-step times now in each JSON): hybrid 85.3K, Transformer 90.8K,
# GDN Hybrid 89.2K; the state split on/off side by side: median step 385.4 vs 386.2 ms (NATSL_STATE_SPLIT).
# Not yet run with this code: DDP / FSDP2 on nvidia-h200-x2 (not lent in the twelfth and thirteenth
# sessions), e.g.
#   python3 benchmarks/bench_training.py --recipes 800m_hybrid --nproc 2 --parallel fsdp --compile \
#       --max-steps 25 --warmup-steps 5 --micro-batch-size 8
# The GDN output norm + gate on Triton kernels (fourteenth session, side by side in training): median
# step 390.5 ms against 389.8 with Inductor's formula; removed (the kernels are in commit 8bcf70c's tree).
# Not yet run with this code either: DDP / FSDP2 (nvidia-h200-x2 was not lent in the fourteenth session).
# What the fourteenth session learned for the next (docs/benchmarks.md, "Where things stand"):
# - the H200 runs the 128K prefill at its power limit (~690 W; SM clock 1.7-1.8 GHz, 1.5 GHz right after
#   large matmuls, not 1.98): a second stream is paid back in clock, so only less work (bytes moved,
#   instructions) makes it faster; benchmarks/device_prefill_attention.py samples the clock (the
#   training step's clock has not been sampled yet).
# - the device has nvcc (CUDA 13.0, /usr/local/cuda): a CUDA C++ attention forward with warp-group
#   ping-pong (torch.utils.cpp_extension, the Triton kernel staying the fallback) is the one route left
#   to the prefill-to-GDN ratios; Triton 3.6 cannot overlap softmax and wgmma (docs/notes, items 9, 12).
# - short prompts (< 16K) prefill host-bound at 60-92 ms: benchmarks/device_prefill_host.py.
# - flash-attn-4 (CuTe DSL, PyPI) has SM90 kernels with block sparsity + mask_mod and Dv != Dk: the
#   shortest route to an FA3-class routed attention (docs/notes/fast_routed_attention.md, "Not done",
#   says how it maps and how to carry its 100 MB of wheels onto the device).
# What the fifteenth session learned (docs/benchmarks.md, "fifteenth session"):
# - a runtime `if` around tl.dot inside the sequential GDN loops (skipping unwritten blocks' commit) gave
#   wrong gradients at 32-wide slices, an illegal memory access at B=8 and a 2x slower forward on the
#   H200 (Triton 3.6): keep those loops branch-free.
# - the GDN's q, k, v as one product gave the hybrid +0.66% and +0.64% on two machines (now the training
#   default); the Transformer's attn_qkv lost 2.4%. Best of each, one held machine: 86.1K vs 91.1K, 0.945x.
#   Not re-run with the new default: GDN Hybrid, GDN, NAtS-L (RUNS="800m_gdn_hybrid:170 ..." MBS=8).
# The sixteenth session: FLAGS="--cuda-graphs" TAG=_graphs (train.cuda_graphs; TAG names the outputs so
# that two settings of one recipe can run in one call). Learned: replaying the compiled step as CUDA graphs
# moved the hybrid's median step by 0.4% (384.7 vs 386.1 ms): the GPU does not wait on launches, so only
# fewer or faster kernels close the gap. All five with the current code on one held H200: hybrid 84.8K,
# GDN Hybrid 89.0K, GDN 90.8K, Transformer 90.4K, NAtS-L 73.0K (0.953x, 0.939x). On a warm machine the
# Inductor cache makes a repeat compile quick: three recipes fit one call (328 s).
# The seventeenth session: the q, k, v convs as one op (NATSL_JOINED_CONV=0 turns it off for a side-by-side
# run): hybrid 84,296 against 83,512 tokens/s (+0.94%), Transformer 88,581 (0.952x), GDN Hybrid 88,014.
# TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1: cuBLAS won every large product; the compile outran 470 s (not worth it).
# Not yet run with this code: DDP / FSDP2 (nvidia-h200-x2 not lent), GDN and NAtS-L (RUNS="800m_gdn:170
# 800m_natsl:210"), a profile of the new step (profile_training_step.py --recipe 800m_hybrid --compile
# --optimizer --batch 8).
# The eighteenth session: launch settings swept at micro-batch 8 (bash benchmarks/device_sweep_b8.sh): the
# NAtS-L read's backward on 1 warp / 8 rows and grad_wy through TMA descriptors, hybrid 85,657 against 85,395
# tokens/s for the previous commit's tree run the same way from a copy (cd copy && TAG=_old OUT=$OUT/old bash
# benchmarks/device_next.sh); Transformer 89,862 (0.953x), GDN Hybrid 89,459. grad_qk as one program per
# chunk was 1.49x slower (compare_gdn_revisions.py --variants), not kept.
# The nineteenth session: all five with this code on one held H200 (calls 3-6, each recipe in a call of its own
# after the first two): hybrid 88,300, Transformer 92,217 (0.958x), GDN Hybrid 91,789 (0.962x), GDN 93,783,
# NAtS-L 76,147 tokens/s. nvidia-smi sampled beside the runs (--query-gpu=clocks.sm,power.draw -lms 1000):
# every training step runs at the ~690 W power limit, SM clock ~1.7 GHz. The GDN output folded into the
# forward recurrence was slower (its code is in commit 1c9ae28). Not yet run with this code: DDP / FSDP2.
# Since then bench_training's JSON and table also give joules per step, tokens per joule, mean power and the
# SM clock (benchmarks/gpu_meter.py, NVML through nvidia-ml-py): first GPU run still to come; so does
# benchmarks/energy_blocks.py (ms and joules of one GDN / NAtS-L / softmax block, fwd + bwd, at 8 x 4096),
# and bash benchmarks/device_regcap_b8.sh (the sequential GDN kernels under register caps, 3-4 programs/SM);
# both in one call: bash benchmarks/device_energy_and_regcap.sh.
# The twentieth session ran them: register caps slower everywhere (state fwd 0.399 ms vs 0.524-1.274, bwd 0.686
# vs 0.891-1.509); joules per block GDN 11.08, NAtS-L 13.52, attention 9.91 J; this script's JSON with joules:
# hybrid 85,290 tokens/s and 267.6 J/step, Transformer 89,014 and 254.4 J (0.958x; 0.951x per joule). The
# hybrid's matmuls run at the Transformer's rate (profile_training_step.py --matmul-shapes: 719 vs 724
# TFLOP/s, 2% more work); the six NAtS-L blocks' ~2.4 J each over a GDN block is more than the whole gap, so
# the lever is the routed attention's backward. dq added from the dk/dv kernel through fp32 atomics (commit
# fa38470) was 1.13x slower for the backward and -0.8% in training: the atomic adds cost more than the two
# products they save. Left: a TMA bulk reduce-add per tile (FA3's way) or flash-attn-4's SM90 kernels with
# block sparsity (docs/notes/fast_routed_attention.md, "Not done").
# The twenty-first session bounded that lever: FLAGS=--free-attention TAG=_free (the routed attention replaced by
# a free op, benchmarks/free_attention.py) trained the hybrid at 93,455 tokens/s against 88,444 with the real
# attention, the Transformer 92,152 and GDN 93,649 (one held H200): parity would need the six attentions in
# 5.0 ms a step, 947 TFLOP/s, so no attention kernel closes the gap; only a faster GDN side could.
#   bash benchmarks/device_next.sh      (writes under $OUT; everything printed also lands in $OUT/log.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
{
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
for r in ${RUNS:-800m_hybrid:200 800m_transformer:160 800m_gdn_hybrid:170}; do
  name=${r%:*}; tag=$name${TAG:-}
  timeout -k 10 ${r#*:} python3 benchmarks/bench_training.py --recipes $name --compile ${FLAGS:-} --max-steps 30 \
      --warmup-steps 5 --micro-batch-size ${MBS:-4} --out /tmp/train_$tag > /tmp/train_$tag.txt 2>&1
  echo "$tag ${FLAGS:-}"; grep -E "^800m|recipe" /tmp/train_$tag.txt | tail -2 | cut -c1-160
  grep -c "skipping cudagraphs" /tmp/train_$tag.txt | sed 's/^/cudagraph skip lines: /'
  tail -30 /tmp/train_$tag.txt > $OUT/train_$tag.tail.txt
  cp /tmp/train_$tag/bench_training.json $OUT/train_$tag.json
done
} 2>&1 | tee -a $OUT/log.txt
