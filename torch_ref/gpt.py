"""The book's GPT (chapters 11, 12 and 14; minGPT layout) in PyTorch: the reference flax_ln.models.gpt mirrors.

Module tree and ``state_dict`` keys are those of the book's models: ``transformer.wte``,
``transformer.wpe``, ``transformer.h.{i}.{ln_1, attn.c_attn, attn.c_proj, attn.bias,
ln_2, mlp.c_fc, mlp.c_proj}``, ``transformer.ln_f`` and ``lm_head`` (no bias), where
``attn.bias`` is the persistent causal-mask buffer, so a checkpoint saved by the book's
code loads with ``strict=True``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from flax_ln.models.gpt import GPTConfig

__all__ = ["GELU", "CausalSelfAttention", "MLP", "Block", "GPT", "GPTConfig", "generate", "load_hf_gpt2"]


class GELU(nn.Module):
    """tanh GELU: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (not ``nn.GELU()``'s erf form)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; masked scores are ``-inf``; buffer ``bias`` holds the mask."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        size = config.block_size
        self.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """``dropout(c_proj(GELU(c_fc(x))))`` with hidden width 4 * n_embd."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.act = GELU()
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`` with ``nn.LayerNorm`` (eps 1e-5)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The book's GPT; ``forward(idx, targets=None) -> (logits, loss)``.

    Weights are initialised normal(0, 0.02) with zero biases; with
    ``config.c_proj_reinit`` (chapters 12 and 14) every ``c_proj.weight`` is then
    re-drawn from normal(0, 0.02/sqrt(2 * n_layer)). The loss is cross-entropy with
    ``ignore_index=config.ignore_index`` (-1 in chapter 11, 389 for the music model).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.embd_pdrop),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.c_proj_reinit:
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)  # (1, t)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=self.config.ignore_index
            )
        return logits, loss


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The book's sampling loop: crop to block_size, temperature, top-k, multinomial (argmax if temperature 0)."""
    block_size = model.config.block_size
    for _ in range(max_new_tokens):
        idx_cond = idx if idx.size(1) <= block_size else idx[:, -block_size:]
        logits, _ = model(idx_cond)
        logits = logits[:, -1, :]
        if temperature == 0:
            idx_next = torch.argmax(logits, dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, top_k)
                logits[logits < v[:, [-1]]] = -float("inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


def load_hf_gpt2(path: str | Path, *, config: GPTConfig | None = None) -> GPT:
    """A torch ``GPT`` holding a Hugging Face GPT-2 checkpoint (safetensors), in eval mode, as chapter 11 loads GPT-2XL.

    Chapter 11 copies every Hugging Face weight into the model, skipping the
    ``attn.bias``/``attn.masked_bias`` buffers and transposing the four Conv1D weights.
    The key mapping is the declared table in :mod:`flax_ln.convert` (shared with
    :func:`flax_ln.load_hf_gpt2`); the copy is strict, every key must match.
    ``path`` and ``config`` are as in :func:`flax_ln.load_hf_gpt2`.
    """
    from flax_ln.convert import read_hf_gpt2

    config, state_dict = read_hf_gpt2(path, config=config)
    model = GPT(config)
    model.load_state_dict({k: torch.tensor(v) for k, v in state_dict.items()}, strict=True)
    return model.eval()
