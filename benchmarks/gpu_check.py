"""GPU check for the native kernels and the quantized-training path: correctness against the
CPU reference, then throughput.

    native/build.sh 90 && python benchmarks/gpu_check.py [--quick]

Prints one JSON document. Correctness compares every CUDA kernel with the CPU reference on the
same inputs (weights are exact in BF16, spec §7, so only accumulation order differs). Throughput
is measured with CUDA events next to torch's dense bf16 path on the same shapes. Budget: well
under 8 minutes on an H200 (use --quick for a smoke run). Exits with a clear message when CUDA
is unavailable; it never prints numbers it did not measure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fmoe.quant as Q  # noqa: E402
from fmoe import _native  # noqa: E402
from fmoe.quant import native  # noqa: E402


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


def check_correctness(dev):
    out = {}
    g = torch.Generator().manual_seed(0)
    # W4A16: MXFP4 and NVFP4, C in {1, 5, 16}, odd N.
    for fmt in ("mxfp4", "nvfp4"):
        w = Q.quantize(torch.randn(4, 200, 512, generator=g) * 0.05, fmt)
        wd = w.to(dev)
        for c in (1, 5, 16):
            x = torch.randn(4, c, 512, generator=g).to(torch.bfloat16)
            ref = Q.expert_matmul_reference(x.float(), w)
            y = native.w4a16_matmul(x.to(dev), wd)
            torch.cuda.synchronize()
            err = _rel_err(y, ref)
            out[f"w4a16_{fmt}_C{c}"] = {"rel_err": err, "ok": err < 1e-2}
    # FP8 block GEMM, ragged M/N/K.
    for (E, M, N, K) in ((2, 70, 200, 384), (1, 128, 256, 300)):
        a = Q.quantize_fp8_act_tiles(torch.randn(E, M, K, generator=g))
        b = Q.quantize_fp8_block(torch.randn(E, N, K, generator=g) * 0.05)
        ref = torch.bmm(Q.dequantize(a), Q.dequantize(b).transpose(1, 2))
        y = native.fp8_block_matmul(a.to(dev), b.to(dev))
        torch.cuda.synchronize()
        err = _rel_err(y, ref)
        out[f"fp8_block_{E}x{M}x{N}x{K}"] = {"rel_err": err, "ok": err < 1e-2}
    # Dispatch / combine with dropped slots.
    T, M, k, R = 300, 96, 2, 512
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(T, M, generator=g).to(dt)
        pos = torch.randperm(R, generator=g)[: k * T].reshape(k, T).clone()
        pos[0, ::7] = -1
        w = torch.rand(k, T, generator=g)
        D_ref = torch.zeros(R, M)
        for j in range(k):
            keep = pos[j] >= 0
            D_ref[pos[j][keep]] = w[j][keep, None] * x.float()[keep]
        D = _native.dispatch(x.to(dev), pos.to(dev), w.to(dev), R)
        Y = torch.randn(R, M, generator=g).to(dt)
        y_ref = torch.zeros(T, M)
        for j in range(k):
            keep = (pos[j] >= 0).float()[:, None]
            y_ref += keep * w[j][:, None] * Y.float()[pos[j].clamp(min=0)]
        y = _native.combine(Y.to(dev), pos.to(dev), w.to(dev))
        torch.cuda.synchronize()
        tol = 0 if dt == torch.float32 else 1e-2
        e1, e2 = _rel_err(D, D_ref), _rel_err(y, y_ref)
        out[f"dispatch_{str(dt)[6:]}"] = {"rel_err": e1, "ok": e1 <= max(tol, 1e-7)}
        out[f"combine_{str(dt)[6:]}"] = {"rel_err": e2, "ok": e2 <= max(tol, 1e-6)}
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sweep (smoke run)")
    args = ap.parse_args()
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
    report["correctness"] = check_correctness(dev)
    report["training"], training_times = check_training(dev, args.quick)
    report["all_correct"] = (all(v["ok"] for v in report["correctness"].values())
                             and all(v["ok"] for v in report["training"].values()))
    report["throughput"] = bench(dev, args.quick)
    report["throughput"]["quantized_training_gemm"] = training_times
    report["wall_s"] = time.time() - t0
    print(json.dumps(report, indent=1))
    sys.exit(0 if report["all_correct"] else 1)


if __name__ == "__main__":
    main()
