#!/usr/bin/env bash
# plan gpt-1b at 8 GPUs of 24 GiB with two trees alternated, ROUNDS times, on this 2-core machine with
# nothing else running: BASE (a checkout of 3a87991, this session's start) and HEAD (this tree, 72d64e6),
# by plan-cache/run.sh (the seconds plan printed, wall and CPU time, whether the JSONs agree but for
# `seconds`), its times.log written here.
# From the repository root: BASE=/path/to/checkout-of-3a87991 HEAD=$PWD ROUNDS=3 bash docs/results/cpu-2proc/issue21/plan-keys/run.sh
HERE=$PWD/docs/results/cpu-2proc/issue21/plan-keys exec bash "$PWD/docs/results/cpu-2proc/issue21/plan-cache/run.sh"
