"""Where a benchmark figure came from, for the JSON it writes: the commit of this checkout
(``+dirty`` when tracked files differ from it), torch and triton versions and, on a GPU, its
UUID and SM count (the JSON's ``device`` already names it).

The UUID matters: lent H200s of one kind ran the same code up to ~5% apart (docs/perf, the
eleventh session), so figures compare only within one machine.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional

import torch

_REPO = Path(__file__).resolve().parents[2]


def git_commit(root: Path = _REPO) -> Optional[str]:
    """Short commit of the checkout at `root`, with ``+dirty`` when tracked files differ from
    it; None outside a git checkout (or without git). ``ATOM_BENCH_COMMIT`` overrides it, for
    copies of a tree whose ``.git`` is not the tree's own (a working tree sent to a lent
    machine carries the ``.git`` of an older state)."""
    if os.environ.get("ATOM_BENCH_COMMIT"):
        return os.environ["ATOM_BENCH_COMMIT"]
    def git(*args: str) -> Optional[str]:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if changed else "")


def provenance() -> dict:
    """Commit, library versions and the GPU's identity (if any) of this process."""
    info = {"commit": git_commit(), "torch": torch.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        # the name too: leases alternate between H100s and H200s, whose figures differ
        info.update(gpu_name=p.name, gpu_uuid=str(p.uuid), sm_count=p.multi_processor_count)
    return info
