"""Runs one of the sm90 PTX-check scripts in a child process (no interpreter there, as the
compile for an NVIDIA target needs) and returns its JSON result: the tests that check what
the kernels compile to on Hopper share it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_sm90_check(script: str):
    """The last stdout line of tests/`script`, parsed (skips where triton has no ptxas)."""
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no ptxas for NVIDIA targets")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-W", "ignore", os.path.join(here, script)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
