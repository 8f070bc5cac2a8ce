set -x
for s in ddp zero2; do
  python3 scripts/record_strategy_allocator.py --strategy $s --model gpt-1b --micro-batch 8 --out "$OUT/gpt-1b-$s.json.gz" 2>&1 | grep -v WARN | tail -3
done
python3 scripts/record_strategy_allocator.py --strategy ddp --model case-study --micro-batch 16 --precision fp16 --out "$OUT/case-study-ddp.json.gz" 2>&1 | grep -v WARN | tail -3
ls -la $OUT
