"""Schema rules for ATOM's registered ops (torch.library.custom_op) that CPU runs cannot see.

torch 2.11's ADInplaceOrView kernel for a custom op indexes the boxed arguments by the
mutated argument's schema position, while the dispatcher leaves out trailing arguments equal
to their defaults: a mutated argument with a default, passed as its default (an optional
output left None), raised IndexError inside every forward on the GPU. torch 2.13 fills the
defaults first, so the CPU suite runs such an op fine; this test keeps the rule instead."""
import importlib
import pkgutil

import torch

import atom.model_ops


def _atom_schemas():
    """Every op ATOM registers: importing each module under `atom.model_ops` registers them
    (GPU or not); a module that needs an absent third-party package (the aiter kernels) is
    left out."""
    for info in pkgutil.walk_packages(atom.model_ops.__path__, "atom.model_ops."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as err:
            if (err.name or "").startswith("atom"):
                raise
    names = sorted({n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith("atom::")})
    return {n: getattr(torch.ops.atom, n).default._schema for n in names}


def test_mutated_arguments_have_no_defaults():
    schemas = _atom_schemas()
    assert "unified_attention_with_output" in schemas and "quant_linear" in schemas
    mutated = {}
    for name, schema in schemas.items():
        for a in schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                mutated.setdefault(name, []).append(a.name)
                assert not a.has_default_value(), (
                    f"atom::{name} mutates {a.name!r}, which has a default: the dispatcher drops it "
                    "when passed as its default and torch 2.11's ADInplaceOrView indexes past the end")
    assert mutated["unified_attention_with_output"] == ["output", "amax"]
