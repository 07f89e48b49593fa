#!/usr/bin/env python
"""convpass's depthwise conv kernel against cuDNN's fastest legacy algorithm, problem by problem.

For depthwise convs of the panel (ConvNeXt, MobileNetV3, EfficientNet-B0 at batch 32, two at
batch 1), in NCHW and NHWC: the kernel's variants the tuner times (``depthwise.candidates``; or
the outputs per thread R given with ``--strips``) and every cuDNN
legacy algorithm but FFT tiling (seconds per launch on depthwise convs), each timed by the tuner's
harness (captured launches on a non-default stream, rotating input sets larger than L2, medians);
the kernel's output is compared with cuDNN's implicit_gemm (FMA math).

    python benchmarks/depthwise_kernel.py [--strips 1,2,4,8] [--as-given-weights]

``--as-given-weights`` times the kernel reading its weights as cuDNN stores them (the form before
``DepthwiseKernel.weight``'s tap-major copy), to compare the two in one session.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [  # name, n, c, size, kernel, stride
    ("convnext s1", 32, 96, 56, 7, 1), ("convnext s2", 32, 192, 28, 7, 1), ("convnext s3", 32, 384, 14, 7, 1), ("convnext s4", 32, 768, 7, 7, 1),
    ("mnv3 3x3", 32, 64, 112, 3, 2), ("mnv3 3x3 s1", 32, 72, 56, 3, 1), ("mnv3 5x5", 32, 120, 28, 5, 1), ("mnv3 5x5 s2", 32, 72, 56, 5, 2),
    ("effb0 5x5", 32, 480, 14, 5, 1), ("effb0 5x5 b", 32, 672, 14, 5, 2), ("mnv3 5x5 960", 32, 960, 7, 5, 1), ("effb0 3x3", 32, 96, 112, 3, 2),
    ("b1 7x7", 1, 96, 56, 7, 1), ("b1 3x3", 1, 144, 56, 3, 1),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strips", help="outputs per thread to time (default: the variants the tuner times)")
    ap.add_argument("--as-given-weights", action="store_true", help="pass the weights as stored, not as DepthwiseKernel.weight gives them")
    args = ap.parse_args(argv)
    import cupy as cp
    import numpy as np

    from convpass.core.problem import ConvShape
    from convpass.kernels.depthwise import DepthwiseKernel, candidates, strip_of
    from convpass.native import cudnn
    from convpass.tuning import harness

    harness.warm_clocks()
    cp.cuda.Stream(non_blocking=True).use()  # captured timing needs a non-default stream
    for name, n, c, hw, k, s in CASES:
        shape = ConvShape("fwd", n, c, c, (hw, hw), (k, k), (k // 2, k // 2), (s, s), (1, 1), groups=c)
        nbytes = int(np.prod(shape.x_shape) + np.prod(shape.y_shape)) * 4
        for layout in ("nchw", "nhwc"):
            sets = harness.rotation_sets(nbytes)
            xs = [harness.random_array(shape.x_shape, "float32", layout, 10 + i) for i in range(sets)]
            ys = [cudnn.empty_like_layout(shape.y_shape, "float32", layout) for _ in range(sets)]
            w = harness.random_array(shape.w_shape, "float32", "nchw", 2)
            own = []
            strips = [int(v) for v in args.strips.split(",")] if args.strips else [strip_of(a) for a in candidates(shape)]
            for r in strips:
                kernel = DepthwiseKernel(shape, layout == "nhwc", r)
                wk = cudnn.as_layout(w, layout) if args.as_given_weights else kernel.weight(cp, w)  # as the tuner and executor pass it
                kernel(cp, xs[0], wk, ys[0])
                own.append((harness.time_launches(lambda i, kernel=kernel, xs=xs, wk=wk, ys=ys: kernel(cp, xs[i], wk, ys[i]), sets).time_ms, r))
            with cudnn.ConvDescriptors(shape.key(layout, "fma")) as descs:
                wl = cudnn.as_layout(w, layout)
                ref = cudnn.empty_like_layout(shape.y_shape, "float32", layout)
                cudnn.run(descs, None, "implicit_gemm", xs[0], wl, ref)
                err = float(cp.abs(ref - ys[0]).max() / cp.abs(ref).max())
                best = None
                for algo in cudnn.algo_names("fwd"):
                    if algo == "fft_tiling":
                        continue
                    try:
                        ws = cp.empty(max(cudnn.workspace_size(descs, None, algo), 1), cp.uint8)
                        cudnn.run(descs, None, algo, xs[0], wl, ys[0], workspace=ws)
                        t = harness.time_launches(lambda i, algo=algo, xs=xs, wl=wl, ys=ys, ws=ws: cudnn.run(descs, None, algo, xs[i], wl, ys[i], workspace=ws), sets).time_ms
                    except Exception:  # noqa: BLE001  (an algorithm cuDNN does not run here)
                        continue
                    if best is None or t < best[1]:
                        best = (algo, t)
            t_own, r_best = min(own)
            print(f"{name:14s} {layout} " + " ".join(f"R{r}:{t * 1e3:.1f}" for t, r in own)
                  + f"  own {t_own * 1e3:7.1f} us (R{r_best})  cuDNN {best[0]:22s} {best[1] * 1e3:7.1f} us  x{best[1] / t_own:5.2f}  err {err:.1e}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
