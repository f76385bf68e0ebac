"""The reference's own reader of Hugging Face GPT-2 checkpoints (safetensors only), as chapter 11 loads GPT-2XL.

Written apart from the port's reader (``flax_ln.convert``) on purpose: a wrong rename or
transpose shared by both sides would be invisible to every parity check.

Hugging Face names, after the optional ``transformer.`` prefix (present in
``GPT2LMHeadModel`` files, absent in ``GPT2Model`` files), map to the book's keys as
:data:`HF_TO_BOOK` declares. The four Conv1D weights are stored (in, out), the transpose
of ``nn.Linear``. ``lm_head`` is tied to ``wte`` unless ``tie_word_embeddings`` is false.
The ``attn.bias`` and ``attn.masked_bias`` buffers are masks, not weights, and are skipped.

Every check runs on the safetensors headers (names, shapes, dtypes) before any tensor
is read or any model built, so a small file with huge declared sizes fails at once.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from torch_ref.gpt import GPT, GPTConfig

__all__ = ["HF_TO_BOOK", "HFCheckpointError", "gpt_config_from_hf", "load_hf_gpt2", "read_hf_gpt2"]

# Hugging Face key (prefix stripped, layer index as "{i}") -> (book key, transposed, shape as a
# function of (C width, V vocab, P positions), in Hugging Face's layout).
HF_TO_BOOK = {
    "wte.weight": ("transformer.wte.weight", False, lambda C, V, P: (V, C)),
    "wpe.weight": ("transformer.wpe.weight", False, lambda C, V, P: (P, C)),
    "h.{i}.ln_1.weight": ("transformer.h.{i}.ln_1.weight", False, lambda C, V, P: (C,)),
    "h.{i}.ln_1.bias": ("transformer.h.{i}.ln_1.bias", False, lambda C, V, P: (C,)),
    "h.{i}.attn.c_attn.weight": ("transformer.h.{i}.attn.c_attn.weight", True, lambda C, V, P: (C, 3 * C)),
    "h.{i}.attn.c_attn.bias": ("transformer.h.{i}.attn.c_attn.bias", False, lambda C, V, P: (3 * C,)),
    "h.{i}.attn.c_proj.weight": ("transformer.h.{i}.attn.c_proj.weight", True, lambda C, V, P: (C, C)),
    "h.{i}.attn.c_proj.bias": ("transformer.h.{i}.attn.c_proj.bias", False, lambda C, V, P: (C,)),
    "h.{i}.ln_2.weight": ("transformer.h.{i}.ln_2.weight", False, lambda C, V, P: (C,)),
    "h.{i}.ln_2.bias": ("transformer.h.{i}.ln_2.bias", False, lambda C, V, P: (C,)),
    "h.{i}.mlp.c_fc.weight": ("transformer.h.{i}.mlp.c_fc.weight", True, lambda C, V, P: (C, 4 * C)),
    "h.{i}.mlp.c_fc.bias": ("transformer.h.{i}.mlp.c_fc.bias", False, lambda C, V, P: (4 * C,)),
    "h.{i}.mlp.c_proj.weight": ("transformer.h.{i}.mlp.c_proj.weight", True, lambda C, V, P: (4 * C, C)),
    "h.{i}.mlp.c_proj.bias": ("transformer.h.{i}.mlp.c_proj.bias", False, lambda C, V, P: (C,)),
    "ln_f.weight": ("transformer.ln_f.weight", False, lambda C, V, P: (C,)),
    "ln_f.bias": ("transformer.ln_f.bias", False, lambda C, V, P: (C,)),
}
_LM_HEAD = "lm_head.weight"  # never prefixed; (V, C) like nn.Linear, no transpose
_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}

# config.json options the book's GPT can express: the value it needs (HF's default when absent).
_REQUIRED_OPTIONS = {
    "model_type": ("gpt2",),
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # both the tanh GELU
    "layer_norm_epsilon": (1e-5,),  # nn.LayerNorm's default, which the book uses
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "reorder_and_upcast_attn": (False,),
    "add_cross_attention": (False,),
}
_HF_DEFAULTS = {
    "model_type": "gpt2",
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}
_HF_SIZE_DEFAULTS = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "n_positions": 1024}


class HFCheckpointError(ValueError):
    """A Hugging Face GPT-2 checkpoint that does not fit the book's GPT; lists every offending key.

    Attributes:
      missing: book keys the checkpoint lacks (Hugging Face names in the message).
      unexpected: checkpoint keys that are no GPT-2 weight (malformed layer keys included).
      mismatched: ``(key, expected shape, stored shape)`` triples, in Hugging Face's layout.
    """

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)


def _read_json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path``; errors name the file and what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: {err}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(path)!r} must hold a JSON object ({{...}}), got a JSON {type(data).__name__}")
    return data


def gpt_config_from_hf(hf: dict, source: str = "config.json") -> tuple[GPTConfig, bool]:
    """``(GPTConfig, tie_word_embeddings)`` from a Hugging Face GPT-2 ``config.json`` dict.

    Sizes absent from ``hf`` take Hugging Face's ``GPT2Config`` defaults (``n_positions``
    falls back to the older ``n_ctx``). Options the book's GPT cannot express (another
    activation, layer-norm epsilon, attention scaling or cross-attention) are refused.

    Args:
      hf: the parsed ``config.json``.
      source: the file named in error messages.
    """
    sizes = {name: hf.get(name, default) for name, default in _HF_SIZE_DEFAULTS.items()}
    if "n_positions" not in hf and "n_ctx" in hf:
        sizes["n_positions"] = hf["n_ctx"]
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{source}: {name} must be a positive integer, got {value!r}")
    wrong = []
    for option, allowed in _REQUIRED_OPTIONS.items():
        value = hf.get(option, _HF_DEFAULTS[option])
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            wrong.append(f"{option}={value!r} (needs {' or '.join(map(repr, allowed))})")
    n_inner = hf.get("n_inner")
    if n_inner is not None and n_inner != 4 * sizes["n_embd"]:
        wrong.append(f"n_inner={n_inner!r} (needs None or 4 * n_embd)")
    if wrong:
        raise ValueError(f"{source}: this GPT-2 variant cannot be expressed by the book's GPT: {'; '.join(wrong)}")
    tie = hf.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise ValueError(f"{source}: tie_word_embeddings must be true or false, got {tie!r}")
    dropouts = {name: hf.get(name, 0.1) for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop")}
    try:
        config = GPTConfig(
            n_layer=sizes["n_layer"],
            n_head=sizes["n_head"],
            n_embd=sizes["n_embd"],
            vocab_size=sizes["vocab_size"],
            block_size=sizes["n_positions"],
            **dropouts,
        )
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from err
    return config, tie


def _resolve_shard(folder: Path, index_path: Path, key: str, name: Any) -> Path:
    """The shard file ``name`` of ``weight_map[key]``, which must be a relative path that stays inside ``folder``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{str(index_path)!r}: weight_map[{key!r}] must be a shard file name, got {name!r}")
    if os.path.isabs(name):
        raise ValueError(
            f"{str(index_path)!r}: weight_map[{key!r}] = {name!r} is an absolute path; shard names "
            "must be file names relative to the checkpoint folder"
        )
    root = folder.resolve()
    target = (folder / name).resolve()  # follows symlinks, so a link pointing out is caught too
    if not target.is_relative_to(root):
        raise ValueError(
            f"{str(index_path)!r}: weight_map[{key!r}] = {name!r} resolves to {str(target)!r}, outside "
            f"the checkpoint folder {str(root)!r}; shards must lie inside the folder"
        )
    if not target.is_file():
        raise FileNotFoundError(
            f"{str(index_path)!r}: weight_map[{key!r}] names shard {name!r}, which is not a file in {str(folder)!r}"
        )
    return target


def _checkpoint_files(path: Path, config: Any) -> tuple[list[Path], dict | None, tuple[Path, dict] | None]:
    """``(safetensors files, parsed config.json or None, (index file, key -> shard) or None)``."""
    if not path.exists():
        raise FileNotFoundError(f"Hugging Face GPT-2 checkpoint {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(
                f"{str(path)!r}: expected a .safetensors file or a model folder (only safetensors "
                "are read; pickled .bin/.pt files are never unpickled)"
            )
        if config is None:
            raise ValueError(
                f"{str(path)!r} is a single safetensors file with no config.json beside it: pass "
                "config=GPTConfig(...) (or any object with the book's GPT fields)"
            )
        return [path], None, None
    hf_config = None
    if config is None:
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json; pass config=GPTConfig(...)")
        hf_config = _read_json_object(config_path, "config file")
    single, index_path = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single], hf_config, None
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} holds neither model.safetensors nor model.safetensors.index.json. "
            "Only safetensors are read; convert pickled weights with safetensors first"
        )
    index = _read_json_object(index_path, "index file")
    if "weight_map" not in index:
        raise ValueError(
            f'index file {str(index_path)!r} has no "weight_map" entry (keys: {sorted(index)}); '
            'expected {"weight_map": {tensor name: shard file name}}'
        )
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(
            f'index file {str(index_path)!r}: "weight_map" must be a JSON object mapping tensor names '
            f"to shard file names, got a JSON {type(weight_map).__name__}"
        )
    shard_of = {key: _resolve_shard(path, index_path, key, name) for key, name in weight_map.items()}
    return sorted(set(shard_of.values())), hf_config, (index_path, shard_of)


def _read_headers(files: list[Path], index: tuple[Path, dict] | None) -> dict[str, tuple[Path, tuple, str]]:
    """``key -> (file, shape, safetensors dtype name)`` from the headers alone; no tensor is read."""
    from safetensors import SafetensorError, safe_open  # lazily: import torch_ref needs only torch

    entries: dict[str, tuple[Path, tuple, str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    if key in entries:
                        raise ValueError(
                            f"tensor {key!r} is stored twice: in {str(entries[key][0])!r} and {str(file)!r}"
                        )
                    entries[key] = (file, tuple(view.get_shape()), view.get_dtype())
        except SafetensorError as err:
            raise ValueError(f"{str(file)!r} is not a readable safetensors file: {err}") from err
    if index is not None:
        index_path, shard_of = index
        wrong = [
            f"{key!r} -> {shard.name!r}"
            for key, shard in shard_of.items()
            if key not in entries or entries[key][0] != shard
        ]
        if wrong:
            raise ValueError(
                f"index file {str(index_path)!r} places tensors in shards that do not hold them: "
                f"{', '.join(wrong[:10])}{' ...' if len(wrong) > 10 else ''}"
            )
    return entries


def _plan(entries: dict[str, tuple[Path, tuple, str]], config: GPTConfig, tie: bool, source: str):
    """``[(stored key, book key, transposed)]`` for every weight, after checking names, shapes and dtypes.

    Runs on header data only. A declared ``n_layer`` larger than the number of stored
    tensors fails first, before the expected key list (16 keys per layer) is built.
    """
    prefixed = any(key.startswith("transformer.") for key in entries)
    named, unexpected, layers = {}, [], set()  # named: Hugging Face name without prefix -> stored key
    for key in entries:
        if key == _LM_HEAD:
            continue
        bare = key.removeprefix("transformer.")
        if bare in named or (bare != key and bare in entries):
            unexpected.append(key)  # stored twice, with and without the prefix
            continue
        if bare.startswith("h."):
            index = bare.split(".")[1]
            if not (index.isascii() and index.isdigit()) or (len(index) > 1 and index[0] == "0"):
                unexpected.append(key)  # h.x.*, h.01.*: no layer index
                continue
            layers.add(int(index))
            if bare.split(".", 2)[2:] in (["attn.bias"], ["attn.masked_bias"]):
                continue  # causal-mask buffers, not weights
        named[bare] = key
    sizes = (
        f"n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd}, "
        f"vocab_size={config.vocab_size}, n_positions={config.block_size}"
    )
    held = f"layers {sorted(layers)[:8]}{' ...' if len(layers) > 8 else ''}" if layers else "no h.{i} layers"
    if config.n_layer > len(entries):
        raise HFCheckpointError(
            f"{source} declares n_layer={config.n_layer}, but the checkpoint holds {held} in "
            f"{len(entries)} tensors; fix n_layer to match the weights (nothing was allocated)"
        )

    C, V, P = config.n_embd, config.vocab_size, config.block_size
    generic = {
        name.replace("{i}", str(i)): name
        for name in HF_TO_BOOK
        for i in (range(config.n_layer) if "{i}" in name else [0])
    }
    plan, mismatched = [], []
    for bare, key in named.items():
        if bare not in generic:
            unexpected.append(key)
            continue
        book, transposed, shape_of = HF_TO_BOOK[generic[bare]]
        if bare.startswith("h."):
            book = book.replace("{i}", bare.split(".")[1])
        plan.append((key, book, transposed))
        mismatched += [(key, shape_of(C, V, P), entries[key][1])] if entries[key][1] != shape_of(C, V, P) else []
    missing = [("transformer." + name if prefixed else name) for name in generic if name not in named]
    if _LM_HEAD in entries:
        plan.append((_LM_HEAD, "lm_head.weight", False))
        mismatched += [(_LM_HEAD, (V, C), entries[_LM_HEAD][1])] if entries[_LM_HEAD][1] != (V, C) else []
    elif not tie:
        missing.append(_LM_HEAD)
    bad_dtype: dict[str, list[str]] = {}  # file -> ["key (dtype)"]
    for key, _, _ in plan:
        file, _, dtype = entries[key]
        if dtype not in _FLOAT_DTYPES:
            bad_dtype.setdefault(str(file), []).append(f"{key} ({dtype})")
    if bad_dtype:
        listed = "; ".join(f"{file}: {', '.join(keys)}" for file, keys in bad_dtype.items())
        raise HFCheckpointError(
            f"non-floating weights in {listed}. The book's GPT needs floating point (F16, BF16, F32 or F64); "
            "casting integer or bool weights into it would silently give wrong weights. Use the original "
            "floating-point checkpoint"
        )
    if missing or unexpected or mismatched:
        lines = [f"{source}: the checkpoint does not fit the GPT it declares ({sizes}; the checkpoint holds {held})"]
        if missing:
            lines.append(f"  missing: {', '.join(missing)}")
        if unexpected:
            lines.append(f"  unexpected (not a GPT-2 weight, or a malformed layer key): {', '.join(unexpected)}")
        for key, want, shape in mismatched:
            lines.append(
                f"  {key}: expected shape {list(want)} from the declared sizes (Hugging Face layout), got {list(shape)}"
            )
        raise HFCheckpointError("\n".join(lines), missing=missing, unexpected=unexpected, mismatched=mismatched)
    return plan


def read_hf_gpt2(path: str | os.PathLike, *, config: Any = None) -> tuple[GPTConfig, bool, dict[str, torch.Tensor]]:
    """``(config, tie_word_embeddings, state dict)`` of a Hugging Face GPT-2 checkpoint, in the book's layout.

    The tensors keep their stored dtypes (read them to name a checkpoint's dtype).
    The state dict holds every weight under the book's key, Conv1D weights transposed
    to ``nn.Linear``'s (out, in); ``lm_head.weight`` only when the file stores it. See
    :func:`load_hf_gpt2` for ``path`` and ``config``.
    """
    from safetensors import safe_open

    path = Path(path)
    files, hf_config, index = _checkpoint_files(path, config)
    if config is not None:  # replaces config.json
        config, tie, source = GPTConfig.from_any(config), True, "the given config"
    else:
        source = str(path / "config.json")
        assert hf_config is not None  # _checkpoint_files reads config.json whenever no config is given
        config, tie = gpt_config_from_hf(hf_config, source)
    entries = _read_headers(files, index)
    plan = _plan(entries, config, tie, source)
    state: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(str(file), framework="pt")) for file in files}
        for key, book, transposed in plan:
            tensor = handles[entries[key][0]].get_tensor(key)
            state[book] = tensor.t().contiguous() if transposed else tensor  # (in, out) -> (out, in)
    return config, tie, state


def load_hf_gpt2(path: str | os.PathLike, *, config: Any = None, dtype: torch.dtype = torch.float32) -> GPT:
    """A :class:`GPT` holding a Hugging Face GPT-2 checkpoint, in eval mode, as chapter 11 loads GPT-2XL.

    ``logits = lm_head(ln_f(blocks(wte[idx] + wpe[pos])))`` with Hugging Face's weights:
    every Conv1D weight transposed, ``lm_head.weight = wte.weight`` when tied (a stored
    ``lm_head.weight`` must then equal ``wte``), the mask buffers skipped. The copy is
    strict. Half-precision files (float16, bfloat16) load too, cast to ``dtype`` (exactly
    for float32 and float64); integer or bool weights are refused.

    Args:
      path: a folder as ``save_pretrained`` writes it (``config.json`` plus
        ``model.safetensors`` or a sharded ``model.safetensors.index.json``), or one
        ``.safetensors`` file, which needs ``config``. Keys may carry the
        ``transformer.`` prefix (``GPT2LMHeadModel``) or not (``GPT2Model``).
      config: used instead of ``config.json``: a :class:`GPTConfig` or any object with
        the book's GPT fields (a given config implies tied embeddings).
      dtype: floating dtype of the returned model's parameters.

    Raises:
      FileNotFoundError: no checkpoint, no ``config.json``, no safetensors, a missing shard.
      ValueError: malformed JSON, a shard path leaving the folder, a config variant the
        book's GPT cannot express; :class:`HFCheckpointError` for weights that do not fit
        (missing, unexpected, mis-shaped, non-floating, or untied ``lm_head``).
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"load_hf_gpt2: dtype must be a floating torch.dtype, got {dtype!r}")
    config, tie, state = read_hf_gpt2(path, config=config)
    wte = state["transformer.wte.weight"]
    if tie:
        stored_head = state.get("lm_head.weight")
        if stored_head is not None and not torch.equal(stored_head, wte):
            raise HFCheckpointError(
                f"{str(path)!r}: lm_head.weight differs from transformer.wte.weight although "
                "tie_word_embeddings is true; set it to false in config.json to keep both",
                mismatched=[("lm_head.weight", tuple(wte.shape), tuple(stored_head.shape))],
            )
        state["lm_head.weight"] = wte
    model = GPT(config)
    buffers = {key: value for key, value in model.state_dict().items() if key.endswith(".attn.bias")}
    model.load_state_dict({**state, **buffers}, strict=True)
    return model.to(dtype).eval()
