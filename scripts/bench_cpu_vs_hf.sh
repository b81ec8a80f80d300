#!/usr/bin/env bash
# Reproduces docs/benchmarks.md's "CPU training step against PyTorch" table: our jitted T5.1.1 train step
# against Hugging Face transformers' T5ForConditionalGeneration + Adafactor on the same shapes (float32,
# dropout 0, random tokens), alternating rounds in one process, medians. Needs the .[hf] extra. Run it on a
# quiet machine: other processes competing for the cores distort both sides, PyTorch's OpenMP threads most.
#   scripts/bench_cpu_vs_hf.sh [A|B|all]      (STEPS=20 ROUNDS=3 WARMUP=3 by default; OUT=bench_cpu_vs_hf)
# HF_DENORMALS=keep runs PyTorch with its own default (subnormal floats computed, not flushed as XLA:CPU does;
# several times slower on Intel CPUs once Adafactor makes them, docs/benchmarks.md); the default is flush.
# HF_PROCESS=shared runs the reference in our process, as the rows before commit 040acd3 did (default: its own).
# Our step runs with $XLA_FLAGS as given (unset: XLA's defaults) and the config's kernel choices (remixer_t5/kernels/).
# Each config prints its JSON row to $OUT/<config>.json and a summary line to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}  # a CPU table, also where libtpu is installed (the .[tpu] extra)
STEPS=${STEPS:-20}; ROUNDS=${ROUNDS:-3}; WARMUP=${WARMUP:-3}; OUT=${OUT:-bench_cpu_vs_hf}
HF_DENORMALS=${HF_DENORMALS:-flush}
HF_PROCESS=${HF_PROCESS:-own}  # own: the reference in a process of its own (bench_train's docstring); shared: in ours
mkdir -p "$OUT"
which=${1:-all}

run() {  # name, then the model's gin flags
  local name=$1; shift
  "$PY" -m remixer_t5.cli bench train --gin_file=models/t5_1_1/small.gin --gin.DROPOUT_RATE=0.0 "$@" \
    --steps="$STEPS" --rounds="$ROUNDS" --warmup="$WARMUP" --reference=hf --hf_denormals="$HF_DENORMALS" \
    --hf_process="$HF_PROCESS" --json > "$OUT/$name.json"
  "$PY" - "$OUT/$name.json" "$name" <<'PYEOF'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(f"{sys.argv[2]}: ours {r['ours_s_per_step']:.3f} s/step ({r['ours_tokens_per_s']:,.0f} tok/s), "
      f"HF {r['hf_s_per_step']:.3f} s/step ({r.get('hf_process', 'shared')} process), ours/HF {r['ratio_ours_to_hf']:.3f}; rounds ours "
      f"{[round(x, 3) for x in r['ours_round_medians']]} HF {[round(x, 3) for x in r['hf_round_medians']]}; "
      f"xla flags {r.get('xla_flags')!r}, host malloc {r.get('host_malloc_policy')}, THP {r.get('transparent_hugepages')}, "
      f"denormals flushed: XLA {r.get('xla_denormals_flushed')}, torch {r.get('torch_denormals_flushed')}")
print(f"  per timed step: cores busy ours {r.get('ours_cores_busy') or 0:.2f} HF {r.get('hf_cores_busy') or 0:.2f}; "
      f"system s ours {r.get('ours_system_s_per_step', 0):.3f} HF {r.get('hf_system_s_per_step', 0):.3f}; "
      f"minor faults ours {r.get('ours_minor_faults_per_step', 0):,.0f} HF {r.get('hf_minor_faults_per_step', 0):,.0f}")
print(f"  {r.get('cpu_model')} [{r.get('cpu_id')}] ({r.get('cpus_usable')}/{r.get('cpu_count')} cores, {' '.join(r.get('cpu_flags', []))}, "
      f"cache {r.get('cpu_cache')}); torch threads {r.get('torch_num_threads')}/{r.get('torch_num_interop_threads')}, "
      f"thread env {r.get('thread_env')}; load {r.get('load_average_start')} -> {r.get('load_average_end')}; "
      f"commit {r.get('git_commit')}; jax {r.get('jaxlib_version')}, torch {r.get('torch_version')}")
PYEOF
}

if [[ $which == A || $which == all ]]; then  # d 256, 4+4 layers, d_ff 1024, 4 heads x 64, batch 16, 128/32
  run A --gin.network.T5Config.emb_dim=256 --gin.network.T5Config.num_encoder_layers=4 \
    --gin.network.T5Config.num_decoder_layers=4 --gin.network.T5Config.mlp_dim=1024 \
    --gin.network.T5Config.num_heads=4 --gin.network.T5Config.head_dim=64 --batch_size=16 --lengths=128,32
fi
if [[ $which == B || $which == all ]]; then  # T5.1.1-small, batch 8, 512/114
  run B --batch_size=8 --lengths=512,114
fi
echo "uptime: $(uptime)"
