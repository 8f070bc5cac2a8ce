"""Who holds the extra fp16 tensor DeepSpeed 0.16.9's ZeRO-1 keeps after its steps (leftover.py's finding):
ZeRO-1 in fp16 on the CPU (as leftover.py), N steps, then the list of gradients that is not the optimizer's
and what refers to the dict that holds it.
    DS_ACCELERATOR=cpu /tmp/dsv/0.16.9/bin/python holder_cpu.py 20
Printed at 0.16.9: the dict {0: [27 gradients]} is referred to by deepspeed.utils.tensor_fragment objects
(each parameter's _hp_mapping.gradient_dict), not by the optimizer, whose averaged_gradients was replaced by
a new dict ({}) at the first overflowed step; 0.17 sets the dict's entries to None instead."""
import gc, sys
from pathlib import Path
sys.argv = [sys.argv[0], "/dev/null", *sys.argv[1:]]
exec(Path(__file__).with_name("leftover.py").read_text().split("results = {")[0])
import torch, deepspeed  # noqa: E402
torch.manual_seed(0)
model = Model()
config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "gradient_clipping": 1.0, "steps_per_print": 1 << 30, "fp16": {"enabled": True},
          "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000, "reduce_scatter": True}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
g = torch.Generator().manual_seed(1)
for step in range(int(sys.argv[2])):
    x = torch.randint(0, 1000, (8, 32), generator=g); y = torch.randint(0, 10, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
    engine.backward(loss); engine.step()
    print("step", step, "overflow", engine.optimizer.overflow)
gc.collect()
flat = engine.optimizer.bit16_groups_flat[0].untyped_storage().data_ptr()
params = sum(p.numel() for p in model.parameters())
held = next(o for o in gc.get_objects() if isinstance(o, list) and o and all(isinstance(t, torch.Tensor) for t in o)
            and o[0].untyped_storage().nbytes() == 2 * params and o[0].untyped_storage().data_ptr() != flat)
holder = next(r for r in gc.get_referrers(held) if isinstance(r, dict) and r.get(0) is held)
print("a list of", len(held), "fp16 tensors of one", 2 * params, "byte storage, in a dict with keys", list(holder))
print("the optimizer's averaged_gradients is that dict:", engine.optimizer.averaged_gradients is holder)
print("referred to by:", sorted({type(r).__module__ + "." + type(r).__name__ for r in gc.get_referrers(holder)
                                 if not isinstance(r, dict)}))
