#!/usr/bin/env bash
# How long `estimate` takes at scale, on this 2-core machine (no GPU: CUDA targets traced on the CPU).
# Run from the repository root: bash docs/results/cpu-2proc/issue22/scale/run.sh
set -u
here=docs/results/cpu-2proc/issue22/scale
: > $here/${TIMES:-times.log}
run() {  # name, then the zerolens arguments
  local name=$1; shift
  local start=$(date +%s.%N)
  zerolens "$@" --json > /tmp/zerolens-scale-$name.json 2>> $here/${TIMES:-times.log}
  local rc=$? end=$(date +%s.%N)
  python3 - "$name" "$rc" "$start" "$end" "$*" >> $here/${TIMES:-times.log} <<'PY'
import json, sys
name, rc, start, end, args = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
out = {"name": name, "command": "zerolens " + args + " --json", "exit_code": rc, "wall_s": round(end - start, 1)}
if rc == 0:
    d = json.load(open(f"/tmp/zerolens-scale-{name}.json"))
    out["predicted_in_s"] = d.get("seconds")
    for strategy, s in d.get("strategies", {}).items():
        ranks = s.get("ranks", [])
        out.setdefault("strategies", {})[strategy] = {
            "ranks": len(ranks), "not_predicted": s.get("peak_not_predicted"),
            "highest_peak_bytes": max((r.get("peak_bytes", 0) for r in ranks), default=None),
            "ranks_with_allocator_figures": sum("min_allocator_cap_bytes" in r for r in ranks),
            "depth_scaled_from": s.get("depth_scaled_from"), "why_not_depth_scaled": s.get("why_not_depth_scaled"),
            "depth_scaled_ranks": s.get("depth_scaled_ranks")}
print(json.dumps(out))
PY
}
if [ -n "${ALL70B:-}" ]; then  # every strategy of Llama-2-70B at 64, 512 and 4096 ranks, one command each
  for n in 64 512 4096; do
    run llama70b-n$n-all estimate --model hf:examples/hf/llama2-70b.json --nproc $n --micro-batch 1 --seq-len 4096 --precision bf16
  done
  exit 0
fi
run gpt1b-n8-all estimate --preset gpt-1b --nproc 8
run llama70b-n8-zero2 estimate --model hf:examples/hf/llama2-70b.json --nproc 8 --strategies zero2 --micro-batch 1 --seq-len 4096 --precision bf16
run llama70b-n64-zero2 estimate --model hf:examples/hf/llama2-70b.json --nproc 64 --strategies zero2 --micro-batch 1 --seq-len 4096 --precision bf16
run llama70b-n1024-zero2 estimate --model hf:examples/hf/llama2-70b.json --nproc 1024 --strategies zero2 --micro-batch 1 --seq-len 4096 --precision bf16
run llama70b-n4096-zero2 estimate --model hf:examples/hf/llama2-70b.json --nproc 4096 --strategies zero2 --micro-batch 1 --seq-len 4096 --precision bf16
run llama70b-n4096-zero1 estimate --model hf:examples/hf/llama2-70b.json --nproc 4096 --strategies zero1 --micro-batch 1 --seq-len 4096 --precision bf16
run llama70b-n64-zero3-fsdp2 estimate --model hf:examples/hf/llama2-70b.json --nproc 64 --strategies zero3,fsdp2 --micro-batch 1 --seq-len 4096 --precision bf16
