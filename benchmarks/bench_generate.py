"""Generation benchmark: ``flax_ln.generate`` against transformers' ``generate`` and torch_ref's loop.

Row ``gpt2-generate`` (float32, this CPU; ``--quick`` shrinks to a 2-layer, 64-wide toy
with prompt 4, 8 new tokens, B=1 and B=2):

* GPT-2 124M (a random ``GPT2Config()`` model from transformers, ``torch.manual_seed(0)``),
  the **same weights** in every candidate: saved with ``save_pretrained(safe_serialization=True)``
  and read back by ``flax_ln.load_hf_gpt2`` and ``torch_ref.load_hf_gpt2``.
* Cases: greedy and sampled (temperature 1 and **top_k=50 on every side**, transformers'
  default), B=1 and B=8, a random 16-token prompt, 128 new tokens.
* Candidates: ``flax_ln.generate`` (one jitted loop with a KV cache; the timed call includes
  its ``nnx.split`` and the input checks, as a user calls it); transformers'
  ``GPT2LMHeadModel.generate`` (``use_cache=True``, ``min_new_tokens=max_new_tokens`` so
  it never stops early, ``pad_token_id`` set, an all-ones attention mask); torch_ref's own
  loop ``torch_ref.gpt.generate`` under ``torch.no_grad()`` (the book's loop: no cache, the
  whole context recomputed per token). torch_ref's cost grows with the square of the
  length, so it runs at B=1 only, once per case.
* Per case: total time for 128 tokens, time to first token (the same call with
  ``max_new_tokens=1``: prefill and first pick), time per token ``(t128 - t1) / 127``, the
  ratio flax_ln / transformers of the totals (target <= 0.7x) and of the per-token times,
  and for greedy decoding how many of the generated tokens flax_ln and transformers share.
* Timing: medians over interleaved rounds, at most 3 at full size (``--repeats`` caps it),
  after one warm-up call of each candidate (flax_ln compiles there).

Run it alone: ``python benchmarks/run.py --only gpt2-generate`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from common import Config, Table, interleaved, ratio_row, register, torch_device

import flax_ln

TOP_K = 50  # sampled cases: transformers' default top_k, passed explicitly to every side


def candidates_for(hf_model, ours, reference, prompt: np.ndarray, new: int, greedy: bool, with_reference: bool):
    """``{name: fn}`` of zero-argument calls, each generating 1 or ``new`` tokens and returning numpy ids."""
    import torch

    from torch_ref.gpt import generate as reference_generate

    idx_jax = jnp.asarray(prompt, jnp.int32)
    device = next(hf_model.parameters()).device
    idx_torch = torch.as_tensor(prompt, dtype=torch.long, device=device)
    mask = torch.ones_like(idx_torch)
    key = jax.random.key(0)
    sampling = {"temperature": 0.0} if greedy else {"temperature": 1.0, "top_k": TOP_K}
    hf_sampling = (
        {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": TOP_K, "top_p": 1.0}
    )

    def flax_call(n):
        return lambda: np.asarray(flax_ln.generate(ours, idx_jax, n, rng=key, **sampling))

    def hf_call(n):
        def run():
            out = hf_model.generate(
                idx_torch,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                use_cache=True,
                pad_token_id=hf_model.config.eos_token_id,
                **hf_sampling,
            )
            return out.cpu().numpy()

        return run

    def reference_call(n):
        def run():
            with torch.no_grad():
                return reference_generate(reference, idx_torch, n, **sampling).cpu().numpy()

        return run

    main = {}
    for n in (1, new):
        main[f"flax_ln t{n}"] = flax_call(n)
        main[f"transformers t{n}"] = hf_call(n)
    extra = {f"torch_ref t{n}": reference_call(n) for n in (1, new)} if with_reference else {}
    return main, extra


@register("gpt2-generate")
def gpt2_generate(cfg: Config) -> list[Table]:
    import torch
    import transformers

    import torch_ref

    if cfg.quick:
        hf_config = transformers.GPT2Config(
            n_layer=2, n_head=4, n_embd=64, vocab_size=256, n_positions=64, bos_token_id=255, eos_token_id=255
        )
        prompt_len, new, batches, repeats = 4, 8, (1, 2), cfg.repeats
    else:
        hf_config = transformers.GPT2Config()
        prompt_len, new, batches, repeats = 16, 128, (1, 8), max(1, min(cfg.repeats, 3))
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(hf_config).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(folder, safe_serialization=True)
        ours = flax_ln.load_hf_gpt2(folder)
        reference = torch_ref.load_hf_gpt2(folder)
    device = torch_device()
    hf_model.to(device)
    reference.to(device)

    summary, detail = [], []
    notes = [
        f"{hf_config.n_layer} layers, n_embd {hf_config.n_embd}, vocab {hf_config.vocab_size}, float32, the same "
        f"weights everywhere; prompt {prompt_len}, {new} new tokens; sampled = temperature 1, top_k {TOP_K}; "
        f"median of {repeats} interleaved rounds after 1 warm-up; torch on {device}, {torch.get_num_threads()} threads",
        "time to first token = a max_new_tokens=1 call; per token = (t_new - t1) / (new - 1)",
        "torch_ref.gpt.generate recomputes the whole context per token (the book's loop): B=1 only, one timed call",
    ]
    for greedy in (True, False):
        mode = "greedy" if greedy else f"sampled (top_k {TOP_K})"
        for batch in batches:
            prompt = np.random.default_rng(batch).integers(0, hf_config.vocab_size, (batch, prompt_len))
            main, extra = candidates_for(hf_model, ours, reference, prompt, new, greedy, with_reference=batch == 1)
            t = interleaved(main, repeats, 1)
            if extra:
                t.update(
                    interleaved(extra, 1, 0, lead_in=0)
                )  # one costly call each; the t1 call comes first and warms torch up
            case = f"{mode}, B={batch}"
            summary.append(
                ratio_row(
                    f"generate {case}", "flax_ln", t[f"flax_ln t{new}"], "transformers", t[f"transformers t{new}"], 0.7
                )
            )
            same = ""
            if greedy:
                a, b = main[f"flax_ln t{new}"](), main[f"transformers t{new}"]()
                same = f"{int((a[:, prompt_len:] == b[:, prompt_len:]).sum())}/{batch * new}"
            hf_per_token = (t[f"transformers t{new}"].median - t["transformers t1"].median) / (new - 1)
            for name in ("flax_ln", "transformers", "torch_ref"):
                if f"{name} t1" not in t:
                    continue
                total, first = t[f"{name} t{new}"].median, t[f"{name} t1"].median
                per_token = (total - first) / (new - 1)
                detail.append(
                    [
                        case,
                        name,
                        total,
                        first * 1e3,
                        per_token * 1e3,
                        total / t[f"transformers t{new}"].median,
                        per_token / hf_per_token,
                        same if name == "flax_ln" else "",
                    ]
                )
    return [
        Table(
            "GPT-2 generation (prompt, new tokens, KV cache): ratios (lower is better)",
            ["workload", "comparison", "ratio", "target", "met"],
            summary,
            notes,
        ),
        Table(
            "GPT-2 generation: times per case",
            [
                "case",
                "candidate",
                "total s",
                "first token ms",
                "per token ms",
                "total / transformers",
                "per token / transformers",
                "greedy tokens equal to transformers",
            ],
            detail,
        ),
    ]
