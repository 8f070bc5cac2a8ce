# One H200: the allocator's own histories under PYTORCH_CUDA_ALLOC_CONF options the model follows besides
# expandable segments (roundup_power2_divisions, max_split_size_mb), for tests/fixtures/allocator/, and
# each replayed through the model here (predict/allocator.py, replay_recording).
set -x
F=$OUT/fixtures && mkdir -p $F
run() {  # name conf args...
  name=$1 conf=$2; shift 2
  PYTORCH_CUDA_ALLOC_CONF=$conf python3 scripts/record_allocator.py "$@" --out $F/$name.json.gz >> $F/record-options.log 2>&1
}
run case-study-roundup4 "roundup_power2_divisions:4" --model case-study --precision fp16 --micro-batch 16
run case-study-split64-roundup "max_split_size_mb:64,roundup_power2_divisions:[64:8,>:2]" --model case-study --precision fp16 --micro-batch 16
run gpt2-roundup4 "roundup_power2_divisions:4" --model hf:gpt2 --micro-batch 8 --seq-len 1024
run gpt2-split64-roundup "max_split_size_mb:64,roundup_power2_divisions:[64:8,>:2]" --model hf:gpt2 --micro-batch 8 --seq-len 1024
cat $F/record-options.log
python3 - > $OUT/replay.txt 2>&1 <<'PY'
import glob, gzip, json, os
from zerolens.predict.allocator import replay_recording
for path in sorted(glob.glob(os.environ["OUT"] + "/fixtures/*.json.gz")):
    record = json.load(gzip.open(path))
    try:
        model = replay_recording(record)
        print(os.path.basename(path), record["alloc_conf"], "replayed: segments equal at every event;",
              "reserved peak", model.reserved_peak, "recorded", record["max_memory_reserved"])
    except AssertionError as e:
        print(os.path.basename(path), record["alloc_conf"], "PARTS:", str(e)[:300])
PY
cat $OUT/replay.txt
