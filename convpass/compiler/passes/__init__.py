"""convpass graph passes (installed as ``convpass.compiler.passes``), one pass per module."""
