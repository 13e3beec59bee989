"""fmoe.models without transformers: routers, experts, combine orders and balance functions
against straightforward per-token loops written here from spec/architectures.md."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from fmoe import losses, routers
from fmoe.models import deepseek_v3, gpt_oss, mixtral, qwen2_moe, qwen3_moe
from fmoe.experts import gpt_oss as gpt_oss_experts
from fmoe.experts import swiglu as swiglu_experts
from fmoe.layout import padded_layout
from fmoe.ops.orders import eager_combine, grouped_combine
from fmoe.routing import make_routing


def to_routing(ids, w, E):
    """Dropless routing from router output in transformers' [T, k] layout."""
    return make_routing(ids.t().contiguous(), w.t().contiguous(), E, 0.0)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- per-token references

def ref_qwen(x, W, k, norm):
    ids, ws = [], []
    for t in range(x.shape[0]):
        logits = x[t] @ W.t()                       # dt
        p = torch.softmax(logits.float(), dim=0)
        order = sorted(range(W.shape[0]), key=lambda e: -p[e].item())[:k]
        w = p[order]
        if norm:
            w = w / w.sum()
        ids.append(order)
        ws.append(w.to(x.dtype))
    return torch.tensor(ids), torch.stack(ws)


def ref_deepseek(x, W, b, k, n_group, topk_group, norm, rsf):
    E = W.shape[0]
    G = E // n_group
    ids, ws = [], []
    for t in range(x.shape[0]):
        s = torch.sigmoid(x[t].float() @ W.float().t())
        c = s + b
        gscore = [sorted(c[g * G:(g + 1) * G].tolist())[-2:] for g in range(n_group)]
        gscore = [a + bb for a, bb in gscore]
        keep = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        cand = [e for e in range(E) if e // G in keep]
        chosen = sorted(cand, key=lambda e: -c[e].item())[:k]
        w = s[chosen]
        if norm:
            w = w / (w.sum() + 1e-20)
        ids.append(chosen)
        ws.append(w * rsf)
    return torch.tensor(ids), torch.stack(ws)


def ref_gpt_oss(x, W, b, k):
    ids, ws = [], []
    for t in range(x.shape[0]):
        logits = F.linear(x[t:t + 1], W, b)[0]       # one fused GEMM + bias, as nn.Linear
        order = sorted(range(W.shape[0]), key=lambda e: -logits[e].item())[:k]
        ids.append(order)
        ws.append(torch.softmax(logits[order], dim=0))
    return torch.tensor(ids), torch.stack(ws)


def by_expert(ids, w):
    """Sort each row's (id, weight) pairs by expert id: sets + weights comparable (spec §14)."""
    o = ids.argsort(dim=1)
    return ids.gather(1, o), w.gather(1, o)


# --------------------------------------------------------------------------- routers

@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_router_matches_loop(norm, dtype):
    g = _gen(1)
    x = torch.randn(40, 16, generator=g).to(dtype)
    W = torch.randn(12, 16, generator=g).to(dtype)
    logits, w, ids = routers.qwen_topk(x, W, 3, norm_topk_prob=norm)
    assert logits.dtype == dtype and w.dtype == dtype and ids.dtype == torch.int64
    rid, rw = ref_qwen(x, W, 3, norm)
    assert torch.equal(ids, rid)                       # sorted descending, slot 0 best
    torch.testing.assert_close(w, rw)  # per-token GEMV vs GEMM: ulp-level
    if norm and dtype == torch.float32:
        torch.testing.assert_close(w.sum(1), torch.ones(40))


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1), (8, 3)])
def test_deepseek_router_matches_loop(n_group, topk_group):
    g = _gen(2)
    E, k, rsf = 16, 4, 2.5
    x = torch.randn(64, 24, generator=g).to(torch.bfloat16)   # router upcasts to fp32
    W = torch.randn(E, 24, generator=g) * 0.3
    b = torch.randn(E, generator=g) * 0.1
    logits, w, ids = routers.deepseek_topk(x, W, b, k, n_group=n_group, topk_group=topk_group,
                                           norm_topk_prob=True, routed_scaling_factor=rsf)
    assert logits.dtype == torch.float32 and w.dtype == torch.float32
    rid, rw = ref_deepseek(x, W, b, k, n_group, topk_group, True, rsf)
    i1, w1 = by_expert(ids, w)
    i2, w2 = by_expert(rid, rw)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(w1, w2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.sum(1), torch.full((64,), rsf))   # rows sum to rsf, not 1
    # The bias steers selection but the weights are the *unbiased* sigmoid scores.
    s = torch.sigmoid(x.float() @ W.t())
    torch.testing.assert_close(w / rsf * (s.gather(1, ids).sum(1, keepdim=True) + 1e-20), s.gather(1, ids))


def test_deepseek_group_limit_is_exercised():
    g = _gen(3)
    x, W, b = torch.randn(64, 24, generator=g), torch.randn(16, 24, generator=g), torch.zeros(16)
    _, _, limited = routers.deepseek_topk(x, W, b, 4, n_group=4, topk_group=1)
    _, _, free = routers.deepseek_topk(x, W, b, 4, n_group=1, topk_group=1)
    assert (limited // 4 == limited[:, :1] // 4).all()           # all k in one group
    assert not torch.equal(limited.sort(1).values, free.sort(1).values)


def test_deepseek_router_errors():
    x, W = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="n_group"):
        routers.deepseek_topk(x, W, None, 2, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="topk_group"):
        routers.deepseek_topk(x, W, None, 2, n_group=3, topk_group=4)
    with pytest.raises(ValueError, match="k must"):
        routers.deepseek_topk(x, W, None, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_router_matches_loop(dtype):
    g = _gen(4)
    x = torch.randn(30, 16, generator=g).to(dtype)
    W, b = torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, generator=g).to(dtype)
    logits, w, ids = routers.gpt_oss_topk(x, W, b, 4)
    assert w.dtype == dtype                              # softmax over the k runs in dt
    rid, rw = ref_gpt_oss(x, W, b, 4)
    assert torch.equal(ids, rid)
    torch.testing.assert_close(w, rw)  # per-token GEMV vs GEMM: ulp-level


def test_mixtral_router_and_jitter():
    g = _gen(5)
    x = torch.randn(30, 16, generator=g).to(torch.bfloat16)
    W = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    logits, w, ids = routers.mixtral_topk(x, W, 2)
    assert w.dtype == torch.float32                      # weights stay fp32 (unlike Qwen)
    rid, rw = ref_qwen(x.float(), W.float(), 2, True)
    p = torch.softmax((x @ W.t()).float(), dim=1)
    top = p.gather(1, ids)
    torch.testing.assert_close(w, top / top.sum(1, keepdim=True), rtol=0, atol=0)
    assert torch.equal(ids.sort(1).values, rid.sort(1).values)
    # Jitter: not in place, reproducible from an explicit generator, and identical to the
    # global-RNG draw transformers makes with the same seed.
    x0 = x.clone()
    j1 = routers.mixtral_jitter(x, 0.1, generator=_gen(9))
    j2 = routers.mixtral_jitter(x, 0.1, generator=_gen(9))
    assert torch.equal(x, x0) and torch.equal(j1, j2) and not torch.equal(j1, x)
    torch.manual_seed(9)
    assert torch.equal(j1, x * torch.empty_like(x).uniform_(0.9, 1.1))
    assert routers.mixtral_jitter(x, 0.0) is x


# --------------------------------------------------------------------------- experts

def test_swiglu_experts_layout_and_split_form():
    g = _gen(6)
    E, C, H, I = 3, 5, 16, 8
    x = torch.randn(E, C, H, generator=g)
    gu, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    y = swiglu_experts({"gate_up_proj": gu, "down_proj": down}, x)
    for e in range(E):
        for c in range(C):
            gate, up = gu[e, :I] @ x[e, c], gu[e, I:] @ x[e, c]     # gate rows first
            torch.testing.assert_close(y[e, c], down[e] @ (F.silu(gate) * up), rtol=1e-5, atol=1e-5)
    y2 = swiglu_experts({"gate_proj": gu[:, :I], "up_proj": gu[:, I:], "down_proj": down}, x)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)


def test_gpt_oss_experts_formula():
    g = _gen(7)
    E, C, H, I, alpha, limit = 2, 6, 8, 4, 1.702, 7.0
    x = torch.randn(E, C, H, generator=g) * 4                 # big enough to hit both clamps
    A, a = torch.randn(E, H, 2 * I, generator=g), torch.randn(E, 2 * I, generator=g)
    D, d = torch.randn(E, I, H, generator=g), torch.randn(E, H, generator=g)
    p = {"gate_up_proj": A, "gate_up_proj_bias": a, "down_proj": D, "down_proj_bias": d}
    y = gpt_oss_experts(p, x, alpha=alpha, limit=limit)
    hit_clamp = False
    for e in range(E):
        for c in range(C):
            z = x[e, c] @ A[e] + a[e]
            gate, up = z[0::2], z[1::2]                        # interleaved
            hit_clamp |= bool((gate > limit).any() or (up.abs() > limit).any())
            gate = torch.minimum(gate, torch.tensor(limit))
            up = up.clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(alpha * gate)
            torch.testing.assert_close(y[e, c], h @ D[e] + d[e], rtol=1e-5, atol=1e-4)
    assert hit_clamp


def test_quantized_experts_equal_dequantized():
    from fmoe.quant import quantize_fp8_block, quantize_mxfp4
    g = _gen(8)
    E, C, H, I = 2, 3, 64, 32
    x = torch.randn(E, C, H, generator=g).to(torch.bfloat16)
    gu, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    for q in (quantize_fp8_block, quantize_mxfp4):
        qgu, qd = q(gu), q(down)
        yq = swiglu_experts({"gate_up_proj": qgu, "down_proj": qd}, x)
        yf = swiglu_experts({"gate_up_proj": qgu.dequantize(torch.bfloat16),
                             "down_proj": qd.dequantize(torch.bfloat16)}, x)
        assert yq.dtype == torch.bfloat16
        # fmoe.quant accumulates against the exact (fp32) decode; the reference rounds the
        # decoded weights to bf16 first: equal to bf16 rounding of the largest outputs.
        assert (yq.float() - yf.float()).abs().max() <= 2e-2 * yf.float().abs().max()


# --------------------------------------------------------------------------- blocks and combine orders

def _qwen_params(E, H, I, dtype, seed=10):
    g = _gen(seed)
    return {"router": {"weight": torch.randn(E, H, generator=g).to(dtype)},
            "experts": {"gate_up_proj": (torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)).to(dtype),
                        "down_proj": (torch.randn(E, H, I, generator=g) / math.sqrt(I)).to(dtype)}}


def _loop_block(p, x, ids, w, act=F.silu):
    out = torch.zeros_like(x, dtype=torch.float64)
    gu, down = p["experts"]["gate_up_proj"].double(), p["experts"]["down_proj"].double()
    I = down.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            z = gu[e] @ x[t].double()
            out[t] += w[t, j].double() * (down[e] @ (act(z[:I]) * z[I:]))
    return out


@pytest.mark.parametrize("layout", ["auto", "padded"])
@pytest.mark.parametrize("combine", ["eager", "grouped"])
def test_qwen3_block_vs_loop_and_dropless(combine, layout):
    E, H, I = 8, 16, 12
    cfg = qwen3_moe.Qwen3MoeBlockConfig(hidden_size=H, num_experts=E, top_k=3, moe_intermediate_size=I,
                                        norm_topk_prob=True, layout=layout)
    p = _qwen_params(E, H, I, torch.float32)
    x = torch.randn(2, 20, H, generator=_gen(11))
    y, aux = qwen3_moe.moe_block(p, x, cfg, combine=combine)
    assert y.shape == x.shape and aux.router_logits.shape == (40, E)
    r = aux.routing
    assert int(r.num_dropped()) == 0 and r.capacity == int(r.counts.max())   # dropless
    ids, w = aux.topk()
    ref = _loop_block(p, x.reshape(-1, H), ids, w)
    torch.testing.assert_close(y.reshape(-1, H).double(), ref, rtol=1e-5, atol=1e-5)


def test_eager_combine_is_ascending_expert_dt_accumulation():
    g = _gen(12)
    E, T, k, H = 5, 7, 3, 4
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    r = to_routing(ids, w, E)
    y = torch.randn(E, r.capacity, H, generator=g).to(torch.bfloat16)
    out = eager_combine(y, r, padded_layout(r), torch.bfloat16)
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.bfloat16)
        for e in sorted(ids[t].tolist()):
            j = ids[t].tolist().index(e)
            acc = acc + (y[e, r.slots[j, t]] * w[t, j]).to(torch.bfloat16)   # bf16 x fp32 -> fp32 -> bf16
        assert torch.equal(out[t], acc)
    grouped = grouped_combine(y, r, padded_layout(r), torch.bfloat16)
    torch.testing.assert_close(grouped.float(), out.float(), rtol=0, atol=0.05)


def test_other_blocks_run_and_match_loops():
    g = _gen(13)
    H, E, I = 16, 8, 12
    x = torch.randn(24, H, generator=g)
    # DeepSeek: routed + shared.
    cfg = deepseek_v3.DeepseekV3BlockConfig(hidden_size=H, num_experts=E, top_k=2, moe_intermediate_size=I,
                                            n_group=2, topk_group=1, routed_scaling_factor=2.0)
    p = _qwen_params(E, H, I, torch.float32, seed=14)
    p["router"]["e_score_correction_bias"] = torch.randn(E, generator=g) * 0.1
    p["shared"] = {"gate_proj": torch.randn(I, H, generator=g), "up_proj": torch.randn(I, H, generator=g),
                   "down_proj": torch.randn(H, I, generator=g) / 4}
    y, aux = deepseek_v3.moe_block(p, x, cfg)
    ids, w = aux.topk()
    sh = p["shared"]
    shared = F.linear(F.silu(F.linear(x, sh["gate_proj"])) * F.linear(x, sh["up_proj"]), sh["down_proj"])
    torch.testing.assert_close(y.double(), _loop_block(p, x, ids, w) + shared.double(), rtol=1e-5, atol=1e-4)
    # Qwen2: sigmoid-gated shared expert.
    cfg2 = qwen2_moe.Qwen2MoeBlockConfig(hidden_size=H, num_experts=E, top_k=2, moe_intermediate_size=I,
                                         shared_expert_intermediate_size=I)
    p2 = _qwen_params(E, H, I, torch.float32, seed=15)
    p2["shared"] = sh
    p2["shared_gate"] = {"weight": torch.randn(1, H, generator=g)}
    y2, aux2 = qwen2_moe.moe_block(p2, x, cfg2)
    gate = torch.sigmoid(x @ p2["shared_gate"]["weight"].t())
    ids2, w2 = aux2.topk()
    torch.testing.assert_close(aux2.shared_gate, gate)
    torch.testing.assert_close(y2.double(), _loop_block(p2, x, ids2, w2) + (gate * shared).double(),
                               rtol=1e-5, atol=1e-4)
    # Mixtral jitter: the experts see the jittered input too; x is untouched.
    cfg3 = mixtral.MixtralBlockConfig(hidden_size=H, num_experts=E, top_k=2, intermediate_size=I,
                                      router_jitter_noise=0.2)
    x0 = x.clone()
    y3, aux3 = mixtral.moe_block(p2, x, cfg3, training=True, generator=_gen(3))
    xj = routers.mixtral_jitter(x, 0.2, generator=_gen(3))
    ids3, w3 = aux3.topk()
    assert torch.equal(x, x0)
    torch.testing.assert_close(y3.double(), _loop_block(p2, xj, ids3, w3), rtol=1e-5, atol=1e-4)
    y4, _ = mixtral.moe_block(p2, x, cfg3, training=False)
    assert not torch.allclose(y3, y4)


def test_gpt_oss_block_scales_down_bias_by_weight():
    g = _gen(16)
    H, E, I = 8, 4, 4
    cfg = gpt_oss.GptOssBlockConfig(hidden_size=H, num_experts=E, top_k=2, intermediate_size=I)
    p = {"router": {"weight": torch.randn(E, H, generator=g), "bias": torch.randn(E, generator=g)},
         "experts": {"gate_up_proj": torch.zeros(E, H, 2 * I), "gate_up_proj_bias": torch.zeros(E, 2 * I),
                     "down_proj": torch.zeros(E, I, H), "down_proj_bias": torch.randn(E, H, generator=g)}}
    x = torch.randn(10, H, generator=g)
    y, aux = gpt_oss.moe_block(p, x, cfg)
    ids, w = aux.topk()
    want = (w.unsqueeze(-1) * p["experts"]["down_proj_bias"][ids]).sum(1)   # experts output only d_e
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)


class _FakeComm:
    rank, size = 0, 2

    def all_reduce(self, t, op="sum"):
        return t

    def all_to_all(self, *a, **k):
        raise AssertionError("not reached")

    all_gather = split = all_to_all_v = all_to_all


def test_comm_of_two_ranks_is_never_run_locally():
    # A block given a 2-rank communicator goes through the expert-parallel pipeline (its
    # first step is the cross-rank agreement collective), never a silent one-process run.
    cfg = qwen3_moe.Qwen3MoeBlockConfig(hidden_size=8, num_experts=4, top_k=2, moe_intermediate_size=4)
    with pytest.raises(AssertionError, match="not reached"):
        qwen3_moe.moe_block(_qwen_params(4, 8, 4, torch.float32), torch.randn(3, 8), cfg, comm=_FakeComm())


def test_bad_inputs():
    cfg = qwen3_moe.Qwen3MoeBlockConfig(hidden_size=8, num_experts=4, top_k=2, moe_intermediate_size=4)
    p = _qwen_params(4, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="H=8"):
        qwen3_moe.moe_block(p, torch.randn(3, 9), cfg)
    with pytest.raises(ValueError, match="combine"):
        qwen3_moe.moe_block(p, torch.randn(3, 8), cfg, combine="fast")
    with pytest.raises(ValueError, match="top_k"):
        qwen3_moe.Qwen3MoeBlockConfig(hidden_size=8, num_experts=4, top_k=5, moe_intermediate_size=4)
    with pytest.raises(NotImplementedError, match="scoring_func"):
        deepseek_v3.DeepseekV3BlockConfig.from_hf_config(
            {"hidden_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
             "scoring_func": "softmax"})


def test_block_is_differentiable():
    cfg = qwen3_moe.Qwen3MoeBlockConfig(hidden_size=8, num_experts=4, top_k=2, moe_intermediate_size=4)
    p = _qwen_params(4, 8, 4, torch.float32)
    for leaf in (p["router"]["weight"], p["experts"]["gate_up_proj"]):
        leaf.requires_grad_(True)
    for combine in ("eager", "grouped"):
        y, _ = qwen3_moe.moe_block(p, torch.randn(6, 8, generator=_gen(1)), cfg, combine=combine)
        gr, ge = torch.autograd.grad(y.square().sum(), [p["router"]["weight"], p["experts"]["gate_up_proj"]])
        assert gr.abs().sum() > 0 and ge.abs().sum() > 0


# --------------------------------------------------------------------------- balance

def test_load_balancing_loss_formula_and_mask():
    g = _gen(20)
    layers = [torch.randn(12, 6, generator=g) for _ in range(2)]
    k = 2
    loss = losses.load_balancing_loss(layers, k)
    logits = torch.cat(layers)
    p = torch.softmax(logits, 1)
    ids = p.topk(k, 1).indices
    f = torch.tensor([(ids == e).sum().item() / logits.shape[0] for e in range(6)])
    torch.testing.assert_close(loss, 6 * (f * p.mean(0)).sum())
    mask = torch.ones(3, 4)
    mask[0, :2] = 0
    lm = losses.load_balancing_loss(layers, k, attention_mask=mask)
    keep = mask.reshape(-1).bool().repeat(2)
    torch.testing.assert_close(lm, losses.load_balancing_loss(logits[keep], k))


def test_aux_free_bias_update_and_sequence_loss():
    bias = torch.zeros(4)
    new = losses.aux_free_bias_update(bias, torch.tensor([10, 2, 6, 6]), 0.01)
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert torch.equal(bias, torch.zeros(4))
    assert torch.equal(losses.expert_load(torch.tensor([[0, 1], [0, -1]]), 3), torch.tensor([2, 1, 0]))
    # Uniform affinities with a perfectly balanced selection give exactly alpha.
    S, E, k = 8, 4, 2
    ids = torch.tensor([[(2 * t) % E, (2 * t + 1) % E] for t in range(S)])
    torch.testing.assert_close(losses.sequence_aux_loss(torch.ones(S, E), ids, alpha=0.5), torch.tensor(0.5))
    # Collapsed routing is penalised.
    collapsed = losses.sequence_aux_loss(torch.tensor([[1.0, 1.0, 0.01, 0.01]]).repeat(S, 1),
                                          torch.tensor([[0, 1]]).repeat(S, 1))
    assert collapsed > 1.5
