"""GGUF tensor loading: every supported type against gguf's own numpy dequantization."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from tiny_quant import random_blocks, tensor_bytes

from gmlx.gguf import tensors as tz
from gmlx.gguf.header import GGUFError, read_header
from gmlx.gguf.tensors import load_tensors

EXACT_BITS = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q4_K: 4, T.Q5_K: 5}
REQUANT_BITS = {T.Q6_K: 8, T.Q3_K: 4, T.Q2_K: 3}
SHAPE = (3, 512)  # numpy/MLX order; GGUF stores (512, 3)


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, T]]):
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    for name, (data, qtype) in tensors.items():
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_header(path)


def reference(data: np.ndarray, qtype: T) -> np.ndarray:
    if qtype in (T.F32, T.F16):
        return data.astype(np.float32)
    return dequantize(data.reshape(-1).view(np.uint8), qtype).reshape(*data.shape[:-1], -1)


def native_dequant(arrays, quant, name: str) -> np.ndarray:
    base = name.removesuffix(".weight")
    bits, group = quant[name]
    return np.array(
        mx.dequantize(arrays[name], arrays[base + ".scales"], arrays[base + ".biases"], group_size=group, bits=bits)
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """One file holding a 2-D and a 3-D weight of every supported quantized type, plus floats."""
    rng = np.random.default_rng(0)
    tensors = {}
    for qtype in (*EXACT_BITS, *REQUANT_BITS):
        tensors[f"{qtype.name}.weight"] = (tensor_bytes(qtype, SHAPE, rng), qtype)
        tensors[f"{qtype.name}_3d.weight"] = (tensor_bytes(qtype, (2, 3, 256), rng), qtype)
        # random blocks also cover codes the quantizer never emits (e.g. Q8_0 -128)
        if qtype in EXACT_BITS:
            tensors[f"{qtype.name}_raw.weight"] = (random_blocks(qtype, SHAPE, rng), qtype)
    tensors["F32.weight"] = (tensor_bytes(T.F32, SHAPE, rng), T.F32)
    tensors["F16.weight"] = (tensor_bytes(T.F16, SHAPE, rng), T.F16)
    tensors["BF16.weight"] = (quantize(rng.standard_normal(SHAPE).astype(np.float32), T.BF16), T.BF16)
    tensors["norm.weight"] = (rng.standard_normal(64).astype(np.float32), T.F32)
    tensors["Q8_0_1d.weight"] = (quantize(rng.standard_normal(64).astype(np.float32), T.Q8_0), T.Q8_0)
    header = write_gguf(tmp_path_factory.mktemp("gguf") / "all.gguf", tensors)
    return header, tensors


@pytest.fixture(scope="module")
def native(model):
    return load_tensors(model[0], "native")


@pytest.fixture(scope="module")
def floats(model):
    return load_tensors(model[0], "float")


def test_shapes_are_reversed_gguf_shapes(model, native, floats):
    header, tensors = model
    for name, info in header.tensors.items():
        assert floats[0][name].shape == info.shape[::-1]
        if name in native[1]:
            bits, group = native[1][name]
            *lead, k = info.shape[::-1]
            assert native[0][name].shape == (*lead, k * bits // 32) and native[0][name].dtype == mx.uint32
            assert native[0][name.removesuffix(".weight") + ".scales"].shape == (*lead, k // group)
        else:
            assert native[0][name].shape == info.shape[::-1]


@pytest.mark.parametrize("qtype", list(EXACT_BITS), ids=lambda t: t.name)
@pytest.mark.parametrize("suffix", ["", "_3d", "_raw"])
def test_native_exact_repack(model, native, qtype, suffix):
    arrays, quant, report = native
    name = f"{qtype.name}{suffix}.weight"
    if name not in model[1]:
        pytest.skip("no such variant")
    assert quant[name] == (EXACT_BITS[qtype], 32)
    base = name.removesuffix(".weight")
    assert arrays[base + ".scales"].dtype == mx.float32 and arrays[base + ".biases"].dtype == mx.float32
    np.testing.assert_array_equal(native_dequant(arrays, quant, name), reference(*model[1][name]))
    # Q8_0 also has a 1-D tensor in the file, which stays float
    assert report.by_type[qtype.name]["action"].startswith(f"exact {EXACT_BITS[qtype]}-bit g32")


@pytest.mark.parametrize("qtype", list(REQUANT_BITS), ids=lambda t: t.name)
def test_native_requantized_within_half_a_step(model, native, qtype):
    arrays, quant, report = native
    for name in (f"{qtype.name}.weight", f"{qtype.name}_3d.weight"):
        bits = REQUANT_BITS[qtype]
        assert quant[name] == (bits, 32)
        ref = reference(*model[1][name])
        err = np.abs(native_dequant(arrays, quant, name) - ref).reshape(-1, 32)
        # bound: half of one step of the group's own range at the new width (plus float rounding)
        grp = ref.reshape(-1, 32)
        step = (grp.max(axis=1) - grp.min(axis=1)) / (2**bits - 1)
        assert np.all(err.max(axis=1) <= 0.5 * step + 1e-6 * np.abs(grp).max(axis=1))
        assert err.max() > 0  # it really is a re-quantization
    assert report.by_type[qtype.name]["action"] == f"re-quantized {REQUANT_BITS[qtype]}-bit g32"


@pytest.mark.parametrize("qtype", [*EXACT_BITS, *REQUANT_BITS, T.F32, T.F16], ids=lambda t: t.name)
def test_float_mode_equals_reference(model, floats, qtype):
    arrays, quant, report = floats
    assert quant == {}
    for suffix in ("", "_3d", "_raw"):
        name = f"{qtype.name}{suffix}.weight"
        if name in model[1]:
            assert arrays[name].dtype == mx.float32
            np.testing.assert_array_equal(np.array(arrays[name]), reference(*model[1][name]))
    expected = "float32" if qtype in (T.F32, T.F16) else "dequantized float32"
    assert report.by_type[qtype.name]["action"] == expected


def test_float_types_in_native_mode(model, native):
    arrays, quant, report = native
    _, tensors = model
    assert arrays["F32.weight"].dtype == mx.float32 and arrays["F16.weight"].dtype == mx.float16
    np.testing.assert_array_equal(np.array(arrays["F16.weight"]), tensors["F16.weight"][0])
    # BF16 widens to float32 on the CPU, exactly
    bf16 = dequantize(tensors["BF16.weight"][0].reshape(-1), T.BF16).reshape(SHAPE)
    assert arrays["BF16.weight"].dtype == mx.float32
    np.testing.assert_array_equal(np.array(arrays["BF16.weight"]), bf16)
    assert report.by_type["BF16"]["action"] == "float32"
    assert report.by_type["F16"]["action"] == "float16"


def test_one_dimensional_tensors_stay_float(model, native):
    arrays, quant, report = native
    assert "norm.weight" not in quant and "Q8_0_1d.weight" not in quant
    assert arrays["Q8_0_1d.weight"].dtype == mx.float32
    np.testing.assert_array_equal(np.array(arrays["Q8_0_1d.weight"]), reference(*model[1]["Q8_0_1d.weight"]))
    assert "dequantized float32 x1" in report.by_type["Q8_0"]["action"]


def test_report(model, native):
    arrays, _, report = native
    assert report.resident_bytes == sum(a.nbytes for a in arrays.values())
    assert report.by_type["Q4_K"]["tensors"] == 3
    line = report.describe()
    assert "Q4_K: 3 exact 4-bit g32" in line and "Q6_K: 2 re-quantized 8-bit g32" in line


def test_float_dtype_and_names(model):
    header, tensors = model
    arrays, quant, report = load_tensors(header, "float", mx.float16, names=["Q4_K.weight", "F32.weight"])
    assert set(arrays) == {"Q4_K.weight", "F32.weight"}
    assert arrays["Q4_K.weight"].dtype == mx.float16 and arrays["F32.weight"].dtype == mx.float16
    ref = reference(*tensors["Q4_K.weight"]).astype(np.float16)
    np.testing.assert_array_equal(np.array(arrays["Q4_K.weight"]), ref)
    assert report.by_type["Q4_K"]["action"] == "dequantized float16"


def test_float16_scales(model):
    header, tensors = model
    arrays, quant, _ = load_tensors(header, "native", names=["Q8_0.weight"], scale_dtype=mx.float16)
    assert arrays["Q8_0.scales"].dtype == mx.float16
    # d and -128d are fp16-exact, but MLX then computes in float16: within a quarter step d
    ref = reference(*tensors["Q8_0.weight"])
    d = np.repeat(np.array(arrays["Q8_0.scales"]).astype(np.float32), 32, axis=1)
    assert np.all(np.abs(native_dequant(arrays, quant, "Q8_0.weight") - ref) <= 0.25 * d)
    with pytest.raises(ValueError):
        load_tensors(header, "native", names=["Q8_0.weight"], scale_dtype=mx.bfloat16)


def test_without_shared_buffers(model, monkeypatch):
    """The copy path used off the CPU gives the same arrays."""
    monkeypatch.setattr(tz, "SHARE_MLX_BUFFERS", False)
    header, tensors = model
    names = ["Q5_0.weight", "Q6_K.weight", "BF16.weight"]
    arrays, quant, _ = load_tensors(header, "native", names=names)
    np.testing.assert_array_equal(native_dequant(arrays, quant, "Q5_0.weight"), reference(*tensors["Q5_0.weight"]))
    floats, _, _ = load_tensors(header, "float", names=names)
    np.testing.assert_array_equal(np.array(floats["Q6_K.weight"]), reference(*tensors["Q6_K.weight"]))


def test_unsupported_type(tmp_path):
    rng = np.random.default_rng(1)
    block, size = GGML_QUANT_SIZES[T.IQ4_NL]
    raw = rng.integers(0, 256, size=(2, 64 // block * size), dtype=np.uint8)
    header = write_gguf(tmp_path / "iq.gguf", {"blk.0.ffn_up.weight": (raw, T.IQ4_NL)})
    with pytest.raises(
        GGUFError, match=r"tensor blk.0.ffn_up.weight: GGML type IQ4_NL is not supported \(supported: F32"
    ):
        load_tensors(header, "native")
    with pytest.raises(GGUFError, match="not in"):
        load_tensors(header, "float", names=["missing.weight"])


def test_pack_matches_mlx_layout():
    rng = np.random.default_rng(2)
    for bits in (2, 3, 4, 5, 6, 8):
        q = rng.integers(0, 2**bits, size=(4, 64), dtype=np.uint8)
        ones, zeros = mx.ones((4, 2)), mx.zeros((4, 2))
        got = mx.dequantize(mx.array(tz._pack(q, bits)), ones, zeros, group_size=32, bits=bits)
        np.testing.assert_array_equal(np.array(got), q.astype(np.float32))


@pytest.mark.slow
def test_default_model():
    from gmlx.default_model import DefaultModelMissing, default_model_path

    try:
        header = read_header(default_model_path())
    except DefaultModelMissing:
        pytest.skip("default model not installed")
    arrays, quant, report = load_tensors(header, "native")
    actions = {t: e["action"] for t, e in report.by_type.items()}
    assert actions == {
        "F32": "float32",
        "Q8_0": "exact 8-bit g32",
        "Q5_0": "exact 5-bit g32",
        "Q4_K": "exact 4-bit g32",
        "Q6_K": "re-quantized 8-bit g32",
    }
    info = header.tensors["blk.0.ffn_down.weight"]  # Q6_K
    raw = tz._blocks(header._buffer(), info).reshape(-1)
    ref = dequantize(raw, T.Q6_K).reshape(info.shape[::-1])
    assert np.abs(native_dequant(arrays, quant, info.name) - ref).max() < 0.005
