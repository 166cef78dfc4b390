"""Helpers of the parallel tests: whether a process is gone, the reference tokens."""
from __future__ import annotations

import os
import time

import torch

PROMPTS = [[5, 6, 7, 8], list(range(9, 29)), [1, 2, 3], [300, 301, 302, 303, 304, 305, 306]]


def is_gone(pid: int) -> bool:
    """The process exited (a zombie waiting for its parent to reap it counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def wait_gone(pids, timeout_s: float = 20.0) -> list[int]:
    """The pids still running after up to `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not is_gone(p)]
        if alive:
            time.sleep(0.1)
    return alive


def hf_tokens(path: str, prompts, n: int) -> list[list[int]]:
    import transformers
    from conftest import hf_greedy
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_greedy(model, p, n) for p in prompts]


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return env
