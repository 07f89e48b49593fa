"""Resolve every convolution's input and weight shapes, per shape profile.

Rules:

* A profile gives concrete shapes to the model's inputs. Each ``--shape`` option is one profile:
  ``NAME=DIMS[,NAME=DIMS...]`` with DIMS like ``1x3x224x224``; inputs it does not name keep the
  shape the model declares. With no ``--shape`` there is one profile, the model's own shapes.
  The profile records only concrete input shapes (the executor matches feeds against them): an
  input it leaves symbolic constrains nothing, and works as long as no conv depends on it.
* A profile must fit the model: known input names, the declared rank, and fixed dims unchanged.
* Shapes are propagated with ONNX shape inference with data propagation (so Shape / Gather /
  Concat chains feeding Reshape resolve), and everything it gives is kept. Large initializers are
  handed to inference as typed graph inputs, so models past the 2 GB protobuf limit resolve too.
* A tensor a conv needs (its input; its weight if not constant) that inference leaves with an
  unknown or symbolic dim is resolved by running the graph on the CPU on inputs of the profile's
  shapes: only the nodes its shape depends on, in rounds, each followed by inference with the
  shapes seen pinned (the rules are in :mod:`convpass.compiler.passes.cpu_shapes`). :attr:`notes` names,
  per profile, the conv inputs that needed it; a conv whose shape depends on input values (data-
  dependent ops upstream) is tuned for the shape seen on the run's random inputs, and its note
  says so. A failing run raises ShapeError naming the profile and the node.
* Convs inside If / Loop / Scan bodies count as well: shapes reach the bodies as
  :mod:`convpass.compiler.passes.subgraph_shapes` says (no CPU run there). A body's conv whose
  shape stays unknown is marked ``convpass.skip`` with the reason, naming the node whose body it is
  in, and a warning; a main-graph conv's raises ShapeError (below).
* Every conv must end with a fully known input shape for every profile. The run needs concrete
  dims for the graph inputs it reads; when the profile has none for one, ShapeError names the
  node, the tensor and the missing dimension and says which ``--shape`` fixes it.
* Results: ``node.meta["convpass.shapes"]`` = per profile ``(x_shape, w_shape, dtype)``,
  ``model.meta["convpass.profiles"]`` = the profiles and ``model.meta["convpass.value_shapes"]`` =
  per profile every value shape inference gave, with the CPU run's shapes carried through (the
  layout planner prices transposes with them) and ``model.meta["convpass.value_types"]`` every
  value's element type (the precision planner reads them). Convs with data types convpass does not tune
  (anything but float32 / float16 / bfloat16) are marked ``convpass.skip`` with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import onnx
import onnx_ir as ir

from convpass.compiler.passes import state
from convpass.compiler.passes.cpu_shapes import CpuShapes, resolve_on_cpu
from convpass.compiler.passes.state import CONV_OPS, PROFILES_KEY, SHAPES_KEY, SKIP_KEY, VALUE_SHAPES_KEY, VALUE_TYPES_KEY
from convpass.compiler.passes.subgraph_shapes import BodyShapes, set_dims
from convpass.core.annotation import Profile
from convpass.core.errors import ShapeError
from convpass.core.options import CLI, OptionNames, parse_profiles

logger = logging.getLogger("convpass")

__all__ = ["CONV_OPS", "MODEL_SHAPES", "PROFILES_KEY", "SHAPES_KEY", "SKIP_KEY", "VALUE_SHAPES_KEY", "VALUE_TYPES_KEY", "ResolveShapesPass"]

MODEL_SHAPES = "model shapes"  # the name of the profile of the model's own shapes (no --shape)

_DTYPES = {ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}
_INLINE_LIMIT = 1 << 20  # initializers larger than this go to shape inference as typed inputs


def _dims(shape: ir.Shape | None) -> tuple[int | str | None, ...] | None:
    if shape is None:
        return None
    return tuple(d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None) for d in shape)


def _format_dims(dims: Sequence[int | str | None]) -> str:
    return "x".join("?" if d is None else str(d) for d in dims)


def _name_list(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(map(repr, names[:limit]))
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _notes(run: CpuShapes, convs: Mapping[ir.Node, str]) -> list[str]:
    """The report lines for one profile's CPU run: the tensors that needed it, then one line per conv
    whose shape depends on input values."""
    lines = [
        f"profile {run.profile!r}: ONNX shape inference left {len(run.resolved)} conv input(s) unknown "
        f"({_name_list(list(run.resolved))}); resolved by running {run.nodes_run} node(s) on the CPU "
        f"(convpass executor, {run.rounds} round(s), {run.seconds:.2f} s) on random inputs of the profile's shapes"
    ]
    for node in convs:
        for v in node.inputs[:2]:
            why = run.value_dependent.get(v.name) if v is not None else None
            if why is not None:
                label = node.name or node.outputs[0].name
                lines.append(
                    f"{node.op_type} {label!r} (profile {run.profile!r}): the shape of its input {v.name!r} depends on "
                    f"input values ({why}): tuned for the shape seen on random inputs, {_format_dims(run.resolved[v.name])}"
                )
    return lines


class _ShapeInference:
    """ONNX shape inference with data propagation, per profile, with tensors' shapes optionally pinned
    (by the CPU run). The model is serialized once; each call sets the input dims and the pins."""

    def __init__(self, model: ir.Model) -> None:
        proto = ir.serde.serialize_model(model)
        graph = proto.graph
        # Large initializers become typed inputs: inference needs their shapes, not their bytes.
        keep = []
        for tensor in graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.raw_data) > _INLINE_LIMIT:
                graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
            else:
                keep.append(tensor)
        del graph.initializer[:]
        graph.initializer.extend(keep)
        # inference starts from what the model declares, never from stale value_info
        del graph.value_info[:]
        self.proto = proto
        self._outputs = [onnx.ValueInfoProto.FromString(vi.SerializeToString()) for vi in graph.output]
        self.bodies = BodyShapes(proto)  # If / Loop / Scan bodies (their rules)

    def __call__(self, profile: Profile, pins: Mapping[str, tuple[tuple[int, ...], int]] | None = None) -> tuple[dict[str, tuple], dict[str, int]]:
        graph = self.proto.graph
        for value_info in graph.input:
            dims = profile.inputs.get(value_info.name)
            if dims is not None:
                set_dims(value_info, dims)
        # the pins of this call only: graph outputs as declared, value_info empty
        del graph.output[:]
        graph.output.extend(self._outputs)
        del graph.value_info[:]
        outputs = {vi.name: vi for vi in graph.output}
        for name, (dims, elem) in (pins or {}).items():
            if name in outputs:
                set_dims(outputs[name], dims)
            else:
                graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem, list(dims)))
        self.bodies.reset()
        shapes, types = self._infer(profile)
        for _ in range(4 if self.bodies.loops else 0):  # a body's inputs shaped from the outer shapes, then again
            if not self.bodies.seed(shapes):
                break
            shapes, types = self._infer(profile)
        return shapes, types

    def _infer(self, profile: Profile) -> tuple[dict[str, tuple], dict[str, int]]:
        try:
            inferred = onnx.shape_inference.infer_shapes(self.proto, check_type=False, strict_mode=False, data_prop=True)
        except Exception as e:  # noqa: BLE001  (inference raises several kinds)
            raise ShapeError(f"shape inference failed for profile {profile.name!r}: {str(e).strip().splitlines()[0]}") from None
        shapes: dict[str, tuple] = {}
        types: dict[str, int] = {}
        for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            if not vi.type.HasField("tensor_type"):
                continue
            tensor_type = vi.type.tensor_type
            if tensor_type.elem_type:
                types[vi.name] = tensor_type.elem_type
            if tensor_type.HasField("shape"):
                shapes[vi.name] = tuple(
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
                )
        self.bodies.collect(inferred, shapes, types)
        return shapes, types


def _label(node: ir.Node) -> str:
    return node.name or (node.outputs[0].name if node.outputs else node.op_type)


def _scopes(graph: ir.Graph) -> dict[ir.Graph, tuple[ir.Node, str]]:
    """Every sub-graph, at any depth -> the node it belongs to and the attribute that holds it."""
    out: dict[ir.Graph, tuple[ir.Node, str]] = {}
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for name, attr in node.attributes.items():
            if attr.type == ir.AttributeType.GRAPH:
                out[attr.value] = (node, name)
            elif attr.type == ir.AttributeType.GRAPHS:
                for g in attr.value:
                    out[g] = (node, name)
    return out


class ResolveShapesPass(ir.passes.InPlacePass):
    """Resolves conv input / weight shapes for each shape profile (see the module rules).

    After a run, :attr:`notes` says, per profile, which tensors needed the CPU run and which convs'
    shapes depend on input values. Requires the folded conv weights of ``FoldConvWeightsPass``;
    ensures every tuned conv's shapes per profile (:mod:`~convpass.compiler.passes.state`)."""

    def __init__(self, shape_specs: Sequence[str | Mapping[str, Sequence[int]]] = (), names: OptionNames = CLI) -> None:
        super().__init__()
        self.names = names  # how messages name the profiles: --shape (CLI) or shapes[i] (Python API)
        self.shape_specs = parse_profiles(shape_specs, names)
        self.notes: list[str] = []
        self.cpu_runs: list[CpuShapes] = []  # one per profile that needed the CPU

    def requires(self, model: ir.Model) -> None:
        state.require(self, model, state.WEIGHTS_FOLDED)  # a computed weight's conv is marked to skip, or folded

    def ensures(self, model: ir.Model) -> None:
        state.ensure(self, model, state.SHAPES_RESOLVED)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        inputs = {v.name: v for v in model.graph.inputs if not v.is_initializer()}
        profiles = self._profiles(inputs)
        model.meta[PROFILES_KEY] = profiles
        convs = [n for n in ir.traversal.RecursiveGraphIterator(model.graph)
                 if n.op_type in CONV_OPS and n.domain in ("", "ai.onnx") and SKIP_KEY not in n.meta]
        if not convs:
            return ir.passes.PassResult(model, modified=False)
        tuned: dict[ir.Node, str] = {}
        for node in convs:
            x, w = node.inputs[0], node.inputs[1]
            elem = x.type.dtype if x.type is not None else (w.type.dtype if w.type is not None else None)
            dtype = _DTYPES.get(elem)
            if dtype is None:
                node.meta[SKIP_KEY] = f"its data type is {elem}, which convpass does not tune"
                logger.warning("%s %r is left untuned: data type %s", node.op_type, node.name, elem)
                continue
            tuned[node] = dtype
        # the CPU run resolves what the main graph's convs need; a body's convs take what inference gives
        sought = list({v.name: v for node in tuned if node.graph is model.graph for v in node.inputs[:2] if v.const_value is None}.values())
        inference = _ShapeInference(model)
        inferred, unresolved = [], []
        model.meta[VALUE_TYPES_KEY] = {}
        for profile in profiles:
            shapes, types = inference(profile)
            shapes, types, run = resolve_on_cpu(model, profile, sought, shapes, types, lambda pins, p=profile: inference(p, pins))
            if run is not None:
                self.cpu_runs.append(run)
                self.notes.extend(_notes(run, tuned))
            inferred.append(shapes)
            model.meta[VALUE_TYPES_KEY].update(types)
            unresolved.append(dict(inference.bodies.unresolved))
        model.meta[VALUE_SHAPES_KEY] = inferred
        scopes = _scopes(model.graph)
        for node, dtype in tuned.items():
            x, w = node.inputs[0], node.inputs[1]
            entries = []
            try:
                for profile, shapes, why in zip(profiles, inferred, unresolved):
                    xs = self._require(node, x, shapes, profile, inputs, why)
                    ws = tuple(w.const_value.shape) if w.const_value is not None else self._require(node, w, shapes, profile, inputs, why)
                    entries.append((xs, ws, dtype))
            except ShapeError as e:
                if node.graph is model.graph:
                    raise
                parent, attr = scopes[node.graph]
                where = f"in the {'body' if attr == 'body' else attr} of {parent.op_type} {_label(parent)!r}"
                node.meta[SKIP_KEY] = f"{where}: {str(e).split(': ', 1)[1]}"
                logger.warning("%s %r is left untuned: %s", node.op_type, _label(node), node.meta[SKIP_KEY])
                continue
            node.meta[SHAPES_KEY] = tuple(entries)
        return ir.passes.PassResult(model, modified=False)

    def _profiles(self, inputs: Mapping[str, ir.Value]) -> tuple[Profile, ...]:
        declared = {name: _dims(v.shape) for name, v in inputs.items()}
        specs = self.shape_specs or [{}]
        profiles = []
        for index, spec in enumerate(specs):
            option = self.names("shapes", index)
            shapes: dict[str, tuple] = {}
            for name, dims in declared.items():
                if name not in spec:
                    # A profile records the concrete shapes it was tuned for (the executor matches
                    # feeds against them); an input left symbolic or unknown constrains nothing.
                    if dims is not None and all(isinstance(d, int) for d in dims):
                        shapes[name] = dims
                    continue
                given = spec[name]
                if dims is not None and len(dims) != len(given):
                    raise ShapeError(
                        f"{option} {name}={_format_dims(given)}: input {name!r} has rank {len(dims)} ({_format_dims(dims)})"
                    )
                for i, (want, got) in enumerate(zip(dims or (), given)):
                    if isinstance(want, int) and want != got:
                        raise ShapeError(
                            f"{option} {name}={_format_dims(given)}: dim {i} of input {name!r} is fixed at {want}, not {got}"
                        )
                shapes[name] = given
            unknown = sorted(set(spec) - set(declared))
            if unknown:
                raise ShapeError(f"{option} names unknown input(s) {', '.join(map(repr, unknown))}; the model's inputs are {', '.join(map(repr, declared))}")
            label = ",".join(f"{k}={_format_dims(v)}" for k, v in spec.items()) or MODEL_SHAPES
            profiles.append(Profile(label, {k: v for k, v in shapes.items()}))
        return tuple(profiles)

    def _require(self, node: ir.Node, value: ir.Value, shapes: Mapping[str, tuple], profile: Profile, inputs: Mapping[str, ir.Value],
                 unresolved: Mapping[str, str] = {}) -> tuple[int, ...]:  # noqa: B006  (read only)
        dims = shapes.get(value.name)
        if dims is None and value.name in unresolved:
            raise ShapeError(f"{node.op_type} {_label(node)!r}: the shape of its input {value.name!r} is unknown: {unresolved[value.name]}")
        label = node.name or (node.outputs[0].name if node.outputs else node.op_type)
        # inputs the profile leaves open: declared with symbolic / unknown dims, or with no shape at all
        open_inputs = {name: _dims(v.shape) for name, v in inputs.items() if name not in profile.inputs}
        symbolic_inputs = {name: dims_ for name, dims_ in open_inputs.items() if dims_ is not None}
        missing_inputs = [name for name, dims_ in open_inputs.items() if dims_ is None]
        hint = ""
        if symbolic_inputs:
            examples = self.names.example("shapes", ",".join(
                f"{name}=" + "x".join(str(d) if isinstance(d, int) else "1" for d in dims_)
                for name, dims_ in symbolic_inputs.items()
            ))
            names = ", ".join(
                f"{d!r} of input {name!r}" for name, dims_ in symbolic_inputs.items() for d in dims_ if not isinstance(d, int)
            )
            hint = f"; give the symbolic dims ({names}) a value with e.g. {examples}"
        elif missing_inputs:
            hint = f"; input(s) {', '.join(map(repr, missing_inputs))} have no declared shape: give one with {self.names.example('shapes', 'NAME=DIMS')}"
        # With every input concrete, shapes inference leaves unknown are resolved on the CPU (or its
        # failure raised), so an unresolved shape always comes from one of the two cases above.
        if dims is None:
            raise ShapeError(f"{node.op_type} {label!r}: the shape of its input {value.name!r} is unknown (profile {profile.name!r}){hint}")
        for i, d in enumerate(dims):
            if not isinstance(d, int) or d <= 0:
                what = f"is {d!r} (symbolic)" if isinstance(d, str) else "is unknown"
                raise ShapeError(
                    f"{node.op_type} {label!r}: dim {i} of its input {value.name!r} {what} (profile {profile.name!r}){hint}"
                )
        return tuple(dims)
