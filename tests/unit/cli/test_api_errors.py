"""The public API names every wrong type it is given in one typed line (an Fp8RefError subclass that
is also a TypeError/ValueError), never a bare TypeError/AttributeError from deep inside: sparse,
nested and meta tensors, complex and object arrays, masked arrays, strings, wrong paths, a string
where a checkpoint layer belongs, a byte-swapped out= buffer."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import fp8ref
from fp8ref import QuantArgs
from fp8ref.errors import CheckpointError, Fp8RefError, InputTypeError

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
E4M3 = "float8_e4m3fn"


def _x():
    return torch.arange(8, dtype=torch.float32).reshape(2, 4)


def _sparse_csr():
    with warnings.catch_warnings():  # torch calls CSR support beta
        warnings.simplefilter("ignore")
        return _x().to_sparse_csr()


def _nested():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


WRONG_ARRAYS = {
    "sparse COO": (lambda: _x().to_sparse(), r"expected a dense tensor, got layout torch\.sparse_coo"),
    "sparse CSR": (_sparse_csr, r"expected a dense tensor, got layout torch\.sparse_csr"),
    "nested": (_nested, r"expected a dense tensor, got a nested tensor"),
    "meta": (lambda: torch.empty(2, 4, device="meta"), r"expected a CPU tensor, got device meta \(a meta tensor"),
    "torch complex": (lambda: torch.ones(2, 4, dtype=torch.complex64), r"complex64"),
    "numpy complex": (lambda: np.ones((2, 4), np.complex64), r"complex64"),
    "object array": (lambda: np.array([[1.0, None]], dtype=object), r"object"),
    "masked array": (lambda: np.ma.masked_array(np.ones((2, 4), np.float32), mask=np.eye(2, 4)),
                     r"masked array; fp8ref would ignore its mask"),
    "string": (lambda: "1.0", r"expected .*(str|<U3)"),
}

CALLS = {
    "encode": lambda a: fp8ref.encode(a, E4M3),
    "decode": lambda a: fp8ref.decode(a, E4M3),
    "quantize": lambda a: fp8ref.quantize(a, QuantArgs()),
    "fake_quant": lambda a: fp8ref.fake_quant(a, QuantArgs()),
    "ulp_distance": lambda a: fp8ref.ulp_distance(a, a, "float32"),
    "scaled_mm": lambda a: fp8ref.scaled_mm(a, a, np.float32(1), np.float32(1)),
    "linear": lambda a: fp8ref.linear(a, np.zeros((3, 4), np.uint8), np.float32(1), dynamic="tensor"),
    "observe": lambda a: fp8ref.observe(fp8ref.amax_state(), a),
}


@pytest.mark.parametrize("wrong", list(WRONG_ARRAYS))
@pytest.mark.parametrize("function", list(CALLS))
def test_wrong_arrays_are_named_in_one_typed_line(function, wrong):
    make, message = WRONG_ARRAYS[wrong]
    if wrong == "masked array" and function in ("decode", "scaled_mm"):  # codes: uint8, masked
        make = lambda: np.ma.masked_array(np.ones((2, 4), np.uint8), mask=np.eye(2, 4))  # noqa: E731
    with pytest.raises(InputTypeError, match=message) as info:
        CALLS[function](make())
    assert isinstance(info.value, TypeError) and "\n" not in str(info.value)


@pytest.mark.parametrize("call, message", [
    (lambda: fp8ref.load_checkpoint(5), r"^path: expected a file or folder path \(str or os\.PathLike\), got int$"),
    (lambda: fp8ref.load_checkpoint(None), r"^path: .* got NoneType$"),
    (lambda: fp8ref.load_checkpoint(b"/tmp"), r"^path: .* got bytes$"),
    (lambda: fp8ref.load_checkpoint(""), r"^path: expected a file or folder path, got ''$"),
    (lambda: fp8ref.load_spec(5), r"^path: .* got int$"),
    (lambda: fp8ref.load_recipes(5), r"^directory: .* got int$"),
    (lambda: fp8ref.export_checkpoint(5, "out", {}), r"^source: .* got int$"),
    (lambda: fp8ref.export_checkpoint(".", 5, {}), r"^output: .* got int$"),
    (lambda: fp8ref.write_checkpoint("ckpt", "out"), r"^checkpoint: expected a Checkpoint .* got str$"),
    (lambda: fp8ref.write_calibration(5, {}), r"^path: .* got int$"),
    (lambda: fp8ref.checkpoint.load_calibration(5), r"^path: .* got int$"),
    (lambda: fp8ref.observe_linear_inputs(5, [], []), r"^model: expected a torch\.nn\.Module, got int$"),
    (lambda: fp8ref.calibrate_input_scales("model", [], []), r"^model: expected a torch\.nn\.Module, got str$"),
    (lambda: fp8ref.finalize(5), r"^state: expected an AmaxState .* got int$"),
    (lambda: fp8ref.quantize(np.ones(4, np.float32), QuantArgs(dynamic=False), scale="a"),
     r"^scale: expected a real number or an array of them, got str$"),
    (lambda: fp8ref.quantize(np.ones(4, np.float32), QuantArgs(dynamic=False), amax=1j),
     r"^amax: expected a real number or an array of them, got complex of complex128$"),
    (lambda: fp8ref.quantize(np.ones(4, np.float32), QuantArgs(dynamic=False), scale=[1.0, None]),
     r"^scale: expected a real number .* got list$"),
    (lambda: fp8ref.quantize(np.ones(32, np.float32), QuantArgs(format="float4_e2m1fn", granularity="nvfp4"),
                             recipe="compressed-tensors-nvfp4", amax=np.ones(2, np.float32)),
     r"^amax: expected one real number \(the tensor's\), got float32 of shape \(2,\)$"),
    (lambda: fp8ref.decode(np.zeros(3, np.uint8), E4M3, out=np.zeros(3, ">f4")),
     r"^out: a byte-swapped array \(>f4\) for decode; fp8ref writes this machine's byte order"),
    (lambda: fp8ref.encode(np.ones(3, np.float32), E4M3, rounding="stochastic",
                           random_bits=torch.zeros(3, dtype=torch.uint8, device="meta")),
     r"^random_bits: expected a CPU tensor, got device meta"),
    (lambda: fp8ref.scaled_mm(np.zeros((2, 2), np.uint8), np.zeros((2, 2), np.uint8), np.float32(1), np.float32(1),
                              bias=torch.ones(2).to_sparse()), r"^bias: expected a dense tensor"),
])
def test_wrong_types_raise_typed_errors(call, message):
    with pytest.raises(InputTypeError, match=message):
        call()


@pytest.fixture(scope="module")
def layer():
    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")
    return ckpt[next(iter(ckpt))]


@pytest.mark.parametrize("layer_arg, message", [
    ("a string", r"^layer: expected a QuantizedLayer \(checkpoint\[name\] of fp8ref\.load_checkpoint\), got str$"),
    (None, r"^layer: .* got NoneType$"),
    (np.zeros((4, 4), np.uint8), r"^layer: .* got ndarray$"),
])
def test_fp8reflinear_refuses_what_is_not_a_checkpoint_layer(layer_arg, message):
    from fp8ref.nn import Fp8RefLinear

    with pytest.raises(InputTypeError, match=message):
        Fp8RefLinear(layer_arg)


@pytest.mark.parametrize("make, message", [
    (lambda k: torch.empty(2, k, device="meta"), r": input: expected a CPU tensor, got device meta"),
    (lambda k: torch.ones(2, k).to_sparse(), r": input: expected a dense tensor, got layout torch\.sparse_coo"),
    (lambda k: np.ones((2, k), np.float32), r": input: expected a torch tensor, got ndarray"),
    (lambda k: torch.ones(2, k, dtype=torch.int32), r": input: expected a float16, bfloat16, float32 or float64 "
                                                     r"tensor, got torch\.int32"),
    (lambda k: torch.ones(2, k).to(torch.float8_e4m3fn), r": input: expected .* got torch\.float8_e4m3fn"),
])
def test_fp8reflinear_refuses_inputs_without_values(layer, make, message):
    from fp8ref.nn import Fp8RefLinear

    lin = Fp8RefLinear(layer)
    with pytest.raises(InputTypeError, match=f"^{layer.name}{message}"):
        lin(make(lin.in_features))
    y = lin(torch.ones(2, lin.in_features))  # a dense CPU tensor still runs
    assert y.shape == (2, lin.out_features)


def test_fp8reflinear_refuses_a_meta_original_weight(layer):
    from fp8ref.nn import Fp8RefLinear

    with pytest.raises(InputTypeError, match=r"original_weight: expected a CPU tensor, got device meta"):
        Fp8RefLinear(layer, original_weight=torch.empty(tuple(layer.shape), device="meta"))


def test_every_typed_error_is_an_fp8ref_error():
    assert issubclass(InputTypeError, Fp8RefError) and issubclass(InputTypeError, TypeError)
    assert issubclass(CheckpointError, Fp8RefError) and issubclass(CheckpointError, ValueError)
