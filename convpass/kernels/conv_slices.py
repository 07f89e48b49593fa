"""Convolutions that read or write channel slices of shared buffers: where the slice is used in
place, where it is copied, what is counted, and what is said (the execution is
:meth:`convpass.kernels.convolution.Convolutions.run`'s).

Rules:

1. **Writing slices.** A conv whose step writes into a given array (rule 4 of
   :mod:`convpass.core.concat_slices`: no residual; DenseNet's convs, an ESRGAN dense block's
   with their LeakyRelu fused into an engine) writes its output straight into its slice of a
   Concat buffer (:mod:`convpass.runtime.cuda.memory`), channels-first or channels-last: cuDNN's
   legacy forward call gets an output descriptor with the slice's strides (convpass's kernel
   writes any strides), and the epilogue pass runs on the slice in place, in its memory order;
   so does a graph-API engine step, bare or fused, whose decision's problem key names the output
   slice (``yslice``) and whose plan was built writing ``y`` with those strides
   (:attr:`~convpass.kernels.conv_exec.ConvExec.output_slice_strides`), for a slice of exactly
   those strides (:func:`writes_in_place`); counted in ``slice_writes``. An engine's plan refusing
   its slice in place (:class:`~convpass.native.cudnn.graph_api.OutputRefused`: ``y`` not aligned
   as the plan assumes) is a refusal as in rule 3: from then on it writes the first channels of a
   buffer of its strides, copied into the slice, a capture broken where it comes while capturing.
   Where the object writes packed outputs (cuDNN's fused call, an engine's plan built for a
   packed ``y``: cuDNN did not build it for the slice, the tuner timed it with the copy), cuDNN
   refuses the strided output, the slice is in another memory format than the
   conv's (:func:`same_order`) or a 1-D conv's mapping runs, the conv writes a packed output that
   is copied into the slice; every copy of a conv's output into its slice (the reference
   convolution's, a fallback's too) is counted in ``slice_write_copies``. A ConvTranspose (a UNet's
   upsampling) runs backward data into a packed buffer, and its bias and ReLU pass reads that
   buffer and writes the slice (a slice write); without that pass, a copy.
2. **Reading slices.** A forward conv run by cuDNN's legacy API, plain or fused call, whose input
   is a channel slice of a Concat buffer stored in the conv's memory format (channels-last:
   channel stride 1; channels-first: samples the buffer's channels apart;
   :func:`~convpass.native.cudnn.arrays.channel_slice`) reads it in place through an input
   descriptor with the slice's strides, counted in ``slice_reads``; so does a graph-API engine
   step, bare or fused, whose decision's problem key names the input slice (``xslice``) and whose
   plan was built reading ``x`` with those strides
   (:attr:`~convpass.kernels.conv_exec.ConvExec.input_slice_strides`), for a slice of exactly
   those strides (:func:`reads_in_place`, by its strides alone: a one-sample channels-first slice
   looks packed to :func:`~convpass.native.cudnn.arrays.channel_slice`). Any other input not as the object reads it is copied
   first (counted in ``layout_copies``): into a packed buffer in the conv's format, or for a plan
   built for the key's slice into the first channels of a buffer of those strides
   (:func:`slice_copy`); a slice too where convpass's kernel, an engine's plan built for a packed
   ``x`` (cuDNN did not build it for the slice: the tuner timed it with the copy), a 1-D conv's
   mapping or a padded input reads it; a slice so copied is counted in ``slice_copies`` too. An
   engine's plan refusing its slice in place (:class:`~convpass.native.cudnn.graph_api.InputRefused`:
   ``x`` not aligned as the plan assumes) is a refusal as in rule 3: copied from then on, a
   capture broken where it comes while capturing.
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
   a wider buffer), or a packed input into the strides its plan reads (an engine's plan built for
   its key's slice given a packed ``x``), makes a copy on every run that its tuning never priced: one warning per model
   and side (input, output) names the first such node, the backend's notes every one
   (:func:`unpriced_copy`, :func:`said_if_unpriced`). An output slice in another memory format
   than the conv's is a transpose the layout plan charges, and a 1-D conv's mapped output is
   copied as a Concat would copy an unplaced input: counted, not said.
5. **Residual slices.** A fused step that adds a residual ``z`` after its activation (a graph-API
   fusion's ``+add``) whose ``z`` is a channel slice (CSPDarknet's first block of a stage adds the
   second half of its stage's Split) reads it in place where its decision's problem key names
   that slice (``zslice``) and its object reads those strides (a graph-API plan built for the
   slice: :attr:`~convpass.kernels.conv_exec.ConvExec.residual_strides`); counted in
   ``residual_slice_reads``. Any other ``z`` not as the object reads it is copied first (packed in
   the conv's memory format; for a plan built for a slice, into a buffer of those strides),
   counted in ``residual_copies`` and noted once per node at debug level where the decision's
   tuning did not time that copy: the tuner times a key's residual slice read in place, or copied
   for an object that reads a packed ``z`` (cuDNN's legacy fused call). A launch refused for the
   slice in place alone (:class:`~convpass.native.cudnn.graph_api.ResidualRefused`: ``z`` the one
   tensor not aligned as the plan assumes, or not of its strides) copies from then on
   (:func:`remember_residual_refusal`), said once at debug level; while a CUDA graph is captured,
   the capture breaks there. That copy keeps the slice's strides, so it helps where the refusal
   was the alignment of ``z``'s start; where cuDNN refuses the strides themselves (the plan's
   execution failing), or the launch was refused for another tensor, the step falls back
   (warned) as any refused engine step does.
"""

from __future__ import annotations

import logging
from typing import Any

from convpass.native.cuda import CaptureBreak, elements, first_line

logger = logging.getLogger("convpass")

__all__ = ["copy_why", "priced", "reads_in_place", "writes_in_place", "remember_refusal", "remember_residual_refusal", "residual_copied", "residual_in_place",
           "said_if_unpriced", "same_order", "slice_copy", "slice_words", "unpriced_copy"]


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


def residual_in_place(ex: Any, conv: Any, z: Any) -> bool:
    """Rule 5: whether the step's object ``conv`` of the resolution ``ex`` reads the residual ``z``
    itself: a channel slice of the strides it reads, not refused before."""
    want = conv.residual_strides
    return want is not None and ex.strided_residual_ok and priced(want, z)


def reads_in_place(conv: Any, x: Any) -> bool:
    """Rule 2: whether the step's object ``conv`` reads the channel slice ``x`` itself: any such
    slice where it reads slices (cuDNN's legacy calls), one of exactly its strides where it names
    them (an engine's plan built for the key's input slice)."""
    return conv.input_strides == "slice" or priced(conv.input_slice_strides, x)


def writes_in_place(conv: Any, out: Any) -> bool:
    """Rule 1: whether the step's object ``conv`` (an engine's plan built for the key's output
    slice) writes the channel slice ``out`` itself: one of exactly its strides."""
    return priced(conv.output_slice_strides, out)


def copy_why(ex: Any, conv: Any) -> str:
    """Rule 4: why the step's object ``conv`` of the resolution ``ex`` copies its input slice."""
    if conv.input_slice_strides is not None:
        return f"the plan of {ex.algo!r} reads only slices of its key's strides"
    if conv.input_strides != "slice":
        return f"its algorithm {ex.algo!r} reads packed inputs only"
    return f"cuDNN refuses to read it with algorithm {ex.algo!r}"


def slice_copy(a: Any, channels: int, layout: str) -> Any:
    """Rules 2 and 5: ``a`` copied into the first channels of a new buffer of ``channels`` channels
    in ``layout``: the strides a plan built for a slice of such a buffer reads (the key's input or
    residual slice), at an aligned start (for an ``a`` of other strides, or a slice the plan
    refused in place)."""
    from convpass.native import cudnn
    from convpass.native.cuda import copy_into

    out = cudnn.empty_like_layout((a.shape[0], channels, *a.shape[2:]), a.dtype, layout)[:, :a.shape[1]]
    copy_into(out, a)
    return out


def residual_copied(rt: Any, ex: Any, conv: Any, z: Any) -> None:
    """Rule 5: the residual ``z`` of the resolution ``ex`` was copied for the step's object ``conv``:
    counted, and noted once per node where the decision's tuning did not time that copy."""
    rt.counters["residual_copies"] += 1
    if conv.residual_strides is None and ex.source == "recorded" and priced(ex.key.z_strides, z):
        return  # timed: the key names z's slice, and its object reads a packed z
    form = "a channel slice of its plan's strides" if conv.residual_strides is not None else f"packed in the conv's memory format ({ex.layout})"
    rt.note_once(f"residual-copy:{ex.node}", f"node {ex.node!r}: its residual input is not {form}: it is copied on every run", warn=False)


def remember_residual_refusal(rt: Any, ex: Any, e: Exception) -> None:
    """Rule 5: the resolution ``ex`` copies its residual slice from now on (the caller runs the
    launch again so); while ``rt`` captures a CUDA graph, :class:`~convpass.native.cuda.CaptureBreak`."""
    if rt.capturing:
        raise CaptureBreak(f"node {ex.node!r}: its residual was refused as a channel slice during capture: {first_line(e)}")
    ex.strided_residual_ok = False
    logger.debug("node %r: %r refuses to read its residual from a channel slice (%s): copy + launch", ex.node, ex.algo, first_line(e))


def said_if_unpriced(rt: Any, ex: Any, conv: Any, out: Any) -> None:
    """Rule 4 for a forward conv's packed output about to be copied into its Concat slice ``out``:
    said where no tuning timed that copy. ``conv``: the step's execution object (one that writes
    slices was refused them)."""
    if ex.source != "recorded" or ex.insert_axis is not None or not same_order(out, ex.layout) or priced(ex.key.y_strides, out):
        return
    if conv.output_slice_strides is not None:
        why = f"the plan of {ex.algo!r} writes only slices of its key's strides"
    elif conv.output_strides == "packed":
        why = f"its algorithm {ex.algo!r} writes packed outputs only"
    else:
        why = f"cuDNN refuses to write it with algorithm {ex.algo!r}"
    unpriced_copy(rt, ex, why, "output")


def unpriced_copy(rt: Any, ex: Any, why: str, which: str = "input", packed: bool = False) -> None:
    """Rule 4: a recorded decision's conv copies the channel slice it reads or writes (``which``;
    ``why``: cuDNN refuses the slice, the object takes packed tensors only, another format) while
    its tuning timed another tensor. Warned once per model and side (the first such node), every
    node kept in ``rt``'s notes. ``packed``: the tensor is packed while the object reads a slice's
    strides only (an engine's plan built for its key's input slice): copied into a wider buffer."""
    what = "packed while" if packed else "a channel slice that"
    message = f"node {ex.node!r}: its {which} is {what} {why}: it is copied on every run, a copy its tuning did not time"
    tag = "unpriced-copy" if which == "input" else "unpriced-write-copy"
    rt.note_once(f"{tag}:{ex.node}", message, warn=False)
    rt.note_once(tag, message + " (other convs so copied are in the executor's notes)")
