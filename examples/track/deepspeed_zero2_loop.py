"""A DeepSpeed ZeRO-2 training loop, measured by zerolens.track on every rank:

    deepspeed --num_gpus 2 examples/track/deepspeed_zero2_loop.py --out runs/zero2-loop

(or torchrun --nproc-per-node 2 ...). bf16 on GPUs and on the CPU (DS_ACCELERATOR=cpu, gloo; DeepSpeed
has no fp16 there). The loop is the user's own; zerolens.track around it is the only change."""
import argparse

import deepspeed
import torch
import torch.distributed as dist
from tiny_transformer import TinyTransformer, batch
from torch import nn

import zerolens

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the run folder (runs/<time> by default)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="measure every this many optimizer steps")
    parser.add_argument("--deepspeed-adam", action="store_true",
                        help="DeepSpeed's own FusedAdam (the optimizer section without torch_adam)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args()
    config = CONFIG
    if args.deepspeed_adam:
        config = CONFIG | {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    model = TinyTransformer()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    with zerolens.track(engine, out=args.out, every=args.every):
        for step in range(args.steps):
            tokens, labels = batch(step, dist.get_rank(), 4, model, engine.device)
            loss = nn.functional.cross_entropy(engine(tokens).flatten(0, 1).float(), labels.flatten())
            engine.backward(loss)
            engine.step()
    engine.destroy()


if __name__ == "__main__":
    main()
