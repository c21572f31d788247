"""Our one-pass GGUF reader against the gguf package's GGUFReader: the same metadata, tensors and dequantized values."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest

from specformer_jax.checkpoints.gguf_file import read_gguf

Q = gguf.GGMLQuantizationType


def same_as_gguf_reader(path):
    meta, tensors = read_gguf(path)
    ref = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # header, not metadata
    assert list(meta) == list(fields)
    for key, want in fields.items():
        got = meta[key].tolist() if isinstance(meta[key], np.ndarray) else meta[key]
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert [(t.name, t.tensor_type, t.data.shape, t.data.dtype) for t in tensors] == \
        [(t.name, int(t.tensor_type), t.data.shape, t.data.dtype) for t in ref.tensors]
    for ours, theirs in zip(tensors, ref.tensors):
        np.testing.assert_array_equal(gguf.quants.dequantize(ours.data, Q(ours.tensor_type)),
                                      gguf.quants.dequantize(theirs.data, theirs.tensor_type))
    return meta, tensors


def test_every_value_and_tensor_type_reads_as_the_gguf_package_does(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200); w.add_int8("t.i8", -5); w.add_uint16("t.u16", 60000); w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000); w.add_int32("t.i32", -70000); w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**40); w.add_int64("t.i64", -(2**40)); w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True); w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, -2, 3]); w.add_array("t.floats", [0.5, 1.5]); w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("vec", x[0])
    for qtype in (Q.Q8_0, Q.Q4_0, Q.BF16):
        w.add_tensor(qtype.name.lower(), gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    meta, tensors = same_as_gguf_reader(path)
    assert meta["t.str"] == "héllo" and meta["t.strs"] == ["a", "", "ü"] and meta["t.u64"] == 2**40
    np.testing.assert_array_equal(tensors[0].data, x)
    assert [t.shape for t in tensors] == [(4, 64), (4, 64), (64,), (4, 64), (4, 64), (4, 64)]


def test_the_default_model_file_reads_as_the_gguf_package_does():
    from specformer_jax.checkpoints.default import default_model_path

    meta, tensors = same_as_gguf_reader(default_model_path())
    assert meta["general.architecture"] == "llama" and len(meta["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type for t in tensors} == {Q.F32, Q.Q4_1, Q.Q8_0}


@pytest.mark.parametrize("damage", ["magic", "version", "truncated"])
def test_damaged_files_raise_value_errors(tmp_path, damage):
    from specformer_jax.checkpoints.default import default_model_path

    raw = default_model_path().read_bytes()
    raw = {"magic": b"GGUX" + raw[4:], "version": raw[:4] + b"\x07\x00\x00\x00" + raw[8:],
           "truncated": raw[: len(raw) // 2]}[damage]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw)
    with pytest.raises(ValueError):
        read_gguf(bad)
