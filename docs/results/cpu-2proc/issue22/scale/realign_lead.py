import sys, dataclasses
sys.path.insert(0, "docs/results/cpu-2proc/issue22/scale")
import realign as local
from zerolens.models.hf import model_config_fields
from zerolens.models.model import ModelConfig, PRESETS
from zerolens.predict import depths
from zerolens.predict.peak import traced_rank
from zerolens.strategies import TrainSettings
def run(label, name, cfg_of, settings, rank=0):
    recs = {d: traced_rank(name, cfg_of(d), settings, rank=rank, cuda_capability=(9, 0), outcome=False)[1] for d in depths.TRACED_DEPTHS}
    seq = {n: depths.tokens(recs[n]["requests"], recs[n]["raw"]) for n in recs}
    print(label, "current:", depths.deepened(recs, 80)[1], "| prototype:", local.deepened_shape(seq)[::3])
run("70B fsdp2 4096 rank 4000", "fsdp2", lambda d: ModelConfig(**model_config_fields("examples/hf/llama2-70b.json", depth=d, seq_len=4096)),
    TrainSettings(precision="bf16", micro_batch=1, world_size=4096), rank=4000)
run("gpt-1b fsdp2 8", "fsdp2", lambda d: dataclasses.replace(PRESETS["gpt-1b"], num_layers=d), TrainSettings(precision="bf16", micro_batch=8, world_size=8))
run("gpt-1b ddp 8", "ddp", lambda d: dataclasses.replace(PRESETS["gpt-1b"], num_layers=d), TrainSettings(precision="bf16", micro_batch=8, world_size=8))
