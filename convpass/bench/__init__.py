"""convpass.bench: ``convpass bench``, the tuned executor against the strongest configuration of
each peer (ONNX Runtime's CUDA EP with and without CUDA graphs, PyTorch eager, torch.compile).

What it judges and renders (pure: plain dicts, no GPU):

* :mod:`convpass.bench.stats` — run-time statistics, geometric means, output errors, tolerances.
* :mod:`convpass.bench.records` — the contender record, its statuses, what is read off a case.
* :mod:`convpass.bench.ranking` — the best of each peer group per case (stand-ins where ONNX
  Runtime refused CUDA graphs), the ratios, the rankings over all cases.
* :mod:`convpass.bench.targets` — the targets, read from ``targets.json`` (or ``--targets FILE``),
  and their verdicts.
* :mod:`convpass.bench.schema` — the JSON document's schema (checked with ``jsonschema``).
* :mod:`convpass.bench.document` — the document: build, merge recorded runs, write.
* :mod:`convpass.bench.render` / :mod:`convpass.bench.render_summary` — the text and Markdown tables.
* :mod:`convpass.bench.plot` — the optional bar chart (matplotlib, imported only there).
* :mod:`convpass.bench.opprofile` — ``--profile-ops``: GPU time per launch by op family.
* :mod:`convpass.bench.roofline` — the per-model roofline and the GPU peak measurements.

What runs on the GPU:

* :mod:`convpass.bench.contenders` — one case: the reference, convpass and every peer asked for.
* :mod:`convpass.bench.measure` — inputs, steady-state timing, clocks, the output check.
* :mod:`convpass.bench.convpass_contender`, :mod:`convpass.bench.ort_contender`,
  :mod:`convpass.bench.torch_contender` — one module per contender family.
* :mod:`convpass.bench.reference` — the reference outputs; :mod:`convpass.bench.environment` —
  device, driver, CUDA, cuDNN and package versions.
* :mod:`convpass.bench.peers` — how each peer is configured (standard library only).
* :mod:`convpass.bench.fresh` — cold start in a fresh process (``--fresh-process``).

The command itself (``convpass bench``) is :mod:`convpass.cli.bench`. Importing any of these
imports neither CuPy, nor PyTorch, nor ONNX Runtime, nor matplotlib: those are imported when a
benchmark runs, and a missing one is reported as ``unavailable: <reason>``.
"""
