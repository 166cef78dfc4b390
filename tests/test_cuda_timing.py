"""`cuda_timing.checked_graph_time`, the step every kernel sweep takes per configuration: the
first output becomes the reference, a later one that differs or a call that raises gives an
error string and no timing, the rest are timed (`graph_time` stands in for the GPU here)."""
import torch

import atom.utils.cuda_timing as cuda_timing


def test_checked_graph_time_reference_mismatch_and_errors(monkeypatch):
    timed = []
    monkeypatch.setattr(cuda_timing, "graph_time", lambda calls, iters=25: timed.append((len(calls), iters)) or 1e-6)
    out = torch.zeros(4)

    def writes(v):
        return lambda: out.fill_(v)

    t, ref = cuda_timing.checked_graph_time(writes(1.0), out, None, repeat=2, iters=7)
    assert t == 1e-6 and torch.equal(ref, torch.ones(4)) and ref is not out and timed == [(2, 7)]
    t, ref2 = cuda_timing.checked_graph_time(writes(1.01), out, ref)  # within the tolerance
    assert t == 1e-6 and ref2 is ref and timed[-1] == (4, 25)
    t, _ = cuda_timing.checked_graph_time(writes(2.0), out, ref)
    assert t.startswith("mismatch") and len(timed) == 2

    def raises():
        raise RuntimeError("out of resources: shared memory")
    t, ref3 = cuda_timing.checked_graph_time(raises, out, ref)
    assert t == "RuntimeError: out of resources: shared memory" and ref3 is ref and len(timed) == 2
