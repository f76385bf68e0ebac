"""The book's GPT (chapters 11, 12 and 14; minGPT layout) in PyTorch: the reference flax_ln.models.gpt mirrors.

Module tree and ``state_dict`` keys are those of the book's models: ``transformer.wte``,
``transformer.wpe``, ``transformer.h.{i}.{ln_1, attn.c_attn, attn.c_proj, attn.bias,
ln_2, mlp.c_fc, mlp.c_proj}``, ``transformer.ln_f`` and ``lm_head`` (no bias), where
``attn.bias`` is the persistent causal-mask buffer, so a checkpoint saved by the book's
code loads with ``strict=True``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from torch_ref.config import config_fields

__all__ = ["GELU", "CausalSelfAttention", "MLP", "Block", "GPT", "GPTConfig", "generate"]

_REQUIRED_FIELDS = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of the book's GPT (its ``Config`` class), torch- and JAX-free plain data.

    :class:`GPT` accepts this class or any object with the same attribute names (the
    book's own ``Config``, ``flax_ln.GPTConfig``, a ``types.SimpleNamespace``) or a
    mapping with those keys; :meth:`from_any` does the conversion. The reference defines
    its own config so that it never imports the port.

    Args:
      n_layer: number of Transformer blocks.
      n_head: attention heads; must divide ``n_embd``.
      n_embd: model width.
      vocab_size: number of token ids.
      block_size: longest sequence (positional-embedding rows and causal-mask size).
      embd_pdrop, resid_pdrop, attn_pdrop: dropout rates, 0.1 each as in the book.
      ignore_index: target id the loss skips (chapter 11: -1; chapter 14: 389, the padding id).
      c_proj_reinit: re-draw every ``c_proj.weight`` from normal(0, 0.02/sqrt(2*n_layer)),
        as chapters 12 and 14 do.
    """

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    embd_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    ignore_index: int = -1
    c_proj_reinit: bool = False

    def __post_init__(self):
        for name in _REQUIRED_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "pick n_head among the divisors of n_embd"
            )
        for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
                raise ValueError(f"GPTConfig: {name} must be a float in [0, 1), got {value!r}")

    @classmethod
    def from_any(cls, config: Any) -> GPTConfig:
        """``config`` as a :class:`GPTConfig`: itself, or read field by field from attributes or mapping keys.

        The five sizes are required; the dropouts, ``ignore_index`` and ``c_proj_reinit``
        take this class's defaults when the object lacks them (the book's chapter-11
        ``Config`` has neither of the last two).
        """
        if isinstance(config, cls):
            return config
        values = config_fields(cls, config)
        missing = [name for name in _REQUIRED_FIELDS if name not in values]
        if missing:
            raise TypeError(
                f"GPT config {type(config).__name__} lacks {missing}: expected an object or mapping with "
                f"the book's fields {list(_REQUIRED_FIELDS)} (e.g. torch_ref.GPTConfig, flax_ln.GPTConfig "
                "or types.SimpleNamespace)"
            )
        return cls(**values)

    @classmethod
    def gpt2(cls, **overrides) -> GPTConfig:
        """GPT-2 small: 12 layers, 12 heads, width 768, vocab 50257, block 1024."""
        return cls(**{**dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024), **overrides})

    @classmethod
    def gpt2_xl(cls, **overrides) -> GPTConfig:
        """Chapter 11's GPT-2XL: 48 layers, 25 heads, width 1600, vocab 50257, block 1024."""
        return cls(**{**dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024), **overrides})

    @classmethod
    def chapter12(cls, vocab_size: int, **overrides) -> GPTConfig:
        """Chapter 12's text GPT: 3 layers, 4 heads, width 256, block 128, scaled ``c_proj`` init."""
        base = dict(n_layer=3, n_head=4, n_embd=256, vocab_size=vocab_size, block_size=128, c_proj_reinit=True)
        return cls(**{**base, **overrides})

    @classmethod
    def music(cls, **overrides) -> GPTConfig:
        """Chapter 14's music Transformer: 6/8/512, vocab 390, block 2048, loss ignores padding id 389."""
        base = dict(
            n_layer=6, n_head=8, n_embd=512, vocab_size=390, block_size=2048, ignore_index=389, c_proj_reinit=True
        )
        return cls(**{**base, **overrides})


def gpt_float32_bytes(config: GPTConfig) -> int:
    """Bytes a float32 :class:`GPT` allocates: its parameters plus every layer's (block, block) mask buffer.

    ``4 * (2 V C + P C + 2 C + L (12 C^2 + 13 C + P^2))`` with V vocab, C width, P block
    size, L layers (per layer: ``c_attn`` 3C^2+3C, ``c_proj`` C^2+C, ``c_fc`` 4C^2+4C,
    ``mlp.c_proj`` 4C^2+C, two norms 4C, and the ``attn.bias`` buffer P^2).
    """
    V, C, P, L = config.vocab_size, config.n_embd, config.block_size, config.n_layer
    return 4 * (2 * V * C + P * C + 2 * C + L * (12 * C * C + 13 * C + P * P))


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that reports it
        return None


class GELU(nn.Module):
    """tanh GELU: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (not ``nn.GELU()``'s erf form)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; masked scores are ``-inf``; buffer ``bias`` holds the mask."""

    bias: torch.Tensor  # the causal mask buffer

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

    Args:
      config: a :class:`GPTConfig` or any object or mapping with the book's field names
        (see :meth:`GPTConfig.from_any`); stored as a :class:`GPTConfig`. A config whose
        float32 parameters and mask buffers exceed the machine's memory is refused
        before anything is allocated.
    """

    def __init__(self, config: GPTConfig | Any):
        super().__init__()
        config = GPTConfig.from_any(config)
        needed, memory = gpt_float32_bytes(config), _physical_memory_bytes()
        if memory is not None and needed > memory:
            raise MemoryError(
                f"GPT: n_layer={config.n_layer}, n_embd={config.n_embd}, vocab_size={config.vocab_size}, "
                f"block_size={config.block_size} need {needed / 2**30:.1f} GiB in float32 (parameters plus "
                f"n_layer (block_size, block_size) mask buffers), more than this machine's "
                f"{memory / 2**30:.1f} GiB; check the config's sizes"
            )
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
        # nn.Module.__getattr__ is typed Tensor | Module, so mypy cannot see the ModuleDict's members
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # type: ignore[operator]
        for block in self.transformer.h:  # type: ignore[union-attr]
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # type: ignore[operator]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=self.config.ignore_index
            )
        return logits, loss


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
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
