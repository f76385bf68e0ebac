"""Weight conversion between torch state dicts and flax models.

:func:`load_torch_state_dict` and :func:`to_torch_state_dict` (:mod:`~flax_ln.convert.state_dict`)
go through one of two tables. The rule table (:mod:`~flax_ln.convert.rules`: standard
``torch.nn`` layers and the book's modules, and its extension points) serves NNX models that
mirror their torch twins; a :class:`KeyMap` (:mod:`~flax_ln.convert.keymap`, loaded and
exported by :mod:`~flax_ln.convert.keymap_transfer`) is a port's own table from torch keys to
its variables, for ports that do not mirror torch's modules, over any variable tree
(:mod:`~flax_ln.convert.trees`). Both share the layouts (:mod:`~flax_ln.convert.layouts`),
the errors (:mod:`~flax_ln.convert.errors`) and the write into a variable
(:mod:`~flax_ln.convert.assign`); ties are found by :mod:`~flax_ln.convert.ties`.
:mod:`~flax_ln.convert.hf` reads Hugging Face GPT-2 checkpoints through the rule table (onto
a mesh if given) and writes them back, on the lazy safetensors reader of
:mod:`~flax_ln.convert.tensor_files`.
"""

from flax_ln.convert.discover import Discovery
from flax_ln.convert.errors import ConversionError, MissingRuleError
from flax_ln.convert.hf import (
    HF_GPT2_KEYS,
    gpt_config_from_hf,
    hf_config_from_gpt,
    load_hf_gpt2,
    read_hf_gpt2,
    save_hf_gpt2,
)
from flax_ln.convert.keymap import KeyMap, KeyPlan, Target
from flax_ln.convert.keymap_transfer import fill_tree
from flax_ln.convert.layouts import Permute
from flax_ln.convert.rules import (
    RULES,
    DerivedBuffer,
    Leaf,
    ModuleRule,
    register_rename,
    register_rule,
    rule_for,
    torch_activation,
    torch_module_paths,
)
from flax_ln.convert.state_dict import load_torch_state_dict, to_torch_state_dict
from flax_ln.convert.ties import Tie, find_ties
from flax_ln.convert.trees import LinenTree, PytreeTree

__all__ = [
    "ConversionError",
    "DerivedBuffer",
    "Discovery",
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
