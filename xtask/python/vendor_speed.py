"""The vendor libraries' speed beside ours, in the GPU kit.

Reads `kernel_speed`'s output (a file of `name  GFLOP/s` lines), times the
same workloads with PyTorch on CUDA (cuBLAS and cuDNN, float32, TF32 off,
CUDA events, median of many runs; a `mixed` workload in float16 with float32
accumulation, on tensor cores), and prints one line per workload: our
figure for the tiling the kernels choose, the best tiling a sweep found, the
vendor's, and the ratio of ours to theirs. Runs only where PyTorch sees a
CUDA GPU; `run.sh` skips it elsewhere.

Usage: python3 vendor_speed.py speed.txt
"""

import re
import statistics
import sys

import torch
import torch.nn.functional as F

LINE = re.compile(r"^(?P<name>.+?)\s+(?P<gflops>[0-9.]+) GFLOP/s$")
MATMUL = re.compile(r"^matmul (\d+)x(\d+)x(\d+)(?P<mixed> mixed)?$")
LINEAR = re.compile(r"^linear (\d+)x(\d+) -> (\d+)(?P<mixed> mixed)? (?P<pass>fwd|bwd)$")
CONV = re.compile(
    r"^conv2d (\d+)x(\d+)x(\d+)x(\d+) -> (\d+) k(\d+)x(\d+)(?P<mixed> mixed)? (?P<pass>fwd|bwd|fwd\+bwd)$"
)


def key(name):
    """The workload a line times, without its tiling or marks."""
    name = name.replace(" [chosen]", "")
    return re.sub(r" \([^)]*\)", "", name).strip()


def ours(path):
    chosen, best = {}, {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line.strip())
            if not m:
                continue
            k, g = key(m["name"]), float(m["gflops"])
            best[k] = max(best.get(k, 0.0), g)
            # Without a sweep every line is the chosen tiling.
            if "[chosen]" in m["name"] or k not in chosen:
                chosen[k] = g
    return chosen, best


def median_seconds(fn, runs=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def vendor(k):
    """(flops, seconds) of workload `k` with PyTorch, or None if unknown."""
    for pattern in (MATMUL, LINEAR, CONV):
        if m := pattern.match(k):
            dtype = torch.float16 if m["mixed"] else torch.float32
            return timed(m, dtype)
    return None


def timed(m, dtype):
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    if m.re is MATMUL:
        mm, kk, nn = map(int, m.groups()[:3])
        a, b = randn(mm, kk), randn(kk, nn)
        return 2.0 * mm * kk * nn, median_seconds(lambda: a @ b)
    if m.re is LINEAR:
        rows, inputs, outputs = map(int, m.groups()[:3])
        x, w, bias, dy = randn(rows, inputs), randn(outputs, inputs), randn(outputs), randn(rows, outputs)
        flops = 2.0 * rows * inputs * outputs
        if m["pass"] == "fwd":
            return flops, median_seconds(lambda: F.linear(x, w, bias))
        return 2 * flops, median_seconds(lambda: (dy @ w, dy.t() @ x))
    if m.re is CONV:
        n, c, h, w_, o, kh, kw = map(int, m.groups()[:7])
        x, w, bias = randn(n, c, h, w_), randn(o, c, kh, kw), randn(o)
        dy = randn(n, o, h, w_)
        flops = 2.0 * n * o * h * w_ * c * kh * kw
        pad = (kh // 2, kw // 2)

        def backward():
            return torch.ops.aten.convolution_backward(
                dy, x, w, [o], [1, 1], list(pad), [1, 1], False, [0, 0], 1, [True, True, False]
            )

        if m["pass"] == "fwd":
            return flops, median_seconds(lambda: F.conv2d(x, w, bias, padding=pad))
        if m["pass"] == "bwd":
            return 2 * flops, median_seconds(backward)
        return 3 * flops, median_seconds(lambda: (F.conv2d(x, w, bias, padding=pad), backward()))
    return None


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: vendor_speed.py speed.txt")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # float16 products summed in float32, as our mixed precision does.
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cudnn.benchmark = True
    chosen, best = ours(sys.argv[1])
    print(
        f"vendor: PyTorch {torch.__version__} on {torch.cuda.get_device_name()}, "
        "float32 with TF32 off; `mixed`: float16 with float32 accumulation"
    )
    print(f"{'workload':<44} {'ours':>10} {'best tiling':>12} {'vendor':>10} {'ratio':>7} {'best':>7}")
    for k in chosen:
        measured = vendor(k)
        if measured is None:
            continue
        flops, seconds = measured
        theirs = flops / seconds / 1e9
        print(
            f"{k:<44} {chosen[k]:>10.1f} {best[k]:>12.1f} {theirs:>10.1f} "
            f"{chosen[k] / theirs:>7.3f} {best[k] / theirs:>7.3f}"
        )


if __name__ == "__main__":
    main()
