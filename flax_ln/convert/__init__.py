"""Weight conversion between torch state dicts and NNX modules.

:mod:`flax_ln.convert.rules` holds the one rule table (standard ``torch.nn`` layers
and the book's modules), its extension points and the strict loader;
:mod:`flax_ln.convert.hf` reads Hugging Face GPT-2 checkpoints through it (onto a mesh if
given) and writes them back; :mod:`flax_ln.convert.keymap` holds :class:`KeyMap`, a port's
own table from torch keys to its variables, for ports that do not mirror torch's modules.
"""

from flax_ln.convert.hf import (
    HF_GPT2_KEYS,
    gpt_config_from_hf,
    hf_config_from_gpt,
    load_hf_gpt2,
    read_hf_gpt2,
    save_hf_gpt2,
)
from flax_ln.convert.keymap import KeyMap, KeyPlan, LinenTree, PytreeTree, Target, Tie, fill_tree, find_ties
from flax_ln.convert.rules import (
    RULES,
    ConversionError,
    DerivedBuffer,
    Leaf,
    MissingRuleError,
    ModuleRule,
    Permute,
    load_torch_state_dict,
    register_rename,
    register_rule,
    rule_for,
    to_torch_state_dict,
    torch_activation,
    torch_module_paths,
)

__all__ = [
    "ConversionError",
    "DerivedBuffer",
    "HF_GPT2_KEYS",
    "KeyMap",
    "KeyPlan",
    "Leaf",
    "LinenTree",
    "MissingRuleError",
    "ModuleRule",
    "Permute",
    "PytreeTree",
    "RULES",
    "Target",
    "Tie",
    "fill_tree",
    "find_ties",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "load_hf_gpt2",
    "load_torch_state_dict",
    "read_hf_gpt2",
    "register_rename",
    "register_rule",
    "rule_for",
    "save_hf_gpt2",
    "to_torch_state_dict",
    "torch_activation",
    "torch_module_paths",
]
