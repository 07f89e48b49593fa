"""Convolutions that read or write channel slices of shared buffers: where the slice is used in
place, where it is copied, what is counted, and what is said (the execution is
:meth:`convpass.kernels.convolution.Convolutions.run`'s).

Rules:

1. **Writing slices.** A conv whose step writes into a given array (rule 4 of
   :mod:`convpass.core.concat_slices`: no residual, no epilogue fused into a graph-API engine;
   DenseNet's convs) writes its output straight into its slice of a Concat buffer
   (:mod:`convpass.runtime.cuda.memory`), channels-first or channels-last: cuDNN's legacy forward
   call gets an output descriptor with the slice's strides (convpass's kernel writes any
   strides), and the epilogue pass runs on the slice in place, in its memory order; counted in
   ``slice_writes``. Where the object writes packed outputs (cuDNN's fused call, an engine's
   plan), cuDNN refuses the strided output, the slice is in another memory format than the
   conv's (:func:`same_order`) or a 1-D conv's mapping runs, the conv writes a packed output that
   is copied into the slice; every copy of a conv's output into its slice (the reference
   convolution's, a fallback's too) is counted in ``slice_write_copies``. A ConvTranspose (a UNet's
   upsampling) runs backward data into a packed buffer, and its bias and ReLU pass reads that
   buffer and writes the slice (a slice write); without that pass, a copy.
2. **Reading slices.** A forward conv run by cuDNN's legacy API, plain or fused call, whose input
   is a channel slice of a Concat buffer stored in the conv's memory format (channels-last:
   channel stride 1; channels-first: samples the buffer's channels apart;
   :func:`~convpass.native.cudnn.arrays.channel_slice`) reads it in place through an input
   descriptor with the slice's strides, counted in ``slice_reads``. Any other input not packed in
   the conv's format is copied first (counted in ``layout_copies``), a slice too where a graph-API
   engine (its plan is built for packed tensors), convpass's kernel, a 1-D conv's mapping or a
   padded input reads it; a slice so copied is counted in ``slice_copies`` too.
3. **Refused slices.** cuDNN refuses a strided tensor with ``CUDNN_STATUS_NOT_SUPPORTED`` or
   ``BAD_PARAM`` (a strided output with any error:
   :func:`~convpass.kernels.conv_exec.refuses_slice`); a strided call that needs more workspace
   than the decision's is refused the same way before cuDNN is called. The warm-up run before
   capture meets every refusal: a launch that read and wrote slices tries each alone to learn
   which cuDNN refuses (the input packed first, then the output packed); what it refuses runs
   packed for that conv from then on, with a copy, said once at debug level
   (:func:`remember_refusal`). A refusal while a CUDA graph is captured breaks the capture there
   (:class:`~convpass.native.cuda.CaptureBreak`), never silently.
4. **Copies no tuning timed.** The tuner times the slices a decision's problem key names
   (``xslice``, ``yslice``: read or written in place, or with the copy the executor then makes).
   A recorded decision whose conv copies a slice of other strides than its key's (a packed key,
   a wider buffer) makes a copy on every run that its tuning never priced: one warning per model
   and side (input, output) names the first such node, the backend's notes every one
   (:func:`unpriced_copy`, :func:`said_if_unpriced`). An output slice in another memory format
   than the conv's is a transpose the layout plan charges, and a 1-D conv's mapped output is
   copied as a Concat would copy an unplaced input: counted, not said.
"""

from __future__ import annotations

import logging
from typing import Any

from convpass.native.cuda import elements, first_line

logger = logging.getLogger("convpass")

__all__ = ["priced", "remember_refusal", "said_if_unpriced", "same_order", "slice_words", "unpriced_copy"]


def priced(want: tuple[int, ...] | None, a: Any) -> bool:
    """Whether a decision was timed with a slice of ``a``'s strides (``want``: its key's
    ``x_strides`` or ``y_strides``): then a copy of it, where the decision needs one, was timed too."""
    return want is not None and all(s == w for w, s, d in zip(want, elements(a.strides, a.itemsize), a.shape) if d > 1)


def same_order(a: Any, layout: str) -> bool:
    """Whether a slice of a Concat buffer is stored in ``layout``'s order (channels-first: the
    channel stride above the spatial ones; channels-last: channels adjacent)."""
    st = elements(a.strides, a.itemsize)
    if layout == "nhwc":
        return st[1] == 1
    return all(st[1] >= st[k] for k in range(2, a.ndim))


def slice_words(read: bool, write: bool) -> str:
    return " and ".join(part for part, on in (("read from a Concat slice", read), ("write into a Concat slice", write)) if on)


def remember_refusal(ex: Any, e: Exception, read: bool, write: bool) -> None:
    """Rule 3: the resolution ``ex`` reads (``read``) or writes (``write``) packed from now on."""
    if read:
        ex.strided_input_ok = False
    if write:
        ex.strided_output_ok = False
    how = " and ".join(part for part, on in (("packed input", read), ("packed output", write)) if on)
    logger.debug("node %r: cuDNN %r refuses to %s (%s): %s + copy", ex.node, ex.algo, slice_words(read, write), first_line(e), how)


def said_if_unpriced(rt: Any, ex: Any, conv: Any, out: Any) -> None:
    """Rule 4 for a forward conv's packed output about to be copied into its Concat slice ``out``:
    said where no tuning timed that copy. ``conv``: the step's execution object (one that writes
    slices was refused them)."""
    if ex.source != "recorded" or ex.insert_axis is not None or not same_order(out, ex.layout) or priced(ex.key.y_strides, out):
        return
    if conv.output_strides == "packed":
        why = f"its algorithm {ex.algo!r} writes packed outputs only"
    else:
        why = f"cuDNN refuses to write it with algorithm {ex.algo!r}"
    unpriced_copy(rt, ex, why, "output")


def unpriced_copy(rt: Any, ex: Any, why: str, which: str = "input") -> None:
    """Rule 4: a recorded decision's conv copies the channel slice it reads or writes (``which``;
    ``why``: cuDNN refuses the slice, the object takes packed tensors only, another format) while
    its tuning timed another tensor. Warned once per model and side (the first such node), every
    node kept in ``rt``'s notes."""
    message = f"node {ex.node!r}: its {which} is a channel slice that {why}: it is copied on every run, a copy its tuning did not time"
    tag = "unpriced-copy" if which == "input" else "unpriced-write-copy"
    rt.note_once(f"{tag}:{ex.node}", message, warn=False)
    rt.note_once(tag, message + " (other convs so copied are in the executor's notes)")
