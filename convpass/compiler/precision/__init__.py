"""Precision per convolution within an error budget (docs/precision.md): the input sets and metrics
(``data``), the evaluators (``evaluate``), the budget loop (``budget``), the costs and the planner
(``choose``) and the flow ``optimize --precision`` runs (``flow``)."""
