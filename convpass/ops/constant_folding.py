"""Constant folding: the nodes whose inputs are all constants, evaluated once on the host.

The one implementation that both the compiler and the executor run. The compiler folds, at
``optimize``, the subgraph that computes a conv's weight or bias from initializers
(:mod:`convpass.compiler.passes.fold_conv_weights`); the executor folds every constant subgraph
when it loads a model. The same nodes thus give the same bits, whichever of the two folds them.

Rules:

1. A node folds when every input it reads is a constant: an initializer, or an output of a node
   folded before it. Nodes are visited in the order given (a topological one), so a chain folds
   in one sweep; a node with no inputs (Constant) always folds.
2. Each node runs its op library implementation (:mod:`convpass.ops.registry`) on the host
   backend the caller gives, in the node's own element types, as ONNX Runtime computes it at run
   time: float32 arithmetic stays float32; float16 sums and means accumulate in float32 as there.
3. A node's failure is an :class:`~convpass.core.errors.ExecutorError` naming the node.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import numpy as np

from convpass.ops.registry import NodeInfo, OpContext, call_node

__all__ = ["fold_constants"]


def fold_constants(nodes: Sequence[NodeInfo], constants: MutableMapping[str, np.ndarray], host: OpContext) -> list[NodeInfo]:
    """Evaluate, in order, each node of ``nodes`` whose inputs are all in ``constants`` (rule 1),
    on the ``host`` context (rule 2), adding its outputs there; returns the nodes left, in order."""
    left = []
    for node in nodes:
        if not all((not name) or name in constants for name in node.inputs):
            left.append(node)
            continue
        outs = call_node(host, node, [constants[name] if name else None for name in node.inputs], host=True)
        for name, value in zip(node.outputs, outs):
            if name:
                constants[name] = np.asarray(value)
    return left
