"""Unit tests of issue #25's input checks: option types, token readers, config.json values, the
block count check, and the refusal of non-finite logits."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from fp8ref.checkpoint.loader import _gaps, check_blocks
from fp8ref.cli.argtypes import int_range, random_shape
from fp8ref.errors import CheckpointError, ModelError
from fp8ref.limits import MAX_RANDOM_IDS, MAX_SEQUENCE
from fp8ref.nn.config_check import BOUNDS, check_values
from fp8ref.nn.tokens import parse_random, random_tokens, read_tokens, text_tokens

HELD = (2, "model.layers")


# --- option types -------------------------------------------------------------------------------

def test_int_range_accepts_its_range_and_names_what_it_got():
    parse = int_range(1, 10)
    assert parse("1") == 1 and parse("10") == 10 and parse(" 7 ") == 7
    for text in ("0", "11", "-3", "x", "1e3", "2.0", "9" * 5000, ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"^expected an integer in 1\.\.10, got '") as exc:
            parse(text)
        assert len(str(exc.value)) < 100


def test_random_shape_bounds_the_product_not_just_each_side():
    assert parse_random("2x16") == (2, 16) and random_shape(" 2x16 ") == "2x16"
    assert parse_random(f"1x{MAX_SEQUENCE}") == (1, MAX_SEQUENCE)
    assert parse_random(f"{MAX_RANDOM_IDS // 64}x64") == (MAX_RANDOM_IDS // 64, 64)
    for spec in (f"{MAX_RANDOM_IDS // 64 + 1}x64", f"1x{MAX_SEQUENCE + 1}", "100000x100000"):
        with pytest.raises(ModelError, match=rf"^--random: .* ids; expected T <= {MAX_SEQUENCE} and B x T <= "):
            parse_random(spec)
    for spec in ("0x5", "5x0", "2*5", "x", "1" * 13 + "x2"):
        with pytest.raises(ModelError, match="expected BxT such as 2x16"):
            parse_random(spec)
    with pytest.raises(argparse.ArgumentTypeError, match="^expected BxT"):
        random_shape("2*5")
    assert random_tokens("3x4", 7).shape == (3, 4)


# --- token readers ------------------------------------------------------------------------------

def test_read_tokens_checks_every_line_and_never_builds_lists_of_the_file(tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text("1 2 3\n\n4 5 6\n")
    ids = read_tokens(f, 10)
    assert ids.dtype == torch.int64 and ids.tolist() == [[1, 2, 3], [4, 5, 6]]
    cases = {"1 2 3\n4 5\n": r"ids.txt:2: 2 ids; expected lines of equal length",
             "7\n": r"ids.txt:1: 1 ids; expected lines of equal length, 2..65536",
             "": r"ids.txt: no token ids",
             "1 \xff 2\n": r"ids.txt:1: expected whitespace-separated integer token ids",
             "1 -1\n": r"ids.txt:1: token id -1 outside \[0, 10\)",
             " ".join(["1"] * (MAX_SEQUENCE + 1)) + "\n": r"ids.txt:1: 65537 ids",
             "1" * (16 * MAX_SEQUENCE + 1): r"ids.txt:1: line longer than 1048576 bytes"}
    for text, message in cases.items():
        f.write_text(text, encoding="latin-1")
        with pytest.raises(ModelError, match=message):
            read_tokens(f, 10)


def test_text_tokens_bounds(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"a")
    with pytest.raises(ModelError, match="t.txt: 1 bytes; expected at least 2"):
        text_tokens(f, 10)
    f.write_bytes(b"abc")
    assert text_tokens(f, 10, seq_len=128).tolist() == [[97 % 10, 98 % 10, 99 % 10]]
    for seq_len in (1, MAX_SEQUENCE + 1):
        with pytest.raises(ModelError, match="--seq-len: expected an integer in 2..65536"):
            text_tokens(f, 10, seq_len=seq_len)


# --- config.json values -------------------------------------------------------------------------

GOOD = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 128, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
        "hidden_act": "silu", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}


def _refused(cfg: dict, message: str, held=HELD) -> None:
    with pytest.raises(ModelError, match=message):
        check_values(cfg, "c/config.json", held)


def test_a_real_config_passes():
    pytest.importorskip("transformers")  # the activation names are transformers' ACT2FN
    check_values(GOOD, "c/config.json", HELD)
    check_values({**GOOD, "intermediate_size": [128, 256], "text_config": dict(GOOD)}, "c/config.json", HELD)


@pytest.mark.parametrize("key", sorted(BOUNDS))
@pytest.mark.parametrize("value", [0, -1, True, 2.0, "64", 2**70])
def test_every_bounded_key_refuses_what_is_not_a_positive_integer_in_range(key, value):
    if key == "num_hidden_layers" and value == 2**70:
        value = BOUNDS[key] + 1
    _refused({**GOOD, key: value}, rf"^c/config.json: {key}: expected an integer in 1\.\.{BOUNDS[key]}, got ")


def test_nested_text_config_and_lists_are_checked_with_their_key_path():
    pytest.importorskip("transformers")  # the activation names are transformers' ACT2FN
    _refused({**GOOD, "text_config": {**GOOD, "vocab_size": -7}}, r"^c/config.json: text_config.vocab_size: ")
    _refused({**GOOD, "intermediate_size": [128, 0]}, r"^c/config.json: intermediate_size: expected an integer")


def test_relations_between_keys():
    _refused({**GOOD, "num_key_value_heads": 3}, "num_key_value_heads: expected a divisor of num_attention_heads")
    _refused({**GOOD, "num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok: expected at most the 4")
    _refused({**GOOD, "num_hidden_layers": 3}, r"num_hidden_layers: expected at most the 2 numbered blocks the "
                                               r"checkpoint's tensors hold \(model.layers.N\), got 3")
    _refused({**GOOD, "num_hidden_layers": 9}, "at most the 5 numbered blocks", held=(5, None))


@pytest.mark.parametrize(("edit", "message"), [
    ({"hidden_act": "attack_act"}, r"hidden_act: expected an activation transformers knows .*got 'attack_act'"),
    ({"hidden_act": "silux"}, r"did you mean 'silu'"),
    ({"activation_function": 3}, r"activation_function: expected an activation"),
    ({"dtype": "attackfloat"}, r"dtype: expected a torch floating dtype name"),
    ({"torch_dtype": "int8"}, r"torch_dtype: expected a torch floating dtype name"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps: expected a finite number >= 0"),
    ({"layer_norm_eps": math.inf}, r"layer_norm_eps: expected a finite number >= 0"),
    ({"rope_theta": -1}, r"^c/config.json: rope_theta: expected a finite number > 0, got -1$"),
    ({"rope_parameters": {"rope_theta": 0}}, r"rope_parameters.rope_theta: expected a finite number > 0"),
    ({"rope_parameters": {"full_attention": {"rope_theta": math.nan}, "sliding_attention": {"rope_theta": 1e4}}},
     r"rope_parameters.full_attention.rope_theta: expected a finite number > 0, got nan"),
    ({"rope_scaling": {"factor": -8.0, "rope_type": "linear"}}, r"rope_scaling.factor: expected a finite number > 0"),
])
def test_names_and_numbers_transformers_would_trust(edit, message):
    pytest.importorskip("transformers")
    _refused({**GOOD, **edit}, message)


def test_torch_dtype_names_with_prefix_pass():
    pytest.importorskip("transformers")  # the activation names are transformers' ACT2FN
    check_values({**GOOD, "dtype": "torch.float16", "torch_dtype": "float32"}, "c/config.json", HELD)


# --- the block count check ----------------------------------------------------------------------

class Store(list):
    """Tensor names only: what check_blocks reads."""


def test_check_blocks_counts_only_the_indices_the_names_hold():
    names = Store(f"model.layers.{i}.mlp.up_proj.weight" for i in (0, 1, 2, 5, 9))
    check_blocks({"num_hidden_layers": 3}, names, "c.json")
    with pytest.raises(CheckpointError, match=r"c.json: num_hidden_layers is 2147483646, .* hold 5 of them "
                                              r"\(model.layers.0-2,5,9\), none for block\(s\) 3-4,6-8,10-2147483645:"):
        check_blocks({"num_hidden_layers": 2**31 - 2}, names, "c.json")  # no set(range(n)): answers at once
    with pytest.raises(CheckpointError, match=r"none for block\(s\) 3-4,6-8:"):
        check_blocks({"num_hidden_layers": 9}, names, "c.json")


def test_gaps_lists_missing_runs_without_enumerating():
    assert _gaps([], 1) == "0"
    assert _gaps([0, 1, 2], 3) == ""
    assert _gaps([1, 3], 6) == "0,2,4-5"
    assert _gaps(list(range(0, 20, 2)), 10**12) == "1,3,5,7,9,11,..."


# --- non-finite logits --------------------------------------------------------------------------

class NanModel(torch.nn.Module):
    def forward(self, ids):
        return torch.full((*ids.shape, 5), math.nan)


def test_compare_and_evaluate_refuse_non_finite_logits():
    from fp8ref.nn.compare import compare, evaluate

    ids = torch.zeros(2, 3, dtype=torch.uint8)
    with pytest.raises(ModelError, match=r"^compare: baseline mode reference: 30 of 30 logits are not finite"):
        compare(NanModel(), ids, ["reference"])
    with pytest.raises(ModelError, match=r"^eval: mode reference, sequences 0\.\.1: 30 of 30 logits are not"):
        evaluate(NanModel(), ids, "reference")
    with pytest.raises(ModelError, match=r"^eval: batch: expected a positive integer, got -3"):
        evaluate(NanModel(), ids, "reference", batch=-3)
    with pytest.raises(ModelError, match=rf"^compare: {MAX_RANDOM_IDS + 1} token ids"):
        compare(NanModel(), torch.zeros(1, MAX_RANDOM_IDS + 1, dtype=torch.uint8), ["reference"])
