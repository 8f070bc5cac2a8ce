"""The model the track examples train: a small causal Transformer (token embedding, blocks in an
nn.ModuleList, a head), written for one device, as a user's own model would be."""
import torch
from torch import nn


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 1024, d_model: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)
        self.seq_len = seq_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def batch(step: int, rank: int, size: int, model: TinyTransformer, device: torch.device):
    """Tokens and next-token labels, different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, model.embed.num_embeddings, (size, model.seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
