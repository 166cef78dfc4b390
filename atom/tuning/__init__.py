"""The kernel plan: start-up kernel choices (GEMV, cuBLASLt) and the fusions the runner
installs, owned by one engine (`KernelPlan`; `gemv_choice`, `gemm_choice`, `fusions`)."""
from atom.tuning.plan import FUSIONS, KernelPlan

__all__ = ["KernelPlan", "FUSIONS"]
