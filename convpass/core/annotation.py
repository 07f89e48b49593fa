"""The annotation schema: how a tuned model records its convolution decisions.

This module is the only place that knows the format; the annotate pass writes through it, and
``inspect``, the executor and everything else read through it. Its code lives in three modules
that this one gathers, one per part of the format: the per-conv decision attributes
(:mod:`convpass.core.annotation_decisions`), the model-level metadata records, precision and
fusions included (:mod:`convpass.core.annotation_metadata`), and the model-local function bodies
(:mod:`convpass.core.annotation_functions`); import their names from here.

Format (schema version 7)
-------------------------
* Every tuned ``Conv`` / ``ConvTranspose`` node is the same op in domain ``ai.convpass``, with all
  its original attributes unchanged, plus the decision attributes below. (schema 6) A node without
  a bias input is ``ConvNoBias`` / ``ConvTransposeNoBias`` there (:func:`standard_op_type` maps
  back).
* The model carries one model-local function per such op (``ai.convpass.Conv``,
  ``ai.convpass.ConvNoBias``, ...) whose body is the standard op with every standard attribute
  passed through by reference, so ``onnx.checker.check_model(full_check=True)`` accepts the model
  and ONNX Runtime runs it unchanged. The bias-less functions take ``X, W`` only: a function with a
  ``B`` input, called without one, inlines to a conv with an empty bias input, which ONNX
  Runtime's CPU layout optimizer (NCHWc, 1.32) leaves alone (measured: a torch.export ResNet-50,
  whose convs have no bias, ran 20-30% slower in ONNX Runtime CPU once tuned under schema 5).
  The model imports ``ai.convpass`` version 1 and keeps an IR version that allows model-local
  functions (>= 8).
* **Per-device tables.** A model holds one decision table per device fingerprint it was tuned for
  (``convpass.devices``, in table order; one table with no device when nothing could be measured
  or looked up, and then every decision is ``auto``). A table has one decision per shape profile
  (``convpass.profiles``). Each decision attribute holds one value per (table, profile), device-major:
  entry ``t * n_profiles + p`` is table ``t``'s decision for profile ``p``; a single entry is
  written as a scalar.

  ``algo``            legacy algorithm that runs the node: the forward algorithm of a Conv, the
                      backward-data algorithm of a ConvTranspose; ``"auto"`` = chosen at run time.
                      When ``engine`` is set, the legacy algorithm nearest to that engine (the
                      fastest measured for the same key, else cuDNN's heuristic first choice), which
                      runs where the graph API cannot. It may also name convpass's own kernel
                      (``convpass_depthwise_r8``: :mod:`convpass.kernels.depthwise`), which
                      runs like a legacy algorithm, its ``fusion`` in the kernel
  ``engine``          (optional, schema 3) the cuDNN graph-API engine configuration that runs the
                      node, as cuDNN names its plans (``eng67_k2=16_k13=0``: engine id, then knob
                      id = value), of the graph ``y = conv(x, w)`` (the bias follows as its own
                      pass; :mod:`convpass.native.cudnn.graph_api`), or with a ``fusion`` of that
                      fused graph; ``""`` = the legacy ``algo`` runs. The
                      device fingerprint of the table names the cuDNN version it was measured with
  ``fusion``          (optional, schema 4) the epilogue fused into ``engine``'s graph, named by what
                      follows the conv: ``bias+swish`` = ``y = silu(conv(x, w) + b)``,
                      ``bias+leakyrelu<alpha>`` (``bias+leakyrelu0.2``) = ``y = leaky_relu(conv(x, w)
                      + b, alpha)``, either followed by ``+add`` (``bias+leakyrelu0.01+add`` =
                      ``y = leaky_relu(conv(x, w) + b, alpha) + z``, ``z`` the other operand of the
                      residual ``Add`` that reads the activation), the graph the engine
                      configuration belongs to (the executor runs the node's bias and its SiLU /
                      LeakyRelu readers, and that Add, in that one call); or a legacy epilogue
                      (``bias``, ``bias+relu``, ``bias+add``, ``bias+add+relu``): the graph conv ->
                      add(bias) [-> add(z)] [-> ReLU], ``z`` before the ReLU, in place of the conv's
                      bias and the Add and Relu its step absorbs; ``""`` = the bare conv, its
                      epilogue one pass after it (as every model recorded before such graphs were
                      timed). A name the reader does not know reads as an odd fusion (warned, not
                      run fused), so these names change no schema version. (schema 5) With no
                      ``engine``: the legacy epilogue (:mod:`convpass.core.fusion`: ``bias``,
                      ``bias+relu``, ``bias+add``, ``bias+add+relu``) fused into ``algo``'s call,
                      cuDNN's ``cudnnConvolutionBiasActivationForward`` (a ``ConvNoBias`` with
                      ``bias+add[+relu]``: with a zero bias); ``""`` = the conv runs
                      alone and its epilogue as one element-wise pass
  ``dgrad_algo``      (optional, Conv only) backward-data algorithm for training
  ``wgrad_algo``      (optional, Conv only) backward-filter algorithm for training
  ``memory_format``   NCHW / NHWC (NCW / NWC, NCDHW / NDHWC by rank) or ``"auto"``
  ``math_mode``       cuDNN math type: ``default`` (TF32 allowed for fp32), ``tensor_op``, ``fma``
                      (TF32 off), or ``"auto"``
  ``workspace_bytes`` workspace the algorithm needs; -1 = unknown
  ``time_ms``         measured time of the chosen configuration, with its epilogue (schema 5: the
                      conv's step); NaN = not measured
  ``problem_key``     :class:`convpass.core.problem.ProblemKey` string of the decided problem, or ``""``
                      (``|xslice=..`` / ``|yslice=..`` / ``|zslice=..``: timed reading / writing that
                      channel slice / reading its fused residual from that channel slice)
  ``source``          how the decision was taken: ``measure``, ``exhaustive``, ``heuristic``,
                      ``forced`` (on the GPU, by that strategy: from timings of this run or of an
                      earlier one in the tuning cache alike, so a re-run writes the same model),
                      ``cache`` (looked up without that GPU: ``--device-name``, or a cache-only
                      device of ``convpass tune``) or ``auto`` (not decided)

* **Precision** (schema 7; docs/precision.md). A conv's precision is read from its decision, not
  stored twice: ``fp16`` / ``bf16`` when its problem key's data type is float16 / bfloat16 (the
  graph holds the conv in that type, with Casts at its region's boundary), else ``tf32`` or ``fp32``
  by its math mode (``fma`` = fp32). A conv asked to run at ``fp32-strict`` (FMA math, no Winograd
  or FFT algorithm) has, once per node, the attribute ``precision`` = ``"fp32-strict"`` (optional,
  written only then; a reader that ignores it reads the conv as fp32, so the schema stays 7); its
  decision reads as ``fp32-strict`` where it honours the level (math ``fma``, an algorithm decided
  and none of ``algo``, ``dgrad_algo``, ``wgrad_algo`` a transform algorithm:
  :func:`convpass.core.algo.is_transform`), else as ``fp32``. Where ``optimize`` measured errors
  (``--precision``), each conv node also has, once per node (not per table or profile):

  ``precision_error``        the model's error with this conv alone at its recorded precision and
                             every other conv in FP32 (its error contribution; NaN = not measured)
  ``precision_sensitivity``  the same with this conv alone in the reduced type (FP16): what ranked
                             it when the budget loop moved convs up (NaN = not measured)

* Model metadata (``metadata_props``): ``convpass.schema_version``, ``convpass.version``,
  ``convpass.devices`` (JSON list of device fingerprints, one per table), ``convpass.mode``,
  ``convpass.profiles`` (JSON), ``convpass.matmul_allow_tf32`` (``0``/``1``: MindSpore's
  ``matmul_allow_tf32``, for Gemm / MatMul), ``convpass.options`` (JSON of the options used),
  and (schema 7, where errors were measured) ``convpass.precision``: JSON with ``mode``,
  ``metric``, ``max_error``, ``reduced`` (the reduced type), ``evaluator``, ``calibration`` and
  ``holdout`` (each ``{"error": float, "inputs": text}``), ``within_budget``, ``casts``, ``note``.
* ``convpass.fusions`` (optional; versioned on its own, :data:`FUSIONS_VERSION`, so it changes
  nothing of the per-conv schema): the fusion decisions, JSON ``{"version": 1, "units": [...]}``,
  one entry per fusion unit (:mod:`convpass.core.fusion_units`): its ``kind``, its ``nodes`` (names,
  in order: the unit's key) and its ``decisions``, one per (device, profile): ``device`` (a
  fingerprint, ``""`` when none), ``profile`` (index), ``fused`` (true / false, or null when
  nothing was measured), ``source`` (``measured`` or ``not measured``: then the executor applies
  the kind's rule) and ``times_ms`` (what was timed: ``fused_nchw``, ``fused_nhwc``,
  ``unfused_nchw``). Read by :func:`read_fusions`, written by :func:`fusion_entries`.

Schema 6 (still read) is schema 7 without the precision attributes and metadata.
Schema 5 (still read) is schema 6 with every conv named by its standard op, bias or not.
Schema 4 (still read) is schema 5 with ``fusion`` for engines only and times of the bare conv: its
legacy decisions run the conv alone and the epilogue as one pass, as they were timed. Schema 3 is
schema 4 without ``fusion``; schema 2 is schema 3 without ``engine``. Schema 1 (still read): one device, named by ``convpass.device`` (empty when none) with its cuDNN
version in ``convpass.cudnn_version``; one value per profile. It reads as one table.

Reading for a device
--------------------
:func:`read_annotations` with ``device=`` returns that device's table. For a device the model has
no table for it returns the first table and a :class:`ModelInfo` whose ``device`` names the device
that table belongs to, so a caller that compares ``ModelInfo.device`` with its own GPU (the CUDA
executor does) sees the mismatch and runs cuDNN's heuristic with one warning, as it does for any
model tuned elsewhere. ``device=None`` reads the first table.
"""

from __future__ import annotations

import onnx

from convpass.core.annotation_decisions import (
    ANNOTATED_OPS,
    AUTO,
    BIASLESS_SUFFIX,
    CONV_OPS,
    DECISION_ATTRIBUTES,
    DOMAIN,
    LEVEL_ATTRIBUTE,
    PRECISION_ATTRIBUTES,
    SOURCES,
    AnnotationError,
    ConvDecision,
    NodeAnnotation,
    all_nodes,
    annotated_op_type,
    check_direction,
    decision_attributes,
    is_annotated_conv,
    level_attributes,
    precision_attributes,
    read_node,
    standard_op_type,
)
from convpass.core.annotation_functions import (
    DOMAIN_VERSION,
    MAX_IR_VERSION,
    MIN_IR_VERSION,
    STANDARD_ATTRIBUTES,
    conv_function,
    standard_attributes,
    standard_model,
    verify_functions,
)
from convpass.core.annotation_metadata import (
    FUSIONS_KEY,
    FUSIONS_VERSION,
    MAX_DEVICES,
    MAX_META_BYTES,
    MAX_PROFILES,
    MEASURED,
    META_PREFIX,
    NOT_MEASURED,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    FusionDecision,
    FusionRecord,
    ModelInfo,
    Profile,
    fusion_entries,
    metadata_entries,
    read_fusions,
    read_model_info,
)
from convpass.core.device import DeviceFingerprint

__all__ = [
    "ANNOTATED_OPS",
    "AUTO",
    "BIASLESS_SUFFIX",
    "CONV_OPS",
    "DECISION_ATTRIBUTES",
    "DOMAIN",
    "DOMAIN_VERSION",
    "FUSIONS_KEY",
    "FUSIONS_VERSION",
    "MAX_DEVICES",
    "MAX_IR_VERSION",
    "MAX_META_BYTES",
    "MAX_PROFILES",
    "MEASURED",
    "META_PREFIX",
    "MIN_IR_VERSION",
    "NOT_MEASURED",
    "LEVEL_ATTRIBUTE",
    "PRECISION_ATTRIBUTES",
    "READABLE_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "SOURCES",
    "STANDARD_ATTRIBUTES",
    "AnnotationError",
    "ConvDecision",
    "FusionDecision",
    "FusionRecord",
    "ModelInfo",
    "NodeAnnotation",
    "Profile",
    "all_nodes",
    "annotated_op_type",
    "conv_function",
    "decision_attributes",
    "fusion_entries",
    "is_annotated_conv",
    "metadata_entries",
    "level_attributes",
    "precision_attributes",
    "read_annotations",
    "read_fusions",
    "read_model_info",
    "read_node",
    "standard_attributes",
    "standard_model",
    "standard_op_type",
    "verify_functions",
]


def read_annotations(
    model: onnx.ModelProto, device: DeviceFingerprint | str | None = None
) -> tuple[ModelInfo | None, list[NodeAnnotation]]:
    """Model metadata and every annotated conv node (:func:`all_nodes`: those of If / Loop / Scan
    bodies too), in graph order, with the decisions of ``device``'s table (see "Reading for a device" in the module docstring). A model
    whose annotated convs would not run as what they name is refused (:func:`verify_functions`)."""
    info = read_model_info(model)
    annotated = [n for n in all_nodes(model.graph) if is_annotated_conv(n)]
    if annotated and info is None:
        raise AnnotationError(f"model has {DOMAIN} convolutions but no convpass metadata")
    verify_functions(model, annotated)
    if info is None:
        return None, []
    table = (info.table_of(device) if device is not None else None) or 0
    info = info.for_table(table)
    n_profiles = max(1, len(info.profiles))
    nodes = [read_node(n, n_profiles, info.tables, table) for n in annotated]
    for node in nodes:
        check_direction(node)
    return info, nodes

