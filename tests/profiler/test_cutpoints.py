"""Cut points and their sizes on a hand-made graph; input preparation and its errors."""

from __future__ import annotations

import pytest

from ppipe.errors import UserError
from ppipe.profiler.graph import analyze, prepare_model, wire_bytes_per_element


def _cuts(model, **kw):
    info = analyze(prepare_model(model, **kw))
    return info, {c.last_node: c for c in info.cuts}


def test_cut_points_and_bytes_on_a_residual_graph(make_tiny):
    info, cuts = _cuts(make_tiny(spatial=8))
    act = 4 * 8 * 8 * 2  # one 4x8x8 fp32 feature map, sent as fp16
    assert [info.node(i).name for i in range(len(info.compute_nodes))] == [
        "conv0", "relu0", "conv_a", "conv_b", "add", "relu1", "gap", "flatten", "fc", "argmax"
    ]
    assert cuts["conv0"].tensors == ("c0",) and cuts["conv0"].bytes_per_sample == act
    # inside the residual pair two tensors cross: r0 (still needed by conv_b) and a
    assert set(cuts["conv_a"].tensors) == {"r0", "a"} and cuts["conv_a"].bytes_per_sample == 2 * act
    assert set(cuts["conv_b"].tensors) == {"a", "b"} and cuts["conv_b"].bytes_per_sample == 2 * act
    assert cuts["add"].tensors == ("s",) and cuts["add"].bytes_per_sample == act
    assert cuts["gap"].bytes_per_sample == 4 * 2
    # after fc, logits cross (needed by argmax and as a model output): 5 floats at 2 bytes
    assert cuts["fc"].tensors == ("logits",) and cuts["fc"].bytes_per_sample == 10
    # the last cut is the model output: 5 floats (fp16) + one int64 counted at 4 bytes
    assert cuts["argmax"].tensors == ("logits", "top") and cuts["argmax"].bytes_per_sample == 10 + 4
    # of the tensors crossing after conv_a, `a` is read last, by add (position 4)
    assert cuts["conv_a"].live_until == 4 and cuts["conv0"].live_until == 1


def test_wire_bytes_follow_the_artifact_convention():
    assert wire_bytes_per_element(1) == 2  # float32 -> fp16
    assert wire_bytes_per_element(10) == 2  # float16
    assert wire_bytes_per_element(7) == 4  # int64 counted at 4 bytes
    assert wire_bytes_per_element(2) == 1  # uint8


def test_input_gets_a_symbolic_batch_and_static_sample_shape(make_tiny):
    info, _ = _cuts(make_tiny(batch_dim=1))
    dims = info.model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [3, 8, 8]
    assert info.input_shape == [3, 8, 8] and info.input_dtype == "float32"


def test_dynamic_shapes_need_an_input_shape(make_tiny):
    from onnx import TensorProto, helper

    m = make_tiny()
    m.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"]))
    with pytest.raises(UserError, match="--input-shape"):
        prepare_model(m)
    info, cuts = _cuts(m, input_shape=[3, 6, 6])
    assert cuts["conv0"].bytes_per_sample == 4 * 6 * 6 * 2


def test_input_shape_of_the_wrong_rank_is_rejected(make_tiny):
    with pytest.raises(UserError, match="dimensions"):
        prepare_model(make_tiny(), input_shape=[3, 8])


def test_two_inputs_are_rejected(make_tiny):
    from onnx import TensorProto, helper

    m = make_tiny()
    m.graph.input.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3]))
    with pytest.raises(UserError, match="single-input"):
        prepare_model(m)
