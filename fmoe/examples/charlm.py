"""Train a small MoE character-level language model on the Python standard library's source.

    python -m fmoe.examples.charlm                 # 600 steps, ~1.5 minutes on 2 CPU cores
    python -m fmoe.examples.charlm --steps 2000 --model_dim 256

Every machine with Python has the corpus (the ``.py`` files of ``sysconfig``'s
stdlib path), so this is real text without a download. The model is a small
pre-norm causal Transformer whose feed-forward blocks are fmoe ``MoELayer`` s.
Prints a progress bar, then train/validation loss (nats/char) and throughput,
and writes a loss-curve PNG (needs matplotlib) and a JSON summary.

The pieces (:func:`load_corpus`, :func:`batches`, :class:`CharLM`) are reused by
the ablation example.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sysconfig
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fmoe.nn import MoELayer

VOCAB = 256  # bytes


def load_corpus(max_bytes: int = 4_000_000, root: Optional[str] = None) -> Tensor:
    """uint8 [N] bytes of stdlib ``.py`` files, in sorted path order (deterministic)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py files found under {root}")
    blob = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def split(data: Tensor, val_fraction: float = 0.05) -> tuple[Tensor, Tensor]:
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]


def batches(data: Tensor, batch_size: int, context: int, generator: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless random windows: (inputs int64 [B, L], targets int64 [B, L])."""
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=generator)
        idx = starts[:, None] + torch.arange(context + 1)
        window = data[idx].long()
        yield window[:, :-1], window[:, 1:]


@dataclasses.dataclass(frozen=True)
class CharLMConfig:
    model_dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    context: int = 128
    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 256
    capacity_factor: float = 1.25
    aux_weight: float = 0.01


class Block(nn.Module):
    def __init__(self, cfg: CharLMConfig, seed: int, comm=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.model_dim)
        self.qkv = nn.Linear(cfg.model_dim, 3 * cfg.model_dim)
        self.proj = nn.Linear(cfg.model_dim, cfg.model_dim)
        self.norm2 = nn.LayerNorm(cfg.model_dim)
        world = 1 if comm is None else comm.size
        self.moe = MoELayer(
            {"type": "top", "k": cfg.top_k, "capacity_factor": cfg.capacity_factor},
            model_dim=cfg.model_dim,
            experts={"type": "ffn", "num_experts_per_device": cfg.num_experts // world,
                     "hidden_size_per_expert": cfg.hidden_size, "activation_fn": F.gelu},
            comm=comm, seeds=(seed, seed + 1 + (0 if comm is None else comm.rank), seed),
        )
        self.num_heads = cfg.num_heads

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, L, M = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.num_heads, M // self.num_heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, L, M))
        y, aux = self.moe(self.norm2(x), return_aux=True)
        return x + y, aux.l_aux


class CharLM(nn.Module):
    """Byte-level causal LM with MoE feed-forward blocks."""

    def __init__(self, cfg: CharLMConfig, seed: int = 0, comm=None):
        super().__init__()
        torch.manual_seed(seed)  # embedding/attention init; MoE layers use their own seeds
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.model_dim)
        self.pos = nn.Parameter(torch.randn(cfg.context, cfg.model_dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, seed + 10 * i, comm) for i in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.model_dim)
        self.head = nn.Linear(cfg.model_dim, VOCAB)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens int64 [B, L] -> (logits [B, L, 256], summed aux loss [])."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        l_aux = x.new_zeros(())
        for block in self.blocks:
            x, la = block(x)
            l_aux = l_aux + la
        return self.head(self.norm(x)), l_aux

    def loss(self, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """(cross-entropy in nats/char, aux loss)."""
        logits, l_aux = self(tokens)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), l_aux


def sync_and_clip(model: nn.Module, comm, max_norm: float) -> None:
    """Data parallel for the replicated parameters, expert parallel for the experts.

    Each rank's loss is a mean over its own batch; the objective is the mean over
    ranks. Replicated (non-expert) gradients are averaged over ranks; expert
    gradients already sum every rank's contribution (the all-to-all backward)
    and are divided by W. The clipping norm is the global one, so every rank
    scales by the same factor and replicas stay identical.
    """
    if comm is None or comm.size == 1:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    W = comm.size
    shared_sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".experts." in name:
            p.grad.div_(W)
            expert_sq += p.grad.double().pow(2).sum()
        else:
            p.grad.copy_(comm.all_reduce(p.grad, "sum") / W)
            shared_sq += p.grad.double().pow(2).sum()
    total = (shared_sq + comm.all_reduce(expert_sq.reshape(1), "sum")[0]).sqrt()
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    if scale < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)


@torch.no_grad()
def evaluate(model: CharLM, data: Tensor, batch_size: int, steps: int, seed: int = 1234) -> float:
    model.eval()
    it = batches(data, batch_size, model.cfg.context, torch.Generator().manual_seed(seed))
    total = sum(float(model.loss(*next(it))[0]) for _ in range(steps))
    model.train()
    return total / steps


def plot_losses(path: Path, steps: list[int], train: list[float], val: list[tuple[int, float]]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the loss-curve PNG")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, train, label="train", alpha=0.8)
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("fmoe char-LM on Python stdlib source")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small MoE char-LM on the Python stdlib source.")
    d = CharLMConfig()
    for f in dataclasses.fields(CharLMConfig):
        p.add_argument(f"--{f.name}", type=type(getattr(d, f.name)), default=getattr(d, f.name))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus_bytes", type=int, default=4_000_000)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--out", default="runs/charlm")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--no_progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None, comm=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rank = 0 if comm is None else comm.rank
    cfg = CharLMConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(CharLMConfig)})
    data = load_corpus(args.corpus_bytes)
    train_data, val_data = split(data)
    model = CharLM(cfg, seed=args.seed, comm=comm)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    it = batches(train_data, args.batch_size, cfg.context, torch.Generator().manual_seed(args.seed + rank))
    if rank == 0:
        print(f"corpus: {len(data):,} bytes of stdlib source; model: {n_params:,} parameters, "
              f"{cfg.num_layers} MoE layers x {cfg.num_experts} experts (top-{cfg.top_k})")
    try:
        from tqdm import tqdm
        bar = tqdm(range(args.steps), disable=args.no_progress or rank != 0, unit="step")
    except ImportError:
        bar = range(args.steps)
    steps, train_curve, val_curve = [], [], []
    tokens_seen, t0 = 0, time.perf_counter()
    for step in bar:
        inputs, targets = next(it)
        loss, l_aux = model.loss(inputs, targets)
        opt.zero_grad(set_to_none=True)
        (loss + cfg.aux_weight * l_aux).backward()
        sync_and_clip(model, comm, 1.0)
        opt.step()
        sched.step()
        tokens_seen += inputs.numel()
        steps.append(step)
        train_curve.append(loss.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss.item():.3f}", aux=f"{l_aux.item():.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_curve.append((step, evaluate(model, val_data, args.batch_size, 8)))
    elapsed = time.perf_counter() - t0
    summary = {
        "steps": args.steps,
        "final_train_loss": sum(train_curve[-20:]) / len(train_curve[-20:]),
        "final_val_loss": val_curve[-1][1],
        "initial_loss": train_curve[0],
        "uniform_loss": math.log(VOCAB),
        "tokens_per_second": tokens_seen / elapsed,
        "seconds": elapsed,
        "parameters": n_params,
        "ranks": 1 if comm is None else comm.size,
        "config": dataclasses.asdict(cfg),
    }
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        png = out / "loss.png"
        if plot_losses(png, steps, train_curve, val_curve):
            summary["plot"] = str(png)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"done: {args.steps} steps in {elapsed:.1f} s ({summary['tokens_per_second']:,.0f} tokens/s); "
              f"loss {summary['initial_loss']:.3f} -> train {summary['final_train_loss']:.3f}, "
              f"val {summary['final_val_loss']:.3f} nats/char (uniform: {math.log(VOCAB):.3f}); "
              f"wrote {out}/summary.json" + (f" and {png}" if "plot" in summary else ""))
    return summary


if __name__ == "__main__":
    # Expert parallel: `mpiexec -n 2 python -m fmoe.examples.charlm ...` or
    # `torchrun --nproc_per_node=2 -m fmoe.examples.charlm ...`; experts are split
    # over the ranks, everything else is data parallel.
    from fmoe.comm import abort_on_error, from_env
    _comm = from_env()
    with abort_on_error(_comm):
        main(comm=_comm)
    _comm.close()  # collective shutdown: torch.distributed aborts at exit without it
