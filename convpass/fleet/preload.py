"""The first module a model process imports (:data:`convpass.fleet.model_procs.PRELOAD`; a
forkserver imports the list once for all): it prepares the import of onnx-ir that the modules
after it make (:func:`convpass.core.deferred_imports.defer_sympy`), as the CLI does at its start.
Importing it is the point: nothing else imports it."""

from convpass.core.deferred_imports import defer_sympy

defer_sympy()
