"""Precision per convolution within an error budget (docs/precision.md): the input sets and metrics
(``data``), the evaluators (``evaluate``), the budget loop (``budget``), the costs and the planner
(``choose``), the flow ``optimize --precision`` runs (``flow``) and the float64 truth of a model
(``float64``), what the float32 reference is measured against."""
