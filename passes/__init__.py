"""convpass graph passes (installed as ``convpass.passes``), one pass per module."""
