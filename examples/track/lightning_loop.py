"""A Lightning Trainer, measured by zerolens.track through its callback:

    python examples/track/lightning_loop.py --out runs/lightning-ddp --strategy ddp

Two devices: GPUs where there are 2, else CPU processes (gloo). Lightning's DDP starts the second
process itself by running this script again. `--devices 1 --strategy auto`: one device, the
LightningModule unwrapped."""
import argparse

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from tiny_transformer import TinyTransformer, batch
from torch import nn

from zerolens.integrations.lightning import ZerolensCallback


class LanguageModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = TinyTransformer()

    def training_step(self, tokens_and_labels, index):
        tokens, labels = tokens_and_labels
        return nn.functional.cross_entropy(self.model(tokens).flatten(0, 1).float(), labels.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, model: TinyTransformer, size: int = 512):
        self.model, self.size = model, size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        tokens, labels = batch(i, 0, 1, self.model, torch.device("cpu"))
        return tokens[0], labels[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the run folder (runs/<time> by default)")
    parser.add_argument("--strategy", default="ddp", help="Lightning's strategy (ddp, deepspeed_stage_2 on GPUs, ...)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="measure every this many optimizer steps")
    parser.add_argument("--csv-logs", default=None, help="a folder for Lightning's CSVLogger, where zerolens's "
                        "figures of each measured step go too")
    args = parser.parse_args()
    torch.manual_seed(0)
    module = LanguageModel()
    gpus = torch.cuda.device_count() >= args.devices
    trainer = L.Trainer(accelerator="gpu" if gpus else "cpu", devices=args.devices, strategy=args.strategy,
                        precision="bf16-mixed" if gpus else "32-true", max_steps=args.steps,
                        logger=CSVLogger(args.csv_logs) if args.csv_logs else False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ZerolensCallback(out=args.out, every=args.every)])
    trainer.fit(module, torch.utils.data.DataLoader(RandomTokens(module.model), batch_size=4))


if __name__ == "__main__":
    main()
