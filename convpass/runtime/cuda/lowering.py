"""Lowering: which kernel runs every step of a plan on the GPU.

:func:`compile_plan` turns a :class:`~convpass.kernels.plan.Plan` into a
:class:`~convpass.runtime.cuda.runner.CompiledPlan`: one :class:`~convpass.kernels.launch.Launch` per step that runs, in this order of
preference (a step claimed by an earlier family is not offered to a later one):

1. convolutions with their fused epilogues (:mod:`convpass.kernels.convolution`), then MatMul / Gemm with their
   bias, residual and ReLU as cuBLASLt epilogues (:mod:`convpass.kernels.matmul`);
2. kernel families, when ``kernels`` is on: fused normalization units (:mod:`convpass.kernels.group_norm`),
   normalizations and softmax (:mod:`convpass.kernels.normalization`),
   window pooling (:mod:`convpass.kernels.pooling`), Resize (:mod:`convpass.kernels.tensor_ops`);
3. fused element-wise groups, when ``fuse`` is on (:mod:`convpass.kernels.elementwise`; BatchNormalization in
   inference mode joins them);
4. every other step: the op library over CuPy (:class:`OpLaunch`; element-wise ops on the
   channels-last storage of channels-last inputs, so their outputs keep that format);
5. then the memory plan (:mod:`convpass.runtime.cuda.memory`): Concats share buffers and producers write into them;
6. once every launch is prepared, one layout conversion for the convs that read one tensor in a format it is not
   stored in (:mod:`convpass.runtime.cuda.shared_layouts`), instead of a copy inside each conv's launch.

Every launch is prepared here — kernels compiled, conv algorithms resolved, weights converted,
tables uploaded, workspaces sized — so that running the plan needs none of that and can be
captured. A kernel that does not build leaves its steps to the op library, with a warning.
"""

from __future__ import annotations

from typing import Any

from convpass.core.profiles import shape_spec
from convpass.kernels import broadcast, elementwise, elementwise_launch, group_norm, matmul, normalization, pooling, tensor_ops
from convpass.kernels.convolution import REFERENCE, ConvLaunch, lower_convs, summarize
from convpass.kernels.launch import Launch
from convpass.kernels.plan import store_outputs
from convpass.native import cublas as blas
from convpass.native import nvrtc as compiler
from convpass.native.cuda import ELEMENTWISE, first_line
from convpass.ops.registry import OpContext
from convpass.runtime.cuda import memory, shared_layouts
from convpass.runtime.cuda.runner import CompiledPlan

__all__ = ["OpLaunch", "compile_plan"]


class OpLaunch(Launch):
    """A step run by the op library over CuPy (``storage_order``: on the channels-last storage of
    channels-last inputs, for element-wise ops)."""

    def __init__(self, plan: Any, index: int, ctx: OpContext, storage_order: bool) -> None:
        step = plan.steps[index]
        super().__init__(index, step.node, step.node.op_type, step.outputs)
        self.ctx = ctx
        self.fn = step.fn
        self.inputs = step.inputs
        self.storage_order = storage_order

    def run(self, env: list[Any]) -> None:
        args = [env[s] if s >= 0 else None for s in self.inputs]
        node, ctx, fn = self.node, self.ctx, self.fn
        if self.storage_order:
            outs = elementwise_launch.in_storage_order(args, lambda *a: fn(ctx, node, *a), node.impl.value_inputs)
        else:
            outs = fn(ctx, node, *args)
        store_outputs(env, self.outputs, outs)


def _kernel_launch(rt: Any, plan: Any, i: int, host: Any, ctx: OpContext) -> Any:
    """The hand-written kernel family's launch for step ``i``, or None."""
    cp = rt.cp
    try:
        launch = group_norm.lower_fused_norm(plan, i, cp, ctx)
    except Exception as e:  # noqa: BLE001  (a compiler or driver error: the op library's fused step runs it)
        rt.note_once("kernel-fused-norm", f"fused normalization kernel did not build ({first_line(e)}): the op library runs the fused steps")
        launch = None
    if launch is not None:
        return launch
    for lower in (
        lambda: normalization.lower_norm(plan, i, cp),
        lambda: normalization.lower_softmax(plan, i, cp),
        lambda: pooling.lower_pool(plan, i, cp, rt.pooling),
        lambda: pooling.lower_global_pool(plan, i, cp, host),
        lambda: tensor_ops.lower_resize(plan, i, cp, host, rt.upload_constant),
    ):
        launch = lower()
        if launch is not None:
            return launch
    return None


def _sources(launch: Launch) -> list[compiler.KernelSource]:
    """The kernel sources a hand-written launch needs, so they are compiled at plan time."""
    dtype = launch.dtype
    if isinstance(launch, group_norm.FusedNormLaunch):
        return launch.sources()
    if isinstance(launch, normalization.NormLaunch):
        return [] if launch.use_cudnn else [normalization.source(dtype)]
    if isinstance(launch, pooling.PoolLaunch):
        return [] if launch.use_cudnn else [pooling.source(dtype)]
    if isinstance(launch, pooling.GlobalPoolLaunch):
        return [pooling.global_source(dtype)]
    if isinstance(launch, tensor_ops.ResizeLaunch):
        return launch.sources()
    return []


def _fused_launch(rt: Any, plan: Any, group: Any) -> Any:
    """The group's launch with its kernels built now (not inside a capture), or None (with a note)
    when they do not build: its ops then run one by one."""
    what = "+".join(group.ops)
    try:
        kernel = broadcast.BroadcastKernel(rt.cp, group, broadcast.broadcast_classes(plan, group))
    except Exception as e:  # noqa: BLE001  (a compiler or driver error: CuPy's kernel, below)
        rt.note_once("fusion-broadcast", f"broadcasting element-wise kernel for {what} did not build ({first_line(e)}): CuPy's kernel runs it")
        kernel = None
    fallback = None
    if kernel is None or broadcast.needs_fallback(plan, group):
        try:
            fallback = elementwise.kernel(rt.cp, group)
            fallback(*[rt.cp.zeros((1,), dtype=group.dtype) for _ in group.inputs])  # compiles now, or loads CuPy's cache
        except Exception as e:  # noqa: BLE001
            rt.note_once("fusion", f"fused element-wise kernel for {what} did not build ({first_line(e)}): those ops run one by one")
            fallback = None
    if kernel is None and fallback is None:
        return None
    return elementwise_launch.FusedLaunch(plan, group, kernel, fallback, rt.counters)


def compile_plan(rt: Any, plan: Any) -> CompiledPlan:
    """Lower and prepare every step of ``plan`` (module docstring)."""
    blas.reap()  # cuBLAS handles of collected backends: destroyed here, never inside a capture
    steps = plan.steps
    n = len(steps)
    launches: list[Launch | None] = [None] * n
    owner: dict[int, Launch] = {}  # step -> the launch that computes its outputs
    claimed: list[Any] = [None] * n
    host = rt.to_host
    ctx = OpContext(rt)

    def take(launch: Launch) -> None:
        launches[launch.step] = launch
        for k in (launch.step, *launch.absorbs):
            owner[k] = launch
            claimed[k] = launch

    # 1. convolutions
    for launch in lower_convs(plan, rt.convs, rt.fuse, rt.fuse_residual).values():
        take(launch)
    if rt.matmul_epilogues:
        for i in range(n):
            launch = matmul.lower_matmul(plan, i, claimed, rt) if claimed[i] is None else None
            if launch is not None:
                take(launch)
    # 2. kernel families
    if rt.kernels:
        for i in range(n):
            if claimed[i] is not None:
                continue
            launch = _kernel_launch(rt, plan, i, host, ctx)
            if launch is None:
                continue
            try:
                for src in _sources(launch):
                    compiler.module(rt.cp, src)
            except Exception as e:  # noqa: BLE001  (a compiler or driver error: the op library runs it)
                rt.note_once(f"kernel-{launch.label}", f"{launch.label} did not build ({first_line(e)}): {steps[i].node.op_type} runs on the op library")
                continue
            take(launch)
    # 3. fused element-wise groups
    if rt.fuse:
        for group in elementwise.plan_groups(plan, claimed, host, rt.upload_constant):
            launch = _fused_launch(rt, plan, group)
            if launch is not None:
                take(launch)
    # 4. the op library
    for i, st in enumerate(steps):
        if claimed[i] is None:
            node = st.node
            storage_order = node.domain == "" and (node.op_type in ELEMENTWISE or (node.op_type == "PRelu" and node.opset >= 7))
            take(OpLaunch(plan, i, ctx, storage_order))
    # 5. the memory plan
    if rt.concat_in_place:
        for i, launch in memory.plan_concats(plan, owner, rt.concat_allocator, host).items():
            launches[i] = owner[i] = launch
    # liveness: a fused group's members read their inputs at the root, so they are freed there
    free = [tuple(st.free) for st in steps]
    for launch in launches:
        if isinstance(launch, elementwise_launch.FusedLaunch):
            moved = [s for k in launch.absorbs for s in free[k]]
            for k in launch.absorbs:
                free[k] = ()
            free[launch.step] = tuple(free[launch.step]) + tuple(moved)
    for launch in launches:
        if launch is not None:
            launch.prepare()
    # 6. one layout conversion per tensor several convs read in another format
    launches, free = shared_layouts.share_conversions(plan, launches, free, rt.counters)
    _conv_notes(rt, plan, launches)
    blockers = [s.node for s in steps if s.node.impl is not None and s.node.impl.data_dependent_shape]
    capturable = rt.cuda_graph and not blockers
    note = ""
    if rt.cuda_graph and blockers:
        note = f"node {blockers[0].name!r} ({blockers[0].op_type}) has a data-dependent output shape: plan runs eagerly"
    state = CompiledPlan(launches=launches, free=free, capturable=capturable, mode="graph" if capturable else "eager",
                         note=note or ("" if rt.cuda_graph else "cuda_graph=False"), break_node=blockers[0].name if note else "")
    if note:
        rt.warn_capture(note)
    return state


def _conv_notes(rt: Any, plan: Any, launches: list[Launch | None]) -> None:
    """Conv summaries as they really run; one note each for untuned, reference and other-GPU convs, and
    for tuned convs of a plan whose input shapes match none of the model's shape profiles."""
    summaries = {s.node: i for i, s in enumerate(plan.convs)}
    untuned, unmatched, reference = [], [], []
    for launch in launches:
        if not isinstance(launch, ConvLaunch) or launch.exec is None:
            continue
        ex = launch.exec
        name = launch.call.node_name
        if ex is REFERENCE:
            reference.append(name)
        elif ex.source == "untuned":
            # a conv the model records decisions for, in a plan of no profile: tuned for other shapes
            (unmatched if plan.profile is None and launch.call.decision is not None else untuned).append(name)
        i = summaries.get(name)
        if i is not None:
            plan.convs[i] = summarize(plan.convs[i], ex)

    def listing(names: list[str]) -> str:
        return ", ".join(repr(x) for x in names[:5]) + (f", ... (+{len(names) - 5} more)" if len(names) > 5 else "")

    if untuned:
        rt.note_once(
            "untuned",
            f"{len(untuned)} convolution(s) untuned: using cuDNN's heuristic (NCHW) for {listing(untuned)}; "
            "tune the model with `convpass optimize` to run measured choices",
        )
    if unmatched:
        _note_unmatched(rt, plan, f"{len(unmatched)} convolution(s) run cuDNN's heuristic (NCHW) for {listing(unmatched)}")
    if reference:
        rt.note_once("reference", f"{len(reference)} convolution(s) cuDNN cannot express run as CuPy reference kernels: {listing(reference)}", warn=False)
    mismatch = rt.convs.mismatch_nodes
    if mismatch:
        rt.note_once(
            "device",
            f"the model was tuned on {rt.recorded_device!r}, this GPU is {str(rt.current_device)!r}: "
            f"the recorded cuDNN choices are not used; {len(mismatch)} convolution(s) run cuDNN's heuristic choice "
            f"(NCHW, recorded math mode): {listing(mismatch)}; re-tune on this GPU with `convpass optimize`",
        )


def _note_unmatched(rt: Any, plan: Any, what: str) -> None:
    """Said once per input shape: the model was tuned for other shapes, and how to add this one."""
    profiles = getattr(rt, "profiles", ())
    names = [n for p in profiles for n in p.inputs if n in plan.feed_slots] or list(plan.feed_slots)
    shape = shape_spec({n: plan.value_info[plan.feed_slots[n]][0] for n in dict.fromkeys(names) if plan.feed_slots[n] in plan.value_info})
    tuned = ", ".join(shape_spec(p.inputs) for p in profiles[:4]) + (f" and {len(profiles) - 4} more" if len(profiles) > 4 else "")
    rt.note_once(
        f"profile:{shape}",
        f"{what}: the model was tuned for shape profiles {tuned} and this run's shape {shape} matches none; "
        f"add it by tuning again (`convpass optimize --retune {' '.join('--shape ' + shape_spec(p.inputs) for p in profiles)} "
        f"--shape {shape}`, or the Python API's shapes=)",
    )
