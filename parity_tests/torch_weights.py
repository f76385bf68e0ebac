"""Torch weights for the localisation tests, shared by their files (not a test module: pytest collects test_*.py)."""

import torch


def randomized(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """Weights of unit scale (norm scales near 1), so that a planted mistake shows at float32's tolerance."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else noise / (p[0].numel() ** 0.5 or 1.0))
    return model.to(getattr(torch, dtype)).eval()
