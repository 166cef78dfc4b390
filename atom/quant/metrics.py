"""Teacher-forced logits and the figures that compare two models on them.

    base = teacher_forced_logits(runner, ids)   # [T, vocab] fp32, the engine's model on ids
    scores(base, quantized, ids)                # kl, top1, ppl (of the second), ...
    ref = Reference(base, ids); ref.scores(q)   # the same, base's terms computed once

Teacher forcing: the whole text is one prefill; the logits at position t predict token
t + 1, so both models see the same inputs whatever they would have generated.
"""
from __future__ import annotations

import math

import torch

from atom.model_engine.sequence import Sequence
from atom.model_ops.attention import forward_context


class TeacherForcedRun:
    """The forward of one text as a single prefill into `runner`'s KV cache from block 0
    (the runner must not be serving requests meanwhile), keeping the input of every decoder
    layer: `logits()` runs the whole model and records them, `logits(start=k)` reruns only
    decoder layers k.. from the recorded input of layer k (what a change confined to layers
    >= k needs). Models without `model.embed_tokens / layers / norm` always run whole."""

    def __init__(self, runner, token_ids: list[int]):
        n = len(token_ids)
        blocks = -(-n // runner.block_size)
        if blocks > runner.num_blocks:
            raise ValueError(f"text of {n} tokens needs {blocks} KV blocks; the runner has {runner.num_blocks}: "
                             "shorten the text or build the engine with more num_kvcache_blocks")
        if n > runner.config.max_model_len:
            raise ValueError(f"text of {n} tokens exceeds max_model_len={runner.config.max_model_len}")
        self.runner, self.token_ids = runner, list(token_ids)
        seq = Sequence(self.token_ids)
        seq.block_table = list(range(blocks))
        seq.num_new_tokens = n
        self.input_ids, self.positions, self.meta = runner.to_device(runner.prepare_host([seq]))
        inner = getattr(runner.model, "model", None)
        self.inner = inner if all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")) else None
        self.inputs: list | None = None  # (hidden, residual) entering each decoder layer

    @torch.inference_mode()
    def logits(self, start: int = 0) -> torch.Tensor:
        """Logits [T, vocab] (fp32, CPU) at every position."""
        r = self.runner
        with forward_context(r.bind(self.meta)):
            if self.inner is None:
                hidden = r.model(self.input_ids, self.positions)
            else:
                if start == 0 or self.inputs is None:
                    start, state, record = 0, (self.inner.embed_tokens(self.input_ids), None), True
                else:
                    state, record = self.inputs[start], False
                inputs = list(self.inputs or [None] * len(self.inner.layers))
                for i in range(start, len(self.inner.layers)):
                    if record:
                        inputs[i] = state
                    state = self.inner.layers[i](self.positions, *state)
                if record:
                    self.inputs = inputs
                hidden, _ = self.inner.norm(*state)
        return r.model.compute_logits(hidden).float().cpu()


def teacher_forced_logits(runner, token_ids: list[int]) -> torch.Tensor:
    """The logits [T, vocab] (fp32, on the CPU) of `runner`'s model at every position of
    `token_ids` (one `TeacherForcedRun`)."""
    return TeacherForcedRun(runner, token_ids).logits()


class Reference:
    """What `scores` needs of `base` ([T, vocab]) on `token_ids`, computed once: its log-softmax,
    probabilities, argmax and NLL on the T - 1 predicted positions (a sensitivity run scores
    every group against the same base)."""

    def __init__(self, base: torch.Tensor, token_ids: list[int]):
        self.b = base[:-1].float()
        self.lb = torch.log_softmax(self.b, -1)
        self.pb = self.lb.exp()
        self.argmax = self.b.argmax(-1)
        self.target = torch.as_tensor(token_ids[1:])
        self.nll = -self.lb.gather(1, self.target[:, None]).mean()

    def scores(self, other: torch.Tensor) -> dict[str, float]:
        """`scores(base, other, token_ids)`, the base's terms reused."""
        o = other[:-1].float()
        lo = torch.log_softmax(o, -1)
        kl = (self.pb * (self.lb - lo)).sum(-1).clamp(min=0)
        nll_o = -lo.gather(1, self.target[:, None]).mean()
        return {"kl": float(kl.mean()), "kl_max": float(kl.max()),
                "top1": float((self.argmax == o.argmax(-1)).float().mean()),
                "ppl": math.exp(float(nll_o)), "ppl_base": math.exp(float(self.nll)), "positions": int(self.b.shape[0])}


def scores(base: torch.Tensor, other: torch.Tensor, token_ids: list[int]) -> dict[str, float]:
    """How `other`'s next-token distributions compare with `base`'s ([T, vocab] each) on
    the T - 1 predicted positions: mean KL(base || other) in nats, top-1 agreement (share
    of positions with the same argmax), and both perplexities on `token_ids`."""
    return Reference(base, token_ids).scores(other)


@torch.inference_mode()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """The same for a transformers model (one forward, no cache)."""
    ids = torch.tensor([token_ids], device=model.device)
    return model(input_ids=ids, use_cache=False).logits[0].float().cpu()
