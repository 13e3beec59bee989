"""Train a small MoE character-level language model on the Python standard library's source.

    python -m fmoe.examples.charlm                 # 600 steps, ~1.5 minutes on 2 CPU cores
    python -m fmoe.examples.charlm --steps 2000 --model_dim 256
    torchrun --nproc_per_node=4 -m fmoe.examples.charlm --mesh ep=2,dp=2 --steps 20   # FSDP2
    torchrun --nproc_per_node=4 -m fmoe.examples.charlm --mesh pp=2,ep=2 --steps 20   # pipeline

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
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fmoe
from fmoe.nn import MoELayer

VOCAB = 256  # bytes
PRECISIONS = ("fp32", "bf16", "fp8_row", "fp8_block", "mxfp8", "mxfp4", "nvfp4")
A2A_PRECISIONS = ("fp32", "bf16", "fp8", "mxfp8")


def load_files(max_bytes: int = 4_000_000, root: Optional[str] = None) -> list[bytes]:
    """Contents of stdlib ``.py`` files in sorted path order (deterministic), stopping once
    ``max_bytes`` are read (the last file is cut to the budget)."""
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
    over = total - max_bytes
    if over > 0:
        chunks[-1] = chunks[-1][:len(chunks[-1]) - over]
    return chunks


def _as_tensor(chunks: list[bytes]) -> Tensor:
    return torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8)


def load_corpus(max_bytes: int = 4_000_000, root: Optional[str] = None) -> Tensor:
    """uint8 [N] bytes of stdlib ``.py`` files, in sorted path order (deterministic)."""
    return _as_tensor(load_files(max_bytes, root))[:max_bytes]


def split(data: Tensor, val_fraction: float = 0.05) -> tuple[Tensor, Tensor]:
    """Tail split of one byte stream (the last ``val_fraction`` of the bytes). The stdlib's
    sorted tail (``xml``, ``zipfile``, ...) reads easier than the rest: prefer
    :func:`split_by_file` for an honest validation loss."""
    n = int(len(data) * (1 - val_fraction))
    return data[:n], data[n:]


def split_by_file(files: list[bytes], val_fraction: float = 0.05, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Honest train / validation split: files are shuffled with a seeded permutation and the
    first ones, until at least ``val_fraction`` of the bytes, form the validation set; the rest
    (in path order) train. Both sets then come from the same distribution of files.
    Returns (train uint8 [N_train], val uint8 [N_val]).
    """
    if len(files) < 2:
        raise ValueError(f"split_by_file needs at least 2 files, got {len(files)}")
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    total = sum(len(f) for f in files)
    val_idx, got = set(), 0
    for i in order:
        if got >= val_fraction * total or len(val_idx) == len(files) - 1:
            break
        val_idx.add(i)
        got += len(files[i])
    train = [f for i, f in enumerate(files) if i not in val_idx]
    val = [files[i] for i in sorted(val_idx)]
    return _as_tensor(train), _as_tensor(val)


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
    def __init__(self, cfg: CharLMConfig, seed: int, comm=None, precision=None, a2a_wire: str = "fp32"):
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
        self.precision = precision  # fmoe.quant.training.TrainPrecision or None (static)
        self.a2a_wire = a2a_wire    # dispatch/combine all-to-all wire format (static)
        # Stochastic rounding / Hadamard signs of the quantized expert GEMMs draw from this
        # block's own generator (never the global RNG); the gate has no noise to draw.
        self.rng = torch.Generator().manual_seed(10_000 + seed + (0 if comm is None else comm.rank))
        self.num_heads = cfg.num_heads

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, L, M = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.num_heads, M // self.num_heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(B, L, M))
        h = self.norm2(x)
        if self.precision is None and self.a2a_wire == "fp32":
            y, aux = self.moe(h, return_aux=True, generator=self.rng)
        else:
            # The layer's own spec and parameters through the functional call, with the expert
            # precision (ExpertSpec.precision) and the a2a wire (ParallelSpec.wire) of this model.
            spec = self.moe.spec()
            spec = dataclasses.replace(spec, experts=dataclasses.replace(spec.experts, precision=self.precision))
            parallel = self.moe.parallel_spec()
            if parallel is not None and self.a2a_wire != "fp32":
                parallel = dataclasses.replace(parallel, wire=self.a2a_wire)
            y, aux = fmoe.moe(self.moe.params(), h, spec, comm=self.moe.comm, generator=self.rng,
                              training=self.training, parallel=parallel)
        return x + y, aux.l_aux


class CharLM(nn.Module):
    """Byte-level causal LM with MoE feed-forward blocks."""

    def __init__(self, cfg: CharLMConfig, seed: int = 0, comm=None, precision=None, a2a_wire: str = "fp32"):
        """precision: None or a :class:`fmoe.quant.training.TrainPrecision` (or its name) for
        the expert GEMMs (quantized training with float master weights). a2a_wire: wire
        format of the dispatch/combine all-to-alls under expert parallelism
        (:data:`fmoe.comm.compress.WIRE_FORMATS`; "fp32" = uncompressed)."""
        super().__init__()
        torch.manual_seed(seed)  # embedding/attention init; MoE layers use their own seeds
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.model_dim)
        self.pos = nn.Parameter(torch.randn(cfg.context, cfg.model_dim) * 0.02)
        if isinstance(precision, str):
            from fmoe.quant.training import recipe_from_name
            precision = recipe_from_name(precision)
        self.blocks = nn.ModuleList(Block(cfg, seed + 10 * i, comm, precision, a2a_wire)
                                    for i in range(cfg.num_layers))
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


class SavedBytes:
    """Context manager counting the bytes autograd saves for backward (distinct storages), i.e.
    the activation memory a training step holds between forward and backward."""

    def __enter__(self):
        self.total, self._seen = 0, set()

        def pack(t):
            try:
                key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            except (RuntimeError, NotImplementedError):  # wrapped tensors: count their size
                key = (id(t), t.numel() * t.element_size())
            if key not in self._seen:
                self._seen.add(key)
                self.total += key[1]
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


def peak_rss_bytes() -> Optional[int]:
    """Peak resident set size of this process (Linux/macOS), or None where unknown."""
    try:
        import resource
        import sys
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(r) if sys.platform == "darwin" else int(r) * 1024
    except (ImportError, OSError):
        return None


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
    p.add_argument("--seed", type=int, default=0, help="initialisation, batches and quantizer randomness")
    p.add_argument("--split_seed", type=int, default=0, help="the train/validation file shuffle")
    p.add_argument("--corpus_bytes", type=int, default=4_000_000)
    p.add_argument("--eval_every", type=int, default=200)
    p.add_argument("--eval_batches", type=int, default=16, help="validation batches per evaluation")
    p.add_argument("--out", default="runs/charlm")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--no_progress", action="store_true")
    p.add_argument("--no_plot", action="store_true", help="skip the loss-curve PNG")
    p.add_argument("--expert_precision", default="fp32", choices=PRECISIONS,
                   help="quantized training of the expert GEMMs (weights, activations and output "
                        "gradients in this format; FP32 master weights)")
    p.add_argument("--save_activations", default=None, choices=(None, "fp8"),
                   help="store the expert GEMM inputs saved for backward in FP8 (activation compression)")
    p.add_argument("--a2a_precision", default="fp32", choices=A2A_PRECISIONS,
                   help="wire format of the dispatch/combine all-to-alls (under mpiexec / torchrun)")
    p.add_argument("--mesh", default=None,
                   help="torchrun only: a (pp, dp, ep) mesh such as 'ep=2,dp=2' or 'pp=2,ep=2' "
                        "(fmoe.comm.mesh); pp=1 trains with --recipe, pp>1 with pipeline stages")
    p.add_argument("--recipe", default="fsdp", choices=("fsdp", "ddp"),
                   help="with --mesh: FSDP2 (fully_shard, pp=1 only) or DDP for the dense parameters "
                        "(pp>1: 'ddp' wraps each stage in DDP, 'fsdp' reduces with explicit all-reduces)")
    p.add_argument("--microbatches", type=int, default=2, help="with --mesh and pp>1: microbatches per step")
    return p.parse_args(argv)


def train_on_mesh(argv=None, mesh=None) -> dict:
    """Train on a (pp, dp, ep) mesh with torch's engines (:mod:`fmoe.distributed`).

    Experts are spread over ``mesh.ep_comm``; every rank of a stage reads its own batches
    (``--batch_size`` rows each); pp=1 wraps the model with FSDP2 or DDP (``--recipe``), pp>1
    splits its blocks into pipeline stages (1F1B over ``--microbatches``; ``--recipe ddp`` wraps
    each stage in DDP, otherwise the stage's gradients are reduced by explicit all-reduces). Gradients are those of
    the mean loss over all data shards, clipped by the global norm. Prints the loss every
    ``--eval_every`` steps (no validation pass) and returns a summary (the same on every rank).
    """
    import torch.distributed as dist
    from fmoe.distributed import ddp, fsdp
    from fmoe.distributed.pipeline import CharLMPipeline
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.expert_precision != "fp32" or args.a2a_precision != "fp32" or args.save_activations:
        raise ValueError("--mesh trains in fp32: drop --expert_precision / --a2a_precision / --save_activations")
    m = mesh
    cfg = CharLMConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(CharLMConfig)})
    train_data, _ = split_by_file(load_files(args.corpus_bytes), 0.05, seed=args.split_seed)
    model = CharLM(cfg, seed=args.seed, comm=m.ep_comm)
    n_params = sum(p.numel() for p in model.parameters())
    rank = dist.get_rank()
    if m.pp > 1:
        use_ddp = args.recipe == "ddp"
        engine = CharLMPipeline(model, m, batch_size=args.batch_size, microbatches=args.microbatches, ddp=use_ddp)
        params = list(engine.stage.parameters())
        how = f"pipeline 1F1B x {args.microbatches} microbatches" + (" + DDP" if use_ddp else "")
    elif args.recipe == "fsdp":
        engine = fsdp.shard(model, m, units=list(model.blocks))
        params, how = list(model.parameters()), "FSDP2"
    else:
        engine = ddp.wrap(model, m)
        params, how = list(model.parameters()), "DDP"
    # foreach=False: FSDP2's parameters live on two meshes (dense and expert), and the fused
    # multi-tensor kernels want one.
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    it = batches(train_data, args.batch_size, cfg.context, torch.Generator().manual_seed(args.seed + m.data_rank))
    if rank == 0:
        print(f"{m.describe()}; {how}; model: {n_params:,} parameters on this rank before sharding, "
              f"{cfg.num_layers} MoE layers x {cfg.num_experts} experts (top-{cfg.top_k}, "
              f"{cfg.num_experts // m.ep} per rank)", flush=True)
    curve, step_times = [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        inputs, targets = next(it)
        ts = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if m.pp > 1:
            loss = engine.step(inputs, targets)           # None except on the last stage
            if engine.ddp:                                  # DDP reduced the dense gradients
                ddp.reduce_expert_grads(engine.stage, m)
            else:
                ddp.reduce_grads(engine.stage, m)
            ddp.clip_grad_norm_(engine.stage, m, 1.0)
        else:
            logits, l_aux = engine(inputs)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + cfg.aux_weight * l_aux
            loss.backward()
            if args.recipe == "ddp":
                ddp.reduce_expert_grads(engine, m)
                ddp.clip_grad_norm_(engine, m, 1.0)
            else:
                fsdp.clip_grad_norm_(engine, m, 1.0)
        opt.step()
        sched.step()
        step_times.append(time.perf_counter() - ts)
        # The mean loss over the data shards (the last stage's ranks hold it under pipelining).
        last = m.pp_rank == m.pp - 1
        total = (loss.detach() if last else torch.zeros(())).reshape(1).clone()
        dist.all_reduce(total)
        curve.append(float(total[0]) / m.data_size)
        if rank == 0 and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps or step == 0):
            print(f"step {step + 1}/{args.steps}: loss {curve[-1]:.4f} (cross-entropy + "
                  f"{cfg.aux_weight} x aux)", flush=True)
    elapsed = time.perf_counter() - t0
    summary = {"mesh": {"pp": m.pp, "dp": m.dp, "ep": m.ep}, "recipe": how, "steps": args.steps,
               "initial_loss": curve[0], "final_loss": curve[-1], "train_curve": curve, "seconds": elapsed,
               "step_seconds": statistics.median(step_times[10:] or step_times), "config": dataclasses.asdict(cfg)}
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"done: {args.steps} steps in {elapsed:.1f} s, loss {curve[0]:.3f} -> {curve[-1]:.3f}; "
              f"wrote {out}/summary.json", flush=True)
    return summary


def main(argv=None, comm=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rank = 0 if comm is None else comm.rank
    cfg = CharLMConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(CharLMConfig)})
    files = load_files(args.corpus_bytes)
    train_data, val_data = split_by_file(files, 0.05, seed=args.split_seed)
    from fmoe.quant.training import recipe_from_name
    precision = recipe_from_name(args.expert_precision, save_activations=args.save_activations)
    from fmoe.comm.compress import wire_from_name
    model = CharLM(cfg, seed=args.seed, comm=comm, precision=precision,
                   a2a_wire=wire_from_name(args.a2a_precision))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    it = batches(train_data, args.batch_size, cfg.context, torch.Generator().manual_seed(args.seed + rank))
    if rank == 0:
        print(f"corpus: {len(train_data):,} train / {len(val_data):,} validation bytes of stdlib source "
              f"(split by file); model: {n_params:,} parameters, {cfg.num_layers} MoE layers x "
              f"{cfg.num_experts} experts (top-{cfg.top_k}); expert precision {args.expert_precision}"
              + (f", a2a {args.a2a_precision}" if comm is not None and comm.size > 1 else ""))
    try:
        from tqdm import tqdm
        bar = tqdm(range(args.steps), disable=args.no_progress or rank != 0, unit="step")
    except ImportError:
        bar = range(args.steps)
    steps, train_curve, val_curve, step_times = [], [], [], []
    saved_bytes = None
    tokens_seen, t0 = 0, time.perf_counter()
    for step in bar:
        inputs, targets = next(it)
        ts = time.perf_counter()
        if saved_bytes is None:  # measure the activation memory of one step, then train as usual
            with SavedBytes() as sb:
                loss, l_aux = model.loss(inputs, targets)
            saved_bytes = sb.total
        else:
            loss, l_aux = model.loss(inputs, targets)
        opt.zero_grad(set_to_none=True)
        (loss + cfg.aux_weight * l_aux).backward()
        sync_and_clip(model, comm, 1.0)
        opt.step()
        sched.step()
        step_times.append(time.perf_counter() - ts)
        tokens_seen += inputs.numel()
        steps.append(step)
        train_curve.append(loss.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss.item():.3f}", aux=f"{l_aux.item():.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_curve.append((step, evaluate(model, val_data, args.batch_size, args.eval_batches)))
    elapsed = time.perf_counter() - t0
    world = 1 if comm is None else comm.size
    tokens_per_rank = args.batch_size * cfg.context
    from fmoe.comm.compress import wire_bytes
    from fmoe.routing import capacity_for
    cap = capacity_for(cfg.capacity_factor, num_tokens=tokens_per_rank, num_experts=cfg.num_experts,
                       k=cfg.top_k)
    dispatch_shape = (cfg.num_experts, cap, cfg.model_dim)  # one rank's dispatch buffer [E, C, M]
    wire = wire_from_name(args.a2a_precision)
    summary = {
        "steps": args.steps,
        "final_train_loss": sum(train_curve[-20:]) / len(train_curve[-20:]),
        "final_val_loss": val_curve[-1][1],
        "initial_loss": train_curve[0],
        "uniform_loss": math.log(VOCAB),
        "tokens_per_second": tokens_seen / elapsed,
        "seconds": elapsed,
        "parameters": n_params,
        "ranks": world,
        "config": dataclasses.asdict(cfg),
        "expert_precision": args.expert_precision,
        "save_activations": args.save_activations,
        "a2a_precision": args.a2a_precision if world > 1 else None,
        # median over the steps after the first 10 (numba compilation and warmup excluded)
        "step_seconds": statistics.median(step_times[10:] or step_times),
        "saved_activation_bytes": saved_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
        "dispatch_buffer_shape": list(dispatch_shape),
        "a2a_bytes_per_call": wire_bytes(dispatch_shape, wire),
        "a2a_bytes_per_call_fp32": wire_bytes(dispatch_shape, "fp32"),
        "train_curve": train_curve,
        "val_curve": val_curve,
    }
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        png = out / "loss.png"
        if not args.no_plot and plot_losses(png, steps, train_curve, val_curve):
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
    # With --mesh (torchrun): `torchrun --nproc_per_node=4 -m fmoe.examples.charlm --mesh ep=2,dp=2`
    # (FSDP2 or --recipe ddp) or `--mesh pp=2,ep=2` (pipeline stages, each expert parallel).
    import sys
    from fmoe.comm import abort_on_error, from_env
    _args = parse_args()
    if _args.mesh:
        from fmoe.comm import TorchDistComm, mesh
        from fmoe.comm.mesh import parse_mesh
        _comm = TorchDistComm.from_env()
        with abort_on_error(_comm):
            train_on_mesh(sys.argv[1:], mesh(**parse_mesh(_args.mesh), num_experts=_args.num_experts))
    else:
        _comm = from_env()
        with abort_on_error(_comm):
            main(comm=_comm)
    _comm.close()  # collective shutdown: torch.distributed aborts at exit without it
