"""convpass.bench: ``convpass bench``, the tuned executor against ONNX Runtime's CUDA EP and PyTorch.

* :mod:`convpass.bench.report` — the pure logic: timing statistics, correctness verdicts, ratios to
  the best peer, geometric means, the targets (issue 9's per batch group, worst case, CUDA graph
  capture, op profile; issue 5's cold start) and their verdicts, the text / Markdown tables, the
  JSON document and its schema check, the optional bar chart (matplotlib, lazily).
* :mod:`convpass.bench.opprofile` — ``--profile-ops``: the tuned model's GPU time per launch in eager
  runs, classified by op family (one table), aggregated per case; the text lines it prints.
* :mod:`convpass.bench.roofline` — the per-model roofline (sum over convs of
  max(FLOPs / peak TF32 rate, bytes / copy bandwidth)) and the GPU peak measurements.
* :mod:`convpass.bench.contenders` — what runs on the GPU: convpass (optimize + executor), ONNX
  Runtime CUDA EP (four configurations, IOBinding), PyTorch eager, the ONNX Runtime CPU reference,
  and the environment record (device, driver, CUDA, cuDNN, package versions).
* :mod:`convpass.bench.peers` — how each peer is configured (ONNX Runtime's provider options,
  PyTorch's flags and memory format, the panel's PyTorch builder); standard library only.
* :mod:`convpass.bench.fresh` — cold start in a fresh process (``--fresh-process``): the child
  (``python -m convpass.bench.fresh``: one runtime, one model and batch, process start -> first
  result in host memory, in parts) and the harness that spawns it with empty kernel caches.
The command itself (``convpass bench``) is :mod:`convpass.cli.bench`.

Importing any of these imports neither CuPy, nor PyTorch, nor ONNX Runtime: those are imported when
a benchmark runs, and a missing one is reported as ``unavailable: <reason>``.
"""
