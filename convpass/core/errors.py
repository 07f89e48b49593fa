"""Exceptions convpass raises for bad input; the CLI prints them as one line and exits 1."""


class ConvpassError(Exception):
    """A problem with the user's input or options that convpass can describe in one line."""


class ModelLoadError(ConvpassError):
    """The file is not a usable ONNX model (not ONNX, truncated, empty, unsupported opset...)."""


class ShapeError(ConvpassError):
    """A convolution's shapes cannot be resolved, or a --shape profile does not fit the model."""


class ConvAttributeError(ConvpassError):
    """A Conv / ConvTranspose whose attributes are invalid or inconsistent with its shapes."""


class OptionError(ConvpassError):
    """An option value convpass does not understand."""


class UnsupportedConvError(ConvAttributeError):
    """A valid convolution that convpass cannot express as a cuDNN problem; it is left untuned."""


class ExecutorError(ConvpassError, RuntimeError):
    """A model the executor cannot run, or a run request it cannot serve (bad feeds, ...).

    The message names what is wrong and, where it can, what would be right.
    """


class FileError(ConvpassError):
    """A file convpass refuses to read or write (special, too large, the command's own input), or
    cannot (missing, unreadable, the disk full)."""
