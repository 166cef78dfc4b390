"""Schema rules for ATOM's registered ops (torch.library.custom_op) that CPU runs cannot see.

torch 2.11's ADInplaceOrView kernel for a custom op indexes the boxed arguments by the
mutated argument's schema position, while the dispatcher leaves out trailing arguments equal
to their defaults: a mutated argument with a default, passed as its default (an optional
output left None), raised IndexError inside every forward on the GPU. torch 2.13 fills the
defaults first, so the CPU suite runs such an op fine; this test keeps the rule instead."""
import importlib

import torch

# the modules that register ATOM's ops (importing them registers the ops, GPU or not)
OP_MODULES = [
    "atom.model_ops.attention.triton_backend", "atom.model_ops.attention.mla_triton",
    "atom.model_ops.kernels.graph_ops", "atom.model_ops.kernels.quant_gemv_dot", "atom.model_ops.kernels.w4_gemm",
    "atom.model_ops.kernels.act_quant", "atom.model_ops.kernels.quant_gemm", "atom.model_ops.moe.experts_op",
    "atom.model_ops.quant.common", "atom.model_ops.quant.unquantized",
]


def _atom_schemas():
    for m in OP_MODULES:
        importlib.import_module(m)
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
