"""Tutel example code paths at toy sizes, written against a Tutel-like package ``T`` (``T.moe``, ``T.net``,
``T.system``).

The same functions run on ``fmoe.compat.tutel`` (tests) and on Tutel itself
(to record the golden values). Each returns ``{"init": sha256 of the initial
state dict, "losses": [...], ...}``. They follow the examples' code paths
(model, loss, optimizer, seeds, attributes read) but are not copies of them.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F


def state_hash(module: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, bytes) of every state-dict entry, in key order."""
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        v = v.detach().contiguous().cpu()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()[:16]


def _rounded(xs, nd=7):
    return [float(f"{float(v):.{nd}g}") for v in xs]


# --------------------------------------------------------------------------- helloworld family

def helloworld(T, *, steps=4, k=2, n=2, cf=1.0, l_aux_wt=0.0, d=1, expert_type="ffn", parallel_type="adaptive:1",
               dtype=torch.float32, M=16, H=32, B=2, S=8, lr=1e-2, fp32_gate=True, ddp_optimizer=False):
    """helloworld.py / helloworld_ddp_tutel.py: sum-over-features log-softmax NLL, SGD, seeds (1, rank+1, 1)."""
    env = T.system.init_data_model_parallel(group_count=1, backend="gloo")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        experts = {"type": expert_type, "num_experts_per_device": n, "hidden_size_per_expert": H}
        if expert_type == "ffn":
            experts["activation_fn"] = lambda x: F.relu(x)
        layer = T.moe.moe_layer(
            gate_type={"type": "top", "k": k, "fp32_gate": fp32_gate, "capacity_factor": cf},
            experts=experts, model_dim=M,
            scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
            seeds=(1, env.global_rank + 1, 1), a2a_ffn_overlap_degree=d, parallel_type=parallel_type)
        init = state_hash(layer)
        local = sum(p.numel() for _, p in layer.get_parameter_iterator(param_type="local_experts"))
        shared = sum(p.numel() for _, p in layer.get_parameter_iterator(param_type="gate"))
        if ddp_optimizer:
            opt = T.net.TutelDistributedOptimizer(layer.parameters(), group=None,
                                                  average_shared=True).warp_local(torch.optim.SGD, lr=lr)
        else:
            opt = torch.optim.SGD(layer.parameters(), lr=lr)
        torch.manual_seed(0)
        x = torch.tensor(torch.randn([B, S, M], dtype=torch.float32).numpy(), dtype=dtype)
        y = torch.LongTensor(B).random_(1)
        reduce = [p for p in layer.parameters() if not hasattr(p, "skip_allreduce")]
        losses, laux = [], []
        for _ in range(steps):
            opt.zero_grad()
            out = F.log_softmax(torch.sum(layer(x), dim=2), dim=1)
            loss = F.nll_loss(out, y)
            if l_aux_wt:
                loss = loss + l_aux_wt * layer.l_aux
            loss.backward()
            if env.global_size > 1 and not ddp_optimizer:
                for p in reduce:
                    p.grad /= env.global_size
                    p.grad = T.net.simple_all_reduce(p.grad)
            opt.step()
            losses.append(float(loss.detach()))
            laux.append(float(layer.l_aux.detach()))
        E = T.moe.moe_layer.global_expert_count(n, group=T.system.get_local_session().model_group)
        return {"init": init, "losses": _rounded(losses), "l_aux": _rounded(laux), "local_count": local,
                "shared_count": shared, "num_global_experts": E,
                "dispatch_count": [int(c) for c in layer.dispatch_count]}
    finally:
        torch.set_default_dtype(old)


def switch(T, *, steps=6, n=2, cf=1.0, M=16, H=32, B=2, S=8, lr=1e-2):
    """helloworld_switch.py: per-call capacity factor, adaptive r and overlap degree; reads them back."""
    env = T.system.init_data_model_parallel(backend="gloo")
    layer = T.moe.moe_layer(
        gate_type={"type": "top", "k": 2, "fp32_gate": True},
        experts={"type": "ffn", "num_experts_per_device": n, "hidden_size_per_expert": H,
                 "activation_fn": lambda x: F.relu(x)},
        model_dim=M, scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
        seeds=(1, env.global_rank + 1, 1))
    init = state_hash(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    torch.manual_seed(0)
    x = torch.randn([B, S, M])
    y = torch.LongTensor(B).random_(1)
    losses, seen = [], []
    for i in range(steps):
        r_index = i - 1
        r = layer.valid_rs[(r_index // 8) % len(layer.valid_rs)]
        o = r_index % 8 + 1
        opt.zero_grad()
        out = F.log_softmax(torch.sum(layer(x, capacity_factor=cf, adaptive_r=r, a2a_ffn_overlap_degree=o), dim=2),
                            dim=1)
        loss = F.nll_loss(out, y)
        loss.backward()
        if env.global_size > 1:
            for p in layer.parameters():
                if not hasattr(p, "skip_allreduce"):
                    p.grad = T.net.simple_all_reduce(p.grad / env.global_size)
        opt.step()
        losses.append(float(loss.detach()))
        seen.append((layer.adaptive_degree, layer.a2a_ffn_overlap_degree))
    return {"init": init, "losses": _rounded(losses), "r_o": seen, "valid_rs": list(layer.valid_rs)}


def custom_gate_expert(T, *, steps=4, n=2, M=16, B=2, S=8, lr=1e-2, l_aux_wt=0.01):
    """helloworld_custom_gate_expert.py: {'type': 'custom', 'module': ...} gate and expert (forward(x, ctx))."""
    class Gate(torch.nn.Module):
        def __init__(self, model_dim, num_global_experts, top_k):
            super().__init__()
            self.top_k = top_k
            self.proj = torch.nn.Linear(model_dim, num_global_experts, bias=False)

        def forward(self, x):
            return self.proj(x)

    class Expert(torch.nn.Module):
        def __init__(self, model_dim, num_experts_per_device, sharded_count, act):
            super().__init__()
            assert sharded_count == 1
            self.W = torch.nn.Parameter(torch.empty(num_experts_per_device, model_dim, model_dim))
            self.act = F.relu if act == "relu" else None
            with torch.no_grad():
                self.W.normal_(0, 0.1)

        def forward(self, x, ctx):
            assert ctx.sharded_count == 1
            y = torch.matmul(x, self.W)
            return self.act(y) if self.act is not None else y

    env = T.system.init_data_model_parallel(backend="gloo")
    layer = T.moe.moe_layer(
        gate_type={"type": "custom", "module": Gate, "top_k": 2},
        experts={"type": "custom", "module": Expert, "num_experts_per_device": n, "act": "relu"},
        model_dim=M, scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
        seeds=(1, env.global_rank + 1, 1))
    init = state_hash(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    torch.manual_seed(0)
    x = torch.randn([B, S, M])
    y = torch.LongTensor(B).random_(1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.nll_loss(F.log_softmax(torch.sum(layer(x), dim=2), dim=1), y) + l_aux_wt * layer.l_aux
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"init": init, "losses": _rounded(losses), "keys": sorted(layer.state_dict())}


def custom_expert_sharded(T, *, steps=4, n=2, M=16, B=2, S=8, lr=1e-2, cf=1.0):
    """helloworld_custom_expert_sharded.py: a flat-sharded custom expert gathering itself with zero_gather."""
    class ShardedExpert(torch.nn.Module):
        def __init__(self, model_dim, local_experts, sharded_count, my_config):  # Tutel's old argument name
            super().__init__()
            self.sharded_count = sharded_count
            self.full_shape = torch.Size((local_experts, model_dim, model_dim))
            self.W = torch.nn.Parameter(torch.empty(-(-self.full_shape.numel() // sharded_count)))
            with torch.no_grad():
                self.W.normal_(0, 0.1)

        def forward(self, x, ctx):
            group = T.net.create_groups_from_world(group_count=-self.sharded_count, parent_group=ctx.group).model_group
            w = T.net.zero_gather(self.W, group=group).view(-1).narrow(0, 0, self.full_shape.numel())
            return F.relu(torch.matmul(x, w.view(self.full_shape)))

    env = T.system.init_data_model_parallel(backend="gloo")
    layer = T.moe.moe_layer(
        gate_type={"type": "top", "k": 2, "fp32_gate": True, "capacity_factor": cf},
        experts={"type": "custom", "module": ShardedExpert, "num_experts_per_device": n, "my_config": None},
        model_dim=M, scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
        seeds=(1, env.global_rank + 1, 1))
    init = state_hash(layer)
    local = sum(p.numel() for _, p in layer.get_parameter_iterator(param_type="local_experts"))
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    torch.manual_seed(0)
    x = torch.randn([B, S, M])
    y = torch.LongTensor(B).random_(1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.nll_loss(F.log_softmax(torch.sum(layer(x), dim=2), dim=1), y)
        loss.backward()
        if env.global_size > 1:
            for p in layer.parameters():
                if not hasattr(p, "skip_allreduce"):
                    p.grad = T.net.simple_all_reduce(p.grad / env.global_size)
        opt.step()
        losses.append(float(loss.detach()))
    return {"init": init, "losses": _rounded(losses), "local_count": local}


def from_scratch(T, *, steps=4, n=4, M=16, H=16, seq=4, outer=3, lr=1e-2, k=2, reverse_maps=False):
    """helloworld_from_scratch.py: top_k_routing, fast_encode/decode, net.all_to_all and (``reverse_maps``;
    Tutel has them on CUDA only) the reverse maps."""
    env = T.system.init_data_model_parallel(backend="gloo")
    E = n * env.global_size
    torch.manual_seed(1)
    wg = torch.nn.Parameter(torch.randn([M, E]) * 1e-1)
    torch.manual_seed(env.global_rank + 1)
    w1 = torch.nn.Parameter(torch.randn([n, M, H]) * 1e-1)
    w2 = torch.nn.Parameter(torch.randn([n, H, M]) * 1e-1)
    b1 = torch.nn.Parameter(torch.zeros([n, 1, H]))
    for p in (w1, w2, b1):
        p.skip_allreduce = True
    torch.manual_seed(env.global_rank + 1)
    data = torch.randn([outer * seq, M])
    label = torch.LongTensor(outer * seq).random_(1)
    opt = torch.optim.SGD([wg, w1, w2, b1], lr=lr)
    losses, extras = [], {}
    for i in range(steps):
        opt.zero_grad()
        scores = F.softmax(torch.matmul(data, wg), dim=-1)
        crit, l_aux = T.moe.top_k_routing(scores, top_k=k, capacity_factor=0)
        if i == 0:
            topk_ids, total = T.moe.get_topk_selection(crit)
            extras = {"topk_ids": topk_ids.tolist(), "total": [int(t) for t in total], "capacity": int(crit[4]),
                      "locations": [t.tolist() for t in crit[2]]}
        if i == 0 and reverse_maps:
            sid = T.moe.get_reversed_sample_ids(crit, return_id_type="sample_id")
            tid = T.moe.get_reversed_sample_ids(crit, return_id_type="top_id")
            extras.update(sample_ids=sid.tolist(), top_ids=tid.tolist(),
                          inner=torch.where(sid >= 0, sid % seq, sid).tolist())
        y = T.moe.fast_encode(data, crit)
        y = T.net.all_to_all(y, 1, 0)
        y = torch.matmul(F.relu(torch.add(torch.matmul(y, w1), b1)), w2)
        y = T.net.all_to_all(y, 0, 1)
        out = T.moe.fast_decode(y, crit)
        loss = F.nll_loss(F.log_softmax(out, dim=1), label) + 0.01 * l_aux
        loss.backward()
        for p in (wg,):
            p.grad = T.net.simple_all_reduce(p.grad)
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": _rounded(losses), **extras}


def mnist_like(T, *, steps=3, batch=4, hidden=8):
    """moe_mnist.py / moe_cifar10.py: conv front, k=1 dropless gate with noise, output_dim=10, dropout in the
    activation, Adadelta; evaluation at top_k 1, 2 and 8. Images are seeded random tensors."""
    penv = T.system.init_data_model_parallel(backend="gloo")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe_ffn = T.moe.moe_layer(
                gate_type={"type": "top", "k": 1, "capacity_factor": 0, "gate_noise": 1.0},
                experts={"type": "ffn", "num_experts_per_device": 1, "hidden_size_per_expert": hidden,
                         "output_dim": 10, "activation_fn": lambda x: self.dropout2(F.relu(x))},
                model_dim=8 * 5 * 5, seeds=(1, penv.global_rank + 1),
                scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True))
            torch.manual_seed(1)
            self.conv1 = torch.nn.Conv2d(1, 4, 3, 1)
            self.conv2 = torch.nn.Conv2d(4, 8, 3, 1)
            self.dropout1 = torch.nn.Dropout(0.25)
            self.dropout2 = torch.nn.Dropout(0.5)

        def forward(self, x, top_k=None):
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            x = torch.flatten(self.dropout1(x), 1)
            return F.log_softmax(self.moe_ffn(x, top_k=top_k), dim=1)

    torch.manual_seed(1)
    model = Net()
    init = state_hash(model)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(123)
    images = torch.randn(steps + 1, batch, 1, 14, 14, generator=g)
    labels = torch.randint(0, 10, (steps + 1, batch), generator=g)
    torch.manual_seed(penv.global_rank + 1)
    model.train()
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = F.nll_loss(model(images[i]), labels[i])
        loss.backward()
        for p in model.parameters():
            if not hasattr(p, "skip_allreduce") and p.grad is not None:
                p.grad = T.net.simple_all_reduce(p.grad)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        evals = [float(F.nll_loss(model(images[-1], top_k=k), labels[-1])) for k in (1, 2, 8)]
    return {"init": init, "losses": _rounded(losses), "eval": _rounded(evals),
            "expert_params": len([p for p in model.parameters() if hasattr(p, "skip_allreduce")])}


def options(T, *, steps=3, M=16, H=8, B=2, S=8, lr=1e-2):
    """README constructor options: cosine gate, list of gates, pre-score, batch-prioritized, no gate
    normalisation, load/importance loss with noise, no biases, output_dim, activation_fn_with_self,
    result_func seeing l_aux, reserve_dims, gate_index, top_k override."""
    out = {}
    T.system.init_data_model_parallel(backend="gloo")
    layer = T.moe.moe_layer(
        gate_type=[{"type": "cosine_top", "k": 2, "proj_dim": 8, "fp32_gate": True, "gate_noise": 0.2},
                   {"type": "top", "k": 1, "capacity_factor": 0.5, "gate_noise": 0.3}],
        experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": H, "output_dim": 6,
                 "has_fc1_bias": False, "activation_fn_with_self": lambda x, m: F.gelu(x) * 0.5},
        model_dim=M, seeds=(3, 4, 5), is_postscore=False, batch_prioritized_routing=True, normalize_gate=False,
        is_gshard_loss=False, result_func=lambda y: (y, y.l_aux))
    out["init"] = state_hash(layer)
    out["keys"] = sorted(layer.state_dict())
    torch.manual_seed(7)
    x = torch.randn(B, S, 4, M // 4)
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        y, l_aux = layer(x.reshape(B, S, M), gate_index=i % 2, top_k=None if i < 2 else 2)
        loss = y.square().mean() + 0.1 * l_aux
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    out["losses"] = _rounded(losses)
    out["shape"] = list(y.shape)
    return out


def llama(T, *, steps=3, M=16, H=8, B=2, S=8, lr=20.0, n=2, parallel_type="adaptive:1"):
    """experts type 'llama_ffn' (flat W_fc1/W_fc2/W_fc3) under helloworld's loop."""
    return helloworld(T, steps=steps, expert_type="llama_ffn", M=M, H=H, B=B, S=S, lr=lr, n=n,
                      parallel_type=parallel_type)


SCENARIOS = {
    "helloworld": lambda T: helloworld(T),
    "helloworld_k1_e4": lambda T: helloworld(T, k=1, n=4),
    "helloworld_l_aux": lambda T: helloworld(T, l_aux_wt=0.1),
    "helloworld_overlap3": lambda T: helloworld(T, d=3, n=3),
    "helloworld_dropless": lambda T: helloworld(T, cf=0.0, n=4),
    "helloworld_capped": lambda T: helloworld(T, cf=-0.5, n=4),
    "helloworld_fp64": lambda T: helloworld(T, dtype=torch.float64, fp32_gate=False),
    "ddp_tutel_auto": lambda T: helloworld(T, parallel_type="auto", ddp_optimizer=True),
    "llama": llama,
    "switch": lambda T: switch(T),
    "custom_gate_expert": lambda T: custom_gate_expert(T),
    "custom_expert_sharded": lambda T: custom_expert_sharded(T),
    "from_scratch": lambda T: from_scratch(T),
    "mnist_like": lambda T: mnist_like(T),
    "options": lambda T: options(T),
}
