"""What DeepSpeed's ZeRO-1/2 hold after fp16 steps at N=1, and how their losses follow stage 0's.

Plain DeepSpeed, no zerolens: the case study's shape (Transformer encoder classifier, d_model 128, 2 layers,
vocab 1000, seq 32, micro-batch 8), AdamW (torch), gradient clipping 1.0, fp16. For stages 0, 1 and 2, 30
steps each: every step's loss, loss scale and overflow, then every tensor on the device alive after the last
step, named by where the optimizer or the model holds it. A second argument "explicit" writes DeepSpeed's
fp16 loss-scaling defaults out in the config, as zerolens's own config does (strategies/deepspeed.py,
FP16_LOSS_SCALING); without it the fp16 section is {"enabled": true}, DeepSpeed's defaults applying.

On a GPU (nccl), or on the CPU (gloo) with DS_ACCELERATOR=cpu: fp16 is then allowed on DeepSpeed's CPU
accelerator, which refuses it by default, and the fp16 products run on the CPU. With the virtual
environments of scripts/deepspeed_compat.sh:
    DS_ACCELERATOR=cpu /tmp/dsv/0.16.9/bin/python leftover.py leftover-cpu-0.16.9.json [explicit]
"""
import gc, json, os, sys
import torch, deepspeed
from deepspeed.accelerator import get_accelerator

EXPLICIT = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
            "min_loss_scale": 1}
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu" else "cpu"
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29511")
os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("LOCAL_RANK", "0")
deepspeed.init_distributed("nccl" if DEV == "cuda" else "gloo")
if DEV == "cpu":
    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [torch.float, torch.half, torch.bfloat16]


def allocated():
    return torch.cuda.memory_allocated() if DEV == "cuda" else 0


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 128)
        layer = torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)).mean(1))


def names(root, prefix, seen, out, depth=0):
    if depth > 4 or id(root) in seen:
        return
    seen.add(id(root))
    if isinstance(root, torch.Tensor):
        if root.device.type == DEV:
            out.setdefault(root.untyped_storage().data_ptr(), []).append(prefix)
        return
    items = (root.items() if isinstance(root, dict) else enumerate(root) if isinstance(root, (list, tuple))
             else vars(root).items() if hasattr(root, "__dict__") and not isinstance(root, torch.nn.Module) else ())
    for k, v in items:
        if isinstance(v, (torch.Tensor, dict, list, tuple)) or (hasattr(v, "__dict__") and depth < 2):
            names(v, f"{prefix}.{k}", seen, out, depth + 1)


def run(stage, steps=30):
    torch.manual_seed(0)
    model = Model()
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "gradient_clipping": 1.0, "steps_per_print": 1 << 30, "fp16": {"enabled": True, **(EXPLICIT if sys.argv[2:] == ["explicit"] else {})}}
    if stage:
        config["zero_optimization"] = {"stage": stage, "reduce_bucket_size": 50_000_000, "reduce_scatter": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(1)
    log = []
    for step in range(steps):
        x = torch.randint(0, 1000, (8, 32), generator=g).to(DEV)
        y = torch.randint(0, 10, (8,), generator=g).to(DEV)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        opt = engine.optimizer
        log.append({"step": step, "loss": round(loss.item(), 5), "scale": getattr(opt, "loss_scale", None),
                    "overflow": bool(getattr(opt, "overflow", False)), "allocated": allocated()})
    gc.collect()
    where = {}
    names(engine.optimizer, "optimizer", set(), where)
    for n, p in engine.module.named_parameters():
        where.setdefault(p.untyped_storage().data_ptr(), []).append(f"param {n}")
        if p.grad is not None:
            where.setdefault(p.grad.untyped_storage().data_ptr(), []).append(f"grad {n}")
    alive = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.device.type == DEV:
                s = o.untyped_storage()
                alive[s.data_ptr()] = (s.nbytes(), str(o.dtype))
        except Exception:
            pass
    held = sorted(((b, d, where.get(ptr, ["(not reached from the optimizer or the model)"])[:3])
                   for ptr, (b, d) in alive.items()), reverse=True)
    result = {"stage": stage, "steps": log, "allocated_after": allocated(),
              "tensors_after_last_step": [{"bytes": b, "dtype": d, "held_by": w} for b, d, w in held[:40]]}
    engine.destroy() if hasattr(engine, "destroy") else None
    del engine, opt, model
    gc.collect(); torch.cuda.empty_cache() if DEV == "cuda" else None
    return result


results = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "runs": [run(s) for s in (0, 1, 2)]}
json.dump(results, open(sys.argv[1], "w"), indent=1)
for r in results["runs"]:
    print(deepspeed.__version__, "stage", r["stage"], "allocated after", r["allocated_after"],
          "losses", [s["loss"] for s in r["steps"]][8:16], "overflows", [s["step"] for s in r["steps"] if s["overflow"]])
