import sys; sys.path.insert(0, "tests")
from test_gpu_engine import bf16_agreement, make, SHAPES
for init in (0.02, 0.1, 0.2, 0.45):
    for name in ("qwen3", "llama"):
        p = make(f"/tmp/diag_{name}_{init}", {**SHAPES[name], "initializer_range": init})
        print("DIAG", name, init, bf16_agreement(p), flush=True)
