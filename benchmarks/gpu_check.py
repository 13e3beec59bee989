"""GPU check: every CUDA kernel and every CUDA entry of the kernel table against the CPU
reference, one char-LM training step per precision, then throughput.

    native/build.sh 90 && python benchmarks/gpu_check.py [--quick]
    python benchmarks/gpu_check.py --dry-run      # CPU self-check of the script (no GPU needed)

Prints one JSON document. Sections (each item {"ok": bool, ...}; an exception is recorded as a
failed item with its message, so one failure never hides the rest):

* native: the W4A16 (MXFP4, NVFP4) and FP8 block GEMMs and dispatch/combine against the CPU
  reference, and the wrappers' checks on the GPU (int32 positions, a position >= the rows raises
  IndexError and leaves CUDA usable, [T, k] gate weights refused, a misaligned view accepted);
* ops: ``fmoe::dispatch`` / ``combine`` / ``gate_grad`` on CUDA tensors (the registered kernels);
* table: every (device 'cuda', phase, dtype) entry of :data:`fmoe.engine.table.TABLE`: mm with
  gathered rows (both weight orientations), wgrad and scatter against a float64 CPU reference;
* ragged: ``ragged_mm`` / ``ragged_wgrad`` forward and backward on CUDA (``torch._grouped_mm``)
  and whether they synchronised the host (``torch.cuda.set_sync_debug_mode``);
* quant_auto: ``expert_matmul(path="auto")`` on CUDA picks the native kernels (W4A16 at decode,
  FP8 block) and equals them; the quantized-training GEMMs (``check_training``);
* rows: packed weights over rows sorted by expert (``rows_matmul``): the ragged W4A16 kernel and
  the dequantize + torch._grouped_mm route against the reference, with no host sync;
* charlm: one training step of :class:`fmoe.examples.charlm.CharLM` per precision on the GPU;
* throughput with CUDA events next to torch's dense bf16 path.

Budget: under 8 minutes on one H100 or H200 (``--quick``: a smaller throughput sweep). Exits
with a clear message when CUDA is unavailable; it never prints numbers it did not measure.
``--dry-run`` runs the sections that have a CPU path (table entries, the grouped ragged
path and the packed rows' grouped route on CPU tensors, one tiny char-LM step per precision) so the script is checked without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fmoe  # noqa: E402,F401  (registers the ops' kernels)
import fmoe.quant as Q  # noqa: E402
from fmoe import _native  # noqa: E402
from fmoe.quant import native  # noqa: E402


def _item(fn, *args, **kw) -> dict:
    """Run one check; an exception is a failed item carrying its message."""
    try:
        out = fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001  (a GPU run must report every failure, not stop at one)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                "where": traceback.format_exc(limit=-3).splitlines()[-3:]}
    return out if isinstance(out, dict) else {"ok": bool(out)}


def _section(fn, *args, **kw) -> dict:
    """Run one section; an exception outside its items is one failed item of the section."""
    try:
        return fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001
        return {"section_failed": {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                   "where": traceback.format_exc(limit=-3).splitlines()[-3:]}}


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def _time_cuda(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def _rel_err(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def check_native(dev):
    """The native kernels against the CPU reference, and the wrappers' checks on the GPU."""
    out = {}
    g = torch.Generator().manual_seed(0)
    # W4A16: MXFP4 and NVFP4, C in {1, 5, 16}, odd N.
    for fmt in ("mxfp4", "nvfp4"):
        w = Q.quantize(torch.randn(4, 200, 512, generator=g) * 0.05, fmt)
        wd = w.to(dev)
        for c in (1, 5, 16):
            x = torch.randn(4, c, 512, generator=g).to(torch.bfloat16)
            ref = Q.expert_matmul_reference(x.float(), w)

            def one(x=x, ref=ref, wd=wd):
                y = native.w4a16_matmul(x.to(dev), wd)
                _sync(dev)
                err = _rel_err(y, ref)
                return {"rel_err": err, "ok": err < 1e-2}
            out[f"w4a16_{fmt}_C{c}"] = _item(one)

    def w4a16_misaligned_x():
        # a contiguous view one bf16 element into its storage: the wrapper copies it
        w = Q.quantize(torch.randn(2, 64, 256, generator=g) * 0.05, "mxfp4").to(dev)
        base = torch.randn(2 * 3 * 256 + 1, generator=g).to(torch.bfloat16).to(dev)
        x = base[1:].view(2, 3, 256)
        y = native.w4a16_matmul(x, w)
        same = torch.equal(y, native.w4a16_matmul(x.clone(), w))
        return {"misaligned_view_equals_aligned_copy": same, "ok": same}
    out["w4a16_misaligned_x"] = _item(w4a16_misaligned_x)
    # FP8 block GEMM, ragged M/N/K.
    for (E, M, N, K) in ((2, 70, 200, 384), (1, 128, 256, 300)):
        a = Q.quantize_fp8_act_tiles(torch.randn(E, M, K, generator=g))
        b = Q.quantize_fp8_block(torch.randn(E, N, K, generator=g) * 0.05)
        ref = torch.bmm(Q.dequantize(a), Q.dequantize(b).transpose(1, 2))

        def one(a=a, b=b, ref=ref):
            y = native.fp8_block_matmul(a.to(dev), b.to(dev))
            _sync(dev)
            err = _rel_err(y, ref)
            return {"rel_err": err, "ok": err < 1e-2}
        out[f"fp8_block_{E}x{M}x{N}x{K}"] = _item(one)

    def fp8_misaligned_a():
        # a's data one byte into its storage: the kernel takes byte loads for it
        a = Q.quantize_fp8_act_tiles(torch.randn(1, 40, 256, generator=g)).to(dev)
        b = Q.quantize_fp8_block(torch.randn(1, 64, 256, generator=g) * 0.05).to(dev)
        raw = torch.empty(a.data.numel() + 1, dtype=torch.uint8, device=dev)
        raw[1:].copy_(a.data.view(torch.uint8).reshape(-1))
        shifted = Q.QuantizedTensor(raw[1:].view(torch.float8_e4m3fn).view(a.data.shape), a.scales, None,
                                    a.fmt, a.shape, a.block)
        same = torch.equal(native.fp8_block_matmul(shifted, b), native.fp8_block_matmul(a, b))
        return {"misaligned_a_equals_aligned": same, "ok": same}
    out["fp8_block_misaligned_a"] = _item(fp8_misaligned_a)
    # Dispatch / combine with dropped slots (fp32 exact; bf16 one rounding).
    T, M, k, R = 300, 96, 2, 768
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(T, M, generator=g).to(dt)
        pos = torch.randperm(R, generator=g)[: k * T].reshape(k, T).clone()
        pos[0, ::7] = -1
        w = torch.rand(k, T, generator=g)
        D_ref = torch.zeros(R, M)
        for j in range(k):
            keep = pos[j] >= 0
            D_ref[pos[j][keep]] = w[j][keep, None] * x.float()[keep]
        Y = torch.randn(R, M, generator=g).to(dt)
        y_ref = torch.zeros(T, M)
        for j in range(k):
            keep = (pos[j] >= 0).float()[:, None]
            y_ref += keep * w[j][:, None] * Y.float()[pos[j].clamp(min=0)]
        tol = 0 if dt == torch.float32 else 1e-2
        name = str(dt)[6:]

        def d_one(x=x, pos=pos, w=w, D_ref=D_ref, tol=tol):
            D = _native.dispatch(x.to(dev), pos.to(dev), w.to(dev), R)
            D32 = _native.dispatch(x.to(dev), pos.to(dev).int(), w.to(dev), R)   # int32 positions
            _sync(dev)
            e1 = _rel_err(D, D_ref)
            return {"rel_err": e1, "int32_pos_equal": torch.equal(D, D32),
                    "ok": e1 <= max(tol, 1e-7) and torch.equal(D, D32)}

        def c_one(Y=Y, pos=pos, w=w, y_ref=y_ref, tol=tol):
            y = _native.combine(Y.to(dev), pos.to(dev), w.to(dev))
            y32 = _native.combine(Y.to(dev), pos.to(dev).int(), w.to(dev))
            _sync(dev)
            e2 = _rel_err(y, y_ref)
            return {"rel_err": e2, "int32_pos_equal": torch.equal(y, y32),
                    "ok": e2 <= max(tol, 1e-6) and torch.equal(y, y32)}
        out[f"dispatch_{name}"] = _item(d_one)
        out[f"combine_{name}"] = _item(c_one)

    def range_and_shape_checks():
        x = torch.randn(8, 16, device=dev)
        pos = torch.arange(16, device=dev).reshape(2, 8)
        w = torch.rand(2, 8, device=dev)
        res = {}
        for name, call, exc in (
                ("dispatch_pos_ge_rows", lambda: _native.dispatch(x, pos, w, 15), IndexError),
                ("combine_pos_ge_rows", lambda: _native.combine(torch.randn(15, 16, device=dev), pos, w), IndexError),
                ("dispatch_weights_Tk", lambda: _native.dispatch(x, pos, w.t().contiguous(), 16), ValueError)):
            try:
                call()
                res[name] = "no error"
            except exc as e:
                res[name] = f"{type(e).__name__}: {e}"
        # the flag path raised without a device-side assert: CUDA still works afterwards
        res["cuda_usable_after"] = bool(torch.equal(_native.dispatch(x, pos, None, 16)[pos[1, 3]], x[3]))
        res["ok"] = res["cuda_usable_after"] and not any(v == "no error" for v in res.values())
        return res
    out["wrapper_checks"] = _item(range_and_shape_checks)
    return out


def check_ops(dev):
    """fmoe::dispatch / combine / gate_grad on CUDA tensors (the ops' CUDA kernels) against CPU."""
    out = {}
    g = torch.Generator().manual_seed(2)
    T, M, k, R = 100, 64, 2, 256
    pos = torch.randperm(R, generator=g)[: k * T].reshape(k, T).clone()
    pos[1, ::5] = -1
    w = torch.rand(k, T, generator=g)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(T, M, generator=g).to(dt)
        Y = torch.randn(R, M, generator=g).to(dt)
        tol = 1e-6 if dt == torch.float32 else 1e-2

        def one(x=x, Y=Y, tol=tol):
            errs = {
                "dispatch": _rel_err(torch.ops.fmoe.dispatch(x.to(dev), pos.to(dev), w.to(dev), R),
                                     torch.ops.fmoe.dispatch(x, pos, w, R)),
                "combine": _rel_err(torch.ops.fmoe.combine(Y.to(dev), pos.to(dev), w.to(dev)),
                                    torch.ops.fmoe.combine(Y, pos, w)),
                "gate_grad": _rel_err(torch.ops.fmoe.gate_grad(x.to(dev), Y.to(dev), pos.to(dev)),
                                      torch.ops.fmoe.gate_grad(x, Y, pos)),
            }
            return {**{f"rel_err_{n}": e for n, e in errs.items()}, "ok": max(errs.values()) <= tol}
        out[f"ops_{str(dt)[6:]}"] = _item(one)
    return out


def _table_reference(a, w, bounds, rows, transposed):
    """Per-expert float64 CPU products of a table mm (the oracle)."""
    a64, w64 = a.double().cpu(), w.double().cpu()
    if rows is not None:
        a64 = a64[rows.cpu()]
    parts = []
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        parts.append(a64[lo:hi] @ (w64[e].t() if transposed else w64[e]))
    return torch.cat(parts)


def check_table(dev):
    """Every CUDA entry of the kernel table (mm with gathered rows in both weight orientations,
    wgrad, scatter) against float64 CPU products, on ``dev`` (the CPU under --dry-run)."""
    from fmoe.engine import table
    from fmoe.engine.plan import plan_from_bounds

    out = {}
    g = torch.Generator().manual_seed(3)
    E, T, K, N, k = 4, 48, 64, 32, 2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[:5] = torch.tensor([0, 1])          # expert 3 keeps some rows; make expert 2 empty below
    ids[ids == 2] = 3
    order = torch.argsort(ids.reshape(-1), stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    tokens = (order // k).to(torch.int64)
    for key, kern in table.TABLE.items():
        if key[0] != "cuda":
            continue
        _, phase, dt = key[:3]
        name = f"{kern.name}|{phase}|{str(dt)[6:]}"

        def one(dt=dt, kern=kern):
            plan = plan_from_bounds(tokens.to(dev), order.to(dev), bounds, T, needs_grad=False, dtype=dt)
            x = torch.randn(T, K, generator=g).to(dt)
            w_nk = (torch.randn(E, N, K, generator=g) * 0.1).to(dt)
            w_kn = (torch.randn(E, K, N, generator=g) * 0.1).to(dt)
            tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dt, 1e-2)
            errs = {
                "mm_nk": _rel_err(kern.mm(x.to(dev), w_nk.to(dev), plan, rows=tokens.to(dev), transposed=True),
                                  _table_reference(x, w_nk, bounds, tokens, True)),
                "mm_kn": _rel_err(kern.mm(x.to(dev), w_kn.to(dev), plan, rows=tokens.to(dev), transposed=False),
                                  _table_reference(x, w_kn, bounds, tokens, False)),
            }
            a = torch.randn(bounds[-1], K, generator=g).to(dt)
            b = torch.randn(bounds[-1], N, generator=g).to(dt)
            z = kern.wgrad(a.to(dev), b.to(dev), plan)
            z_ref = torch.stack([a.double()[bounds[e]:bounds[e + 1]].t() @ b.double()[bounds[e]:bounds[e + 1]]
                                 for e in range(E)])
            errs["wgrad"] = _rel_err(z, z_ref)
            h = torch.randn(bounds[-1], K, generator=g).to(dt)
            scale = torch.rand(bounds[-1], generator=g)
            y = kern.scatter(h.to(dev), w_nk.to(dev), plan, index=tokens.to(dev),
                             out=torch.zeros(T, N, dtype=dt, device=dev), scale=scale.to(dev).to(dt),
                             transposed=True)
            y_ref = torch.zeros(T, N, dtype=torch.float64).index_add_(
                0, tokens, _table_reference(h, w_nk, bounds, None, True) * scale.to(dt).double()[:, None])
            errs["scatter"] = _rel_err(y, y_ref)
            _sync(dev)
            return {**{f"rel_err_{n}": e for n, e in errs.items()}, "tol": tol,
                    "ok": max(errs.values()) <= tol}
        out[name] = _item(one)
    return out


def check_ragged(dev):
    """ragged_mm / ragged_wgrad forward and backward against the float64 reference, and whether the
    call synchronised the host (CUDA only: torch.cuda.set_sync_debug_mode)."""
    from fmoe.ops import ragged as RG

    out = {}
    g = torch.Generator().manual_seed(4)
    E, R, K, N = 5, 40, 64, 32
    offsets = torch.tensor([0, 7, 7, 20, 31, 36])      # an empty expert and 4 padding rows
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        def one(dt=dt):
            x = torch.randn(R, K, generator=g).to(dt)
            w = (torch.randn(E, N, K, generator=g) * 0.1).to(dt)
            gy = torch.randn(R, N, generator=g).to(dt)
            xd, wd = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
            if torch.device(dev).type == "cuda":
                y = RG.ragged_mm(xd.detach(), wd.detach(), offsets.to(dev), transposed=True)  # warm
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    RG.ragged_mm(xd.detach(), wd.detach(), offsets.to(dev), transposed=True)
                    synced = False
                except RuntimeError:
                    synced = True
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            else:
                synced = None
            y = RG.ragged_mm(xd, wd, offsets.to(dev), transposed=True)
            gx, gw = torch.autograd.grad(y, (xd, wd), gy.to(dev))
            x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
            y64 = RG.ragged_mm_reference(x64, w64, offsets, transposed=True)
            gx64, gw64 = torch.autograd.grad(y64, (x64, w64), gy.double())
            tol = 1e-5 if dt == torch.float32 else 2e-2
            errs = {"y": _rel_err(y, y64), "dx": _rel_err(gx, gx64), "dw": _rel_err(gw, gw64)}
            pad_zero = bool((y[36:] == 0).all())
            return {**{f"rel_err_{n}": e for n, e in errs.items()}, "padding_rows_zero": pad_zero,
                    "host_sync_in_forward": synced, "ok": max(errs.values()) <= tol and pad_zero}
        out[f"ragged_{str(dt)[6:]}"] = _item(one)
    return out


def check_rows(dev):
    """``fmoe.quant.matmul.rows_matmul`` over rows sorted by expert (the kernel table's packed CUDA
    entry) against the per-expert dequantize reference: the ragged W4A16 kernel (mxfp4, nvfp4; its
    rows must equal the padded kernel's bit for bit, the same device code) and the dequantize + one
    torch._grouped_mm route (every format), each with whether it synchronised the host and what
    "auto" picks. On the CPU (--dry-run) the grouped route in fp32 only."""
    from fmoe.quant import matmul as QM

    out = {}
    g = torch.Generator().manual_seed(7)
    E, Nn, K = 5, 200, 512
    offsets = torch.tensor([0, 3, 3, 12, 13, 16])   # an empty expert; ~3 rows per expert (decode)
    o = offsets.tolist()
    cuda = torch.device(dev).type == "cuda"
    for fmt in ("mxfp4", "nvfp4", "mxfp8", "fp8_block", "fp8_row"):
        wf = torch.randn(E, Nn, K, generator=g) * 0.05
        w = Q.quantize_fp8_block(wf) if fmt == "fp8_block" else Q.quantize(wf, fmt)
        a = torch.randn(o[-1], K, generator=g).to(torch.bfloat16 if cuda else torch.float32)
        ref = torch.zeros(o[-1], Nn)
        for e in range(E):
            if o[e + 1] > o[e]:
                ref[o[e]:o[e + 1]] = Q.expert_matmul_reference(a[o[e]:o[e + 1]].float().unsqueeze(0), w[e:e + 1])[0]
        for path in (("w4a16", "grouped") if cuda and fmt in ("mxfp4", "nvfp4") else ("grouped",)):
            def one(fmt=fmt, w=w, a=a, ref=ref, path=path):
                wd, ad, od = w.to(dev), a.to(dev), offsets.to(dev)
                res = {"auto_choice": QM._rows_choice(ad, wd) if cuda else "grouped"}
                y = QM.rows_matmul(ad, wd, od, path=path)   # warm (and the CPU run)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        y = QM.rows_matmul(ad, wd, od, path=path)
                        res["host_sync"] = False
                    except RuntimeError:
                        res["host_sync"] = True
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                    torch.cuda.synchronize()
                res["rel_err"] = _rel_err(y, ref)
                ok = res["rel_err"] < 1e-2 and not res.get("host_sync", False)
                if path == "w4a16":
                    res["equals_padded_kernel"] = all(
                        torch.equal(y[o[e]:o[e + 1]],
                                    native.w4a16_matmul(ad[o[e]:o[e + 1]].unsqueeze(0), wd[e:e + 1])[0])
                        for e in range(E) if o[e + 1] > o[e])
                    ok = ok and res["equals_padded_kernel"] and res["auto_choice"] == "w4a16"
                return {**res, "ok": ok}
            out[f"rows_{path}_{fmt}"] = _item(one)
    return out


def check_quant_auto(dev):
    """expert_matmul(path="auto") on CUDA: the native kernel is chosen and its result returned."""
    from fmoe.quant import matmul as QM

    out = {}
    g = torch.Generator().manual_seed(5)
    E, K, N = 2, 256, 96
    for fmt in ("mxfp4", "nvfp4"):
        for C in (1, 16, 64):
            def one(fmt=fmt, C=C):
                w = Q.quantize(torch.randn(E, N, K, generator=g) * 0.05, fmt).to(dev)
                x = torch.randn(E, C, K, generator=g).to(torch.bfloat16).to(dev)
                choice = QM._cuda_choice(x, w)
                y = Q.expert_matmul(x, w)
                want = "w4a16" if C <= QM._W4A16_MAX_TOKENS else "reference"
                same = torch.equal(y, native.w4a16_matmul(x, w) if want == "w4a16" else
                                   Q.expert_matmul(x, w, path="reference"))
                err = _rel_err(y, Q.expert_matmul_reference(x.float().cpu(), w.to("cpu")))
                return {"choice": choice, "equals_chosen_kernel": same, "rel_err_vs_fp32_reference": err,
                        "ok": choice == want and same and err < 1e-2}
            out[f"auto_{fmt}_C{C}"] = _item(one)

    def fp8():
        w = Q.quantize_fp8_block(torch.randn(E, N, K, generator=g) * 0.05).to(dev)
        x = torch.randn(E, 8, K, generator=g).to(torch.bfloat16).to(dev)
        y = Q.expert_matmul(x, w)
        same = torch.equal(y, native.fp8_block_matmul(Q.quantize_fp8_act_tiles(x, 128), w))
        err = _rel_err(y, Q.expert_matmul_reference(x.float().cpu(), w.to("cpu")))
        # the FP8 activation tiles round x: a few percent, not bf16's 1e-2
        return {"choice": QM._cuda_choice(x, w), "equals_chosen_kernel": same,
                "rel_err_vs_unquantized_activations": err, "ok": same and err < 6e-2}
    out["auto_fp8_block"] = _item(fp8)
    return out


def check_charlm(dev, precisions=None, tiny=False):
    """One training step of the char-LM per expert precision on ``dev``: finite loss and
    gradients, a loss near the uniform log(256) at initialisation, and its time."""
    from fmoe.examples import charlm as CL

    out = {}
    cfg = CL.CharLMConfig(model_dim=32, num_layers=1, num_heads=2, context=16, num_experts=4,
                          hidden_size=32) if tiny else CL.CharLMConfig()
    batch = 2 if tiny else 32
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, CL.VOCAB, (batch, cfg.context + 1), generator=g)
    for prec in precisions or CL.PRECISIONS:
        def one(prec=prec):
            model = CL.CharLM(cfg, seed=0, precision=prec).to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            inputs, targets = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
            t0 = time.perf_counter()
            loss, l_aux = model.loss(inputs, targets)
            (loss + cfg.aux_weight * l_aux).backward()
            opt.step()
            _sync(dev)
            seconds = time.perf_counter() - t0
            grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
            lv = float(loss.detach())
            return {"loss": lv, "grads_finite": grads_finite, "step_s": seconds,
                    "ok": grads_finite and abs(lv - 5.545) < 1.0}
        out[f"charlm_{prec}"] = _item(one)
    return out


def check_training(dev, quick):
    """Quantized training (fmoe.quant.training.quantized_mm) on CUDA against the CPU reference.

    Per format and orientation: the operand quantizers (torch codecs on CUDA vs the numba
    kernels on CPU) must be bit-exact; y (native W4A16 / FP8 block kernels where they fit: bf16
    outputs), dx and dw (torch on CUDA) are compared with the CPU reference path by relative
    error. Stochastic-rounding recipes (CUDA generator, so other draws than the CPU's) are
    checked for finite gradients close to the float GEMMs. Then one timing: forward + backward
    of one expert GEMM against the bf16 autograd bmm, with CUDA events.
    """
    from fmoe.quant import training as QT

    out, times = {}, []
    mm, wgrad = QT.bmm_layout()
    g = torch.Generator().manual_seed(1)
    E, C, K, N = 2, 70, 256, 192
    for fmt in ("fp8_row", "fp8_block", "mxfp8", "mxfp4", "nvfp4"):
        t = torch.randn(E, C, K, generator=g)
        codec_exact = all(
            torch.equal(QT.fake_quantize(t.to(dev), fmt, role, impl="torch").cpu().view(torch.int32),
                        QT.fake_quantize(t, fmt, role, impl="numba").view(torch.int32))
            for role in ("weight", "act"))
        r = QT.TrainPrecision(weights=fmt, activations=True, grads=True, stochastic_rounding=False)
        for transposed in (True, False):
            x = torch.randn(E, C, K, generator=g)
            w = torch.randn((E, N, K) if transposed else (E, K, N), generator=g) * 0.05
            gy = torch.randn(E, C, N, generator=g)
            res = []
            for d, path in (("cpu", "reference"), (dev, "auto")):
                xr = x.to(d).requires_grad_()
                wr = w.to(d).requires_grad_()
                y = QT.quantized_mm(xr, wr, r, transposed=transposed, mm=mm, wgrad=wgrad, path=path)
                dx, dw = torch.autograd.grad(y, (xr, wr), gy.to(d))
                res.append((y, dx, dw))
            torch.cuda.synchronize()
            errs = {n: _rel_err(a, b) for n, a, b in zip(("y", "dx", "dw"), res[1], res[0])}
            # bf16 epilogues of the native kernels round y; dx / dw are FP32 torch on both sides
            ok = codec_exact and errs["y"] < 1e-2 and errs["dx"] < 1e-4 and errs["dw"] < 1e-4
            out[f"train_{fmt}_{'nk' if transposed else 'kn'}"] = {"codec_bit_exact": codec_exact,
                                                                  **{f"rel_err_{n}": e for n, e in errs.items()},
                                                                  "ok": ok}
    for name in ("mxfp4", "nvfp4"):
        x = torch.randn(E, C, K, generator=g).to(dev)
        w = (torch.randn(E, N, K, generator=g) * 0.05).to(dev).requires_grad_()
        gy = torch.randn(E, C, N, generator=g).to(dev)
        y = QT.quantized_mm(x, w, QT.recipe_from_name(name), transposed=True, mm=mm, wgrad=wgrad,
                            generator=torch.Generator(device=dev).manual_seed(0))
        (dw,) = torch.autograd.grad(y, w, gy)
        exact = torch.bmm(gy.transpose(1, 2), x)
        err = _rel_err(dw, exact)
        out[f"train_{name}_stochastic"] = {"rel_err_dw_vs_float": err,
                                           "ok": bool(torch.isfinite(dw).all()) and err < 0.35}
    # timing: one expert GEMM, forward + backward
    E, C, K, N = (4, 512, 1024, 1024) if quick else (8, 1024, 2048, 2048)
    x = torch.randn(E, C, K, device=dev)
    w = (torch.randn(E, N, K, device=dev) * 0.02).requires_grad_()
    gy = torch.randn(E, C, N, device=dev)
    xb, wb, gb = x.bfloat16(), w.detach().bfloat16().requires_grad_(), gy.bfloat16()

    def bf16_step():
        torch.autograd.grad(torch.bmm(xb, wb.transpose(1, 2)), wb, gb)

    t_ref = _time_cuda(bf16_step, 5 if quick else 10)
    for name in ("fp8_block", "mxfp8", "mxfp4", "nvfp4"):
        gen = torch.Generator(device=dev).manual_seed(0)

        def q_step():
            y = QT.quantized_mm(x, w, QT.recipe_from_name(name), transposed=True, mm=mm, wgrad=wgrad,
                                generator=gen)
            torch.autograd.grad(y, w, gy)

        t_q = _time_cuda(q_step, 5 if quick else 10)
        times.append({"precision": name, "E": E, "C": C, "K": K, "N": N, "fwd_bwd_ms": t_q * 1e3,
                      "bf16_bmm_fwd_bwd_ms": t_ref * 1e3,
                      "note": "quantizers run as torch ops on CUDA (no fused GPU quantize kernels)"})
    return out, times


def bench(dev, quick):
    res = {"dispatch_combine": [], "w4a16_decode": [], "fp8_block_gemm": []}
    iters = 5 if quick else 20
    # Dispatch/combine bandwidth (bytes read + written by the ideal kernel).
    for T, M in ((4096, 4096), (16384, 7168)):
        k = 8 if not quick else 2
        R = k * T
        x = torch.randn(T, M, device=dev, dtype=torch.bfloat16)
        pos = torch.randperm(R, device=dev)[: k * T].reshape(k, T)
        w = torch.rand(k, T, device=dev)
        D = _native.dispatch(x, pos, w, R)
        t_d = _time_cuda(lambda: _native.dispatch(x, pos, w, R), iters)
        t_c = _time_cuda(lambda: _native.combine(D, pos, w), iters)
        idx = pos.flatten()
        t_torch = _time_cuda(lambda: D.index_copy_(0, idx, x.repeat(k, 1)), iters)
        nbytes = 2 * k * T * M * 2
        res["dispatch_combine"].append({
            "T": T, "M": M, "k": k, "dispatch_GBps": nbytes / t_d / 1e9,
            "combine_GBps": (k * T * M * 2 + T * M * 2) / t_c / 1e9,
            "torch_index_copy_GBps": nbytes / t_torch / 1e9,
            "note": "dispatch time includes zero-filling D (R*M*2 bytes) in _native.dispatch"})
    # W4A16 decode GEMV, gpt-oss-120b-like expert: N = 2*2880, K = 2880 (K%32 == 0).
    E, N, K = (4, 5760, 2880)
    for fmt in ("mxfp4", "nvfp4"):
        wq = Q.quantize(torch.randn(E, N, K) * 0.02, fmt).to(dev)
        wb = Q.dequantize(wq.to("cpu"), torch.bfloat16).to(dev)
        for c in ((1, 4, 16) if quick else (1, 2, 4, 8, 16)):
            x = torch.randn(E, c, K, device=dev, dtype=torch.bfloat16)
            t_q = _time_cuda(lambda: native.w4a16_matmul(x, wq), iters)
            t_b = _time_cuda(lambda: torch.bmm(x, wb.transpose(1, 2)), iters)
            res["w4a16_decode"].append({
                "fmt": fmt, "E": E, "N": N, "K": K, "C": c, "us": t_q * 1e6,
                "weight_GBps": wq.nbytes / t_q / 1e9, "bf16_bmm_us": t_b * 1e6,
                "bf16_weight_GBps": wb.numel() * 2 / t_b / 1e9, "speedup_vs_bf16": t_b / t_q})
    # FP8 block GEMM at large batch (DeepSeek-V3 expert-ish shapes).
    for (E, M, N, K) in (((2, 1024, 2048, 7168),) if quick else ((4, 2048, 4096, 7168),
                                                              (8, 1024, 2048, 7168))):
        a = Q.quantize_fp8_act_tiles(torch.randn(E, M, K)).to(dev)
        b = Q.quantize_fp8_block(torch.randn(E, N, K) * 0.02).to(dev)
        ab = Q.dequantize(a.to("cpu"), torch.bfloat16).to(dev)
        bb = Q.dequantize(b.to("cpu"), torch.bfloat16).to(dev)
        t_f = _time_cuda(lambda: native.fp8_block_matmul(a, b), max(3, iters // 4))
        t_b = _time_cuda(lambda: torch.bmm(ab, bb.transpose(1, 2)), iters)
        flops = 2.0 * E * M * N * K
        res["fp8_block_gemm"].append({"E": E, "M": M, "N": N, "K": K,
                                      "fp8_TFLOPs": flops / t_f / 1e12,
                                      "bf16_bmm_TFLOPs": flops / t_b / 1e12})
    return res


def _all_ok(*sections) -> bool:
    return all(v.get("ok", False) for sec in sections for v in sec.values())


def dry_run() -> int:
    """The CPU-checkable part: the table's CUDA entries and the grouped ragged path on CPU tensors,
    one tiny char-LM step per precision; prints JSON, returns the exit code."""
    from fmoe.ops import ragged as RG

    t0 = time.time()
    report = {"dry_run": True, "device": "cpu", "torch": torch.__version__,
              "native_built": _native.built(), "table": _section(check_table, "cpu")}
    saved = RG._takes_grouped_mm   # the CUDA route of ragged_mm on CPU tensors
    RG._takes_grouped_mm = lambda t: t.dtype in RG._GROUPED_DTYPES
    try:
        report["ragged"] = _section(check_ragged, "cpu")
    finally:
        RG._takes_grouped_mm = saved
    report["rows"] = _section(check_rows, "cpu")
    report["charlm"] = _section(check_charlm, "cpu", tiny=True)
    report["all_correct"] = _all_ok(report["table"], report["ragged"], report["rows"], report["charlm"])
    report["wall_s"] = time.time() - t0
    print(json.dumps(report, indent=1))
    return 0 if report["all_correct"] else 1


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller throughput sweep (smoke run)")
    ap.add_argument("--dry-run", action="store_true", help="CPU self-check of this script (no GPU)")
    args = ap.parse_args(argv)
    if args.dry_run:
        sys.exit(dry_run())
    if not torch.cuda.is_available():
        print(json.dumps({"error": "CUDA is not available: gpu_check.py needs an NVIDIA GPU "
                                   "(and native/build.sh run first); nothing was measured"}))
        sys.exit(2)
    try:
        native.lib()
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(2)
    dev = torch.device("cuda")
    t0 = time.time()
    report = {"device": torch.cuda.get_device_name(dev),
              "capability": list(torch.cuda.get_device_capability(dev)),
              "torch": torch.__version__, "native": native.lib().fmoe_native_version().decode(),
              "host": platform.node()}
    sections = {}
    for name, fn in (("native", check_native), ("ops", check_ops), ("table", check_table),
                     ("ragged", check_ragged), ("quant_auto", check_quant_auto), ("rows", check_rows)):
        ts = time.time()
        sections[name] = _section(fn, dev)
        report[f"{name}_s"] = time.time() - ts
    ts = time.time()
    training = _item(check_training, dev, args.quick)
    if "error" in training:
        sections["training"], training_times = {"check_training": training}, []
    else:
        sections["training"], training_times = training
    sections["charlm"] = _section(check_charlm, dev)
    report["training_and_charlm_s"] = time.time() - ts
    report.update(sections)
    report["all_correct"] = _all_ok(*sections.values())
    report["failed"] = [f"{sec}.{k}" for sec, items in sections.items() for k, v in items.items()
                        if not v.get("ok", False)]
    report["throughput"] = _item(bench, dev, args.quick)
    if isinstance(report["throughput"], dict) and "error" not in report["throughput"]:
        report["throughput"]["quantized_training_gemm"] = training_times
    report["wall_s"] = time.time() - t0
    print(json.dumps(report, indent=1))
    sys.exit(0 if report["all_correct"] else 1)


if __name__ == "__main__":
    main()
