"""benchmarks/local_errors.py on the CPU: a BiT-like pre-activation block (GroupNorm as the TorchScript
exporter writes it, weight-standardized convs as it writes timm's StdConv2d), each conv's and each
GroupNorm unit's own error against float64, and a node whose output is off is the one named."""

from __future__ import annotations

import json

import numpy as np
import onnx
from conftest import benchmark_script
from fused_models import norm
from onnx import TensorProto, helper, numpy_helper
from test_fold_conv_weights import _Graph, _std_conv_weight


def bit_block(c: int = 16, hw: int = 9) -> onnx.ModelProto:
    """x -> GN + Relu -> StdConv 1x1 -> GN + Relu -> StdConv 3x3 (stride 2, bias) ... and x -> StdConv 1x1
    (stride 2) -> Add."""
    rng = np.random.default_rng(0)
    g = _Graph()
    nodes, inits, t = norm("gn17", "n1", "x", c, 4, rng, eps=1e-5)
    g.nodes += nodes
    g.inits += inits
    h = g.op("Conv", [t, _std_conv_weight(g, rng.standard_normal((c, c, 1, 1)).astype(np.float32) * 0.1, 1e-8, "c1_")], "h")
    nodes, inits, t2 = norm("gn17", "n2", h, c, 4, rng, eps=1e-5)
    g.nodes += nodes
    g.inits += inits
    bias = g.init("b2", rng.standard_normal(c).astype(np.float32))
    y2 = g.op("Conv", [t2, _std_conv_weight(g, rng.standard_normal((c, c, 3, 3)).astype(np.float32), 1e-8, "c2_"), bias], "y2",
              pads=[1, 1, 1, 1], strides=[2, 2])
    short = g.op("Conv", [t, _std_conv_weight(g, rng.standard_normal((c, c, 1, 1)).astype(np.float32), 1e-8, "sc_")], "short", strides=[2, 2])
    g.op("Add", [y2, short], "y")
    graph = helper.make_graph(g.nodes, "bit", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", c, hw, hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", c, (hw + 1) // 2, (hw + 1) // 2])], g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)



def skewed_conv_setup():
    """``(script, model, tuned, feeds, runner)``: the local-errors benchmark, :func:`bit_block`
    tuned on the CPU, one input, and a CPU runner with conv ``h``'s weight off by about 1e-3
    relative, so that what follows computes on its output as a device would."""
    import convpass

    script = benchmark_script("local_errors")
    model = bit_block()
    tuned = convpass.optimize(model, shapes=["x=1x16x9x9"], quiet=True)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 16, 9, 9)).astype(np.float32)}
    cpu = script.executor_runner("cpu")

    def skewed(m, f):
        m = onnx.ModelProto.FromString(m.SerializeToString())
        (conv,) = [n for n in m.graph.node if n.name == "h"]
        (w,) = [t for t in m.graph.initializer if t.name == conv.input[1]]
        noise = np.random.default_rng(2).standard_normal(tuple(w.dims)).astype(np.float32)
        w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * (1 + np.float32(1e-3) * noise), w.name))
        return cpu(m, f)

    return script, model, tuned, feeds, skewed

def test_every_conv_and_groupnorm_has_a_float32_sized_local_error_on_the_cpu(tmp_path, capsys):
    path = tmp_path / "bit.onnx"
    onnx.save(bit_block(), path)
    out = tmp_path / "errors.json"
    assert benchmark_script("local_errors").main(["--model", str(path), "--batch", "2", "--device", "cpu", "--cache", str(tmp_path / "c.db"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    kinds = [r["kind"] for r in result["nodes"]]
    assert kinds.count("conv") == 3 and kinds.count("groupnorm") == 2
    assert all(r["local"] < 1e-6 for r in result["nodes"]), result["nodes"]
    assert all(r["math_mode"] for r in result["nodes"] if r["kind"] == "conv")
    assert result["end_to_end"] < 1e-5
    assert "largest local error" in capsys.readouterr().out


def test_a_node_computed_off_is_the_one_with_the_large_local_error():
    """The device runner computes one conv with its weight off by 1e-3 (random per element: the
    GroupNorm after it cannot normalize it away): its local error says so, the nodes
    before it stay at float32's size, and the nodes after it carry it in their cumulative error only."""
    script, model, tuned, feeds, skewed = skewed_conv_setup()
    rows = {r["node"]: r for r in script.local_errors(model, tuned, feeds, skewed)["nodes"]}
    assert 5e-4 < rows["h"]["local"] < 2e-3
    assert rows["n2/InstanceNormalization"]["local"] < 1e-6, "a GroupNorm of the skewed input is still computed right"
    assert rows["n1/InstanceNormalization"]["local"] < 1e-6 and rows["short"]["local"] < 1e-6
    assert max(r["local"] for n, r in rows.items() if n != "h") < 1e-6
    assert rows["n2/InstanceNormalization"]["cumulative"] > 1e-4 and rows["y2"]["cumulative"] > 1e-4  # carried after h
    assert rows["n1/InstanceNormalization"]["cumulative"] < 1e-6 and rows["short"]["cumulative"] < 1e-6  # not before it, nor beside
