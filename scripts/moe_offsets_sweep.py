import torch, triton
from atom.utils.cuda_timing import graph_time
from atom.model_ops.moe import experts_triton as et
dev = "cuda"
for T, E, k, bm in [(130, 64, 6, 16), (130, 128, 8, 16), (130, 32, 4, 16), (130, 256, 8, 16), (16384, 64, 6, 64), (16384, 128, 8, 64)]:
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)]).int()
    P = ids.numel(); nb = -(-P // bm) + E
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E).int()
    starts = torch.empty_like(counts)
    be = torch.empty(nb, dtype=torch.int32, device=dev)
    ep = triton.next_power_of_2(E)
    ref = None
    res = []
    for bj in (16, 32, 64, 128, 256):
        for nw in (1, 2, 4):
            def offs(bj=bj, nw=nw):
                et._moe_offsets_kernel[(1,)](counts, starts, be, E, nb, BLOCK_M=bm, E_PAD=ep, BLOCK_J=bj, num_warps=nw)
            offs()
            if ref is None:
                ref = be.clone()
            assert torch.equal(be, ref)
            res.append((graph_time([offs] * 8, iters=20) * 1e6, bj, nw))
    res.sort()
    default = max(16, min(256, 16384 // ep))
    d = [r for r in res if r[1] == default and r[2] == 4][0]
    print(f"T={T} E={E} nb={nb}: default BJ={default} nw4 {d[0]:.2f} us; best " + ", ".join(f"BJ{b}/nw{n} {t:.2f}" for t, b, n in res[:5]), flush=True)
