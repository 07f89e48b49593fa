"""The typed algorithm name: every form the cache and tuned models hold parses and writes back."""

import pytest

from convpass.core.algo import Algo

FORMS = {
    "implicit_precomp_gemm": ("legacy", "implicit_precomp_gemm", ""),
    "implicit_precomp_gemm+bias+relu": ("legacy", "implicit_precomp_gemm", "bias+relu"),
    "engine:eng67_k2=16_k13=0": ("engine", "eng67_k2=16_k13=0", ""),
    "engine:eng5_k2=1+bias+swish": ("engine", "eng5_k2=1", "bias+swish"),
    "engine:none": ("engine", "none", ""),
    "convpass_depthwise_r8": ("own", "convpass_depthwise_r8", ""),
    "convpass_depthwise_r8+bias+add+relu": ("own", "convpass_depthwise_r8", "bias+add+relu"),
    "bias+relu": ("pass", "bias+relu", ""),
    "bias": ("pass", "bias", ""),
    "auto": ("auto", "auto", ""),
}


@pytest.mark.parametrize("text", FORMS)
def test_every_recorded_form_round_trips(text):
    algo = Algo.parse(text)
    assert (algo.family, algo.name, algo.fusion) == FORMS[text]
    assert str(algo) == text


def test_fusing_and_stripping():
    gemm = Algo.parse("implicit_gemm")
    assert str(gemm.fused("bias+add")) == "implicit_gemm+bias+add"
    assert gemm.fused("bias+add").bare == gemm and gemm.bare_of("legacy") and not gemm.fused("bias").bare_of("legacy")
    assert str(Algo.parse("engine:eng1").fused("bias+swish")) == "engine:eng1+bias+swish"
    assert Algo.parse("engine:eng1").is_engine and Algo.parse("convpass_depthwise_r4").is_own
    with pytest.raises(ValueError, match="no conv"):
        Algo.parse("bias").fused("bias+relu")


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="empty"):
        Algo.parse("  ")
    with pytest.raises(ValueError, match="'\\+'"):
        Algo("legacy", "gemm+bias")
    assert Algo.maybe(None) is None and Algo.maybe("") is None
