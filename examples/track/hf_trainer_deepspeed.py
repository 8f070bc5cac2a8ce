"""A Hugging Face Trainer with a DeepSpeed ZeRO-2 config, measured by zerolens.track through its callback:

    torchrun --nproc-per-node 2 examples/track/hf_trainer_deepspeed.py --out runs/trainer-zero2

A tiny Llama built from examples/hf/llama-tiny.json (random weights, no download) on random tokens, in
bf16, on GPUs or, without them, on CPU processes (gloo). The
Trainer builds its AdamW with two parameter groups (weight decay and none); `--one-param-group`
gives it one AdamW over every parameter, as `zerolens verify` builds it, so that the two can be
compared byte for byte."""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from zerolens.integrations.hf import ZerolensCallback

HERE = Path(__file__).parent


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, seq_len: int, size: int = 256):
        self.vocab, self.seq_len, self.size = vocab, seq_len, size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself


class OneParameterGroup(Trainer):
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.args.learning_rate)
        return self.optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the run folder (runs/<time> by default)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="measure every this many optimizer steps")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--one-param-group", action="store_true")
    parser.add_argument("--report-to", default="none", help="the Trainer's report_to (tensorboard, wandb, ...), where "
                        "zerolens's figures of each measured step go too")
    args = parser.parse_args()
    config = AutoConfig.for_model(**json.loads((HERE.parent / "hf" / "llama-tiny.json").read_text()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    cuda = torch.cuda.is_available()
    # The Trainer's own folder (it saves nothing here) is kept apart from zerolens's run folder.
    training = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="trainer-"), max_steps=args.steps,
                                 per_device_train_batch_size=args.micro_batch, learning_rate=1e-4, bf16=True,
                                 deepspeed=str(HERE / "ds_zero2.json"), use_cpu=not cuda,
                                 ddp_backend=None if cuda else "gloo", report_to=args.report_to, save_strategy="no",
                                 logging_steps=max(1, args.steps // 4), disable_tqdm=True)
    trainer = (OneParameterGroup if args.one_param_group else Trainer)(
        model=model, args=training, train_dataset=RandomTokens(config.vocab_size, args.seq_len))
    trainer.add_callback(ZerolensCallback(trainer, out=args.out, every=args.every))
    trainer.train()
    if not cuda:
        end_without_gloos_teardown()


def end_without_gloos_teardown() -> None:
    """On CPU processes, gloo's C++ threads can abort the interpreter's teardown after the run has
    finished and every report is written ("terminate called without an active exception"; torch issue
    190489): the process group ended, output flushed, the teardown is skipped, as zerolens's own
    workers and examples/train_zero_stage2.py end."""
    wandb = sys.modules.get("wandb")  # --report-to wandb: its run ends at exit, which this skips
    if wandb is not None and wandb.run is not None:
        wandb.finish()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
