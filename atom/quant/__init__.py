"""The quantization sensitivity explorer.

    from atom.quant import SensitivityExplorer, online_config, plot_sensitivity
    ex = SensitivityExplorer("embedded")
    df = ex.run("ptpc_fp8", by="layer")          # kl, top1, ppl per layer (DataFrame)
    plot_sensitivity(df)
    cfg = online_config(df, keep=4)              # an online_quant_config leaving 4 out
    LLM("embedded", online_quant_config=cfg)
    choice = choose_formats([ex.run(f) for f in ("mxfp4", "ptpc_fp8")], budget_bytes)
    ex.evaluate(mixed_config(choice))            # a format per layer within a size budget

Formats: `atom.model_ops.quant.online.FORMATS` (the guide's `ptpc_fp8` and `mxfp4`, plus
fp8_block, w8a8_int8, w4a16_g32/g64 for exploring; an online_quant_config takes the guide's).
"""
from atom.quant.metrics import hf_logits, scores, teacher_forced_logits
from atom.quant.budget import choose_formats, mixed_config
from atom.quant.plot import plot_choice, plot_sensitivity
from atom.quant.sensitivity import (GROUPINGS, SensitivityExplorer, most_sensitive, online_config,
                                    write_online_config)

__all__ = ["SensitivityExplorer", "online_config", "write_online_config", "most_sensitive", "plot_sensitivity",
           "choose_formats", "mixed_config", "plot_choice",
           "teacher_forced_logits", "scores", "hf_logits", "GROUPINGS"]
