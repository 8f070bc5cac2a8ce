#!/usr/bin/env bash
# Re-runs the two commands whose verdicts gpu_verify.sh (beside it) found FAIL, after the fixes
# described in docs/results/2xh200/README.md (log: gpu_verify_followup.log).
LOG=gpu_verify_followup.log exec bash "$(dirname "$0")/gpu_verify.sh" \
  "all|--strategies ddp,zero0,zero1,zero2,zero3" \
  "130m|--preset case-study-130m --strategies ddp,zero0,zero1,zero2,zero3"
