"""Tensor parallel on a CPU (gloo, one worker process per extra rank): TP=2 gives the greedy
tokens of TP=1 and transformers (tiny Llama and Qwen3, fp32; an int4 checkpoint), the
driver's layers hold their shards, the workers are processes that end with the engine (also
when the driver raises, after serving or mid-step), and a worker killed mid-run ends the
engine with an error naming it instead of a hang."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from atom import LLM, SamplingParams
from atom.distributed.executor import WorkerFailure
from conftest import make_tiny_model
from parallel_helpers import PROMPTS, child_env, hf_tokens, is_gone, wait_gone

os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned workers inherit it
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = dict(num_kvcache_blocks=32, enable_log_stats=False)


def tokens(llm, prompts=PROMPTS, sp=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def tp_llama(tiny_llama):
    llm = LLM(tiny_llama, tensor_parallel_size=2, **KW)
    yield llm
    llm.shutdown()


def test_tp2_llama_matches_tp1_and_transformers(tiny_llama, tp_llama):
    tp1 = tokens(LLM(tiny_llama, **KW))
    assert tokens(tp_llama) == tp1 == hf_tokens(tiny_llama, PROMPTS, 8)
    # a second call (KV blocks reused, prefix of an earlier prompt) still agrees
    assert tokens(tp_llama, PROMPTS[:2]) == tp1[:2]


def test_tp2_workers_are_processes_and_layers_hold_shards(tp_llama):
    ex = tp_llama.engine.executor
    assert [w.rank for w in ex.workers] == [1] and ex.workers[0].alive
    assert ex.workers[0].pid != os.getpid() and not is_gone(ex.workers[0].pid)
    runner = tp_llama.engine.runner
    assert (runner.parallel.rank, runner.parallel.world_size, runner.parallel.backend) == (0, 2, "gloo")
    assert "tp_rank=0/2" in repr(runner)
    m = runner.model  # tiny Llama: hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, vocab 512
    layer = m.model.layers[0]
    assert tuple(layer.self_attn.qkv_proj.weight.shape) == (2 * 16 + 2 * 16, 64)  # 2 q heads + 1 k + 1 v
    assert tuple(layer.self_attn.o_proj.weight.shape) == (64, 32)
    assert tuple(layer.mlp.gate_up_proj.weight.shape) == (128, 64)
    assert tuple(layer.mlp.down_proj.weight.shape) == (64, 64)
    assert tuple(m.model.embed_tokens.weight.shape) == (256, 64) == tuple(m.lm_head.weight.shape)
    assert (layer.self_attn.attn.num_heads, layer.self_attn.attn.num_kv_heads) == (2, 1)
    assert not tp_llama.engine.async_scheduling


def test_tp2_int4_checkpoint_matches_tp1_and_fake_quant_transformers(tmp_path):
    from test_quant_methods import fake_quant_hf, quantize_checkpoint
    from conftest import hf_greedy
    base = make_tiny_model(tmp_path / "base", "llama", hidden_size=128, intermediate_size=256, initializer_range=0.1)
    path = str(tmp_path / "w4a16")
    deq, act = quantize_checkpoint(base, path, "w4a16_g64_asym")
    ref_model = fake_quant_hf(base, deq, act)
    ref = [hf_greedy(ref_model, p, 8) for p in PROMPTS]
    with LLM(path, tensor_parallel_size=2, **KW) as llm:
        qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.method.name == "int4" and tuple(qkv.weight_packed.shape) == (128, 128 // 8)
        down = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert tuple(down.weight_packed.shape) == (128, 128 // 8) and tuple(down.weight_scale.shape) == (128, 2)
        assert tokens(llm) == ref
        # a step that fails on the driver leaves the ranks out of step: the engine stops, naming it
        runner = llm.engine.runner

        def broken(seqs):
            raise RuntimeError("the driver's step broke")

        runner.prepare_host = broken
        with pytest.raises(WorkerFailure, match=r"rank 0 \(the driver\) raised RuntimeError: the driver's step "
                                                r"broke while the engine was running step \d+ .*stopped"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert wait_gone([w.pid for w in llm.engine.executor.workers]) == []
        with pytest.raises(WorkerFailure, match="the driver"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert all(not w.alive for w in llm.engine.executor.workers)


QWEN3_DRIVER = """
import json, sys
from atom import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kvcache_blocks=32, enable_log_stats=False)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "workers": [w.pid for w in llm.engine.executor.workers]}), flush=True)
raise RuntimeError("the driver fails after serving")
"""


def test_tp2_qwen3_in_a_driver_that_raises_matches_and_leaves_no_worker(tiny_qwen3):
    proc = subprocess.run([sys.executable, "-c", QWEN3_DRIVER, tiny_qwen3, json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode != 0 and "the driver fails after serving" in proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == tokens(LLM(tiny_qwen3, **KW)) == hf_tokens(tiny_qwen3, PROMPTS, 8)
    assert len(result["workers"]) == 1 and wait_gone(result["workers"]) == []


def test_killing_a_worker_mid_run_ends_the_engine_with_its_error(tp_llama):
    """Last in this module: it breaks the shared engine."""
    runner, worker = tp_llama.engine.runner, tp_llama.engine.executor.workers[0]
    start = runner.num_steps

    def kill_after_a_few_steps():
        while runner.num_steps < start + 3:
            threading.Event().wait(0.01)
        os.kill(worker.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_a_few_steps, daemon=True)
    killer.start()
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with pytest.raises(WorkerFailure, match=rf"rank 1 \(pid {worker.pid}\) was killed by SIGKILL while the engine "
                                            r"was running step \d+ \(0 prefill and 1 decode sequences\)"):
        tp_llama.generate([[5, 6, 7]], long, use_tqdm=False)
    killer.join(5)
    assert runner.num_steps < start + 400  # it stopped there, not after the whole request
    with pytest.raises(WorkerFailure, match="rank 1"):  # every later step: the same error
        tp_llama.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert tp_llama.engine.is_finished()  # the failed requests were aborted, their blocks freed
    tp_llama.shutdown()
    assert wait_gone([worker.pid]) == []
