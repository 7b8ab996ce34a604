"""Hostile corpus, issue #10 item 3: catastrophic regexes in a checkpoint's ignore/targets, an
auto-round extra_config key or a spec selector made inspect, spec show and quantize run for
minutes. Every one is now a one-line error naming the file and the key, in well under a second
(fp8ref.patterns: nested quantifiers refused statically, names length-bounded, a time budget)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fp8ref import patterns
from fp8ref.checkpoint import load_checkpoint
from fp8ref.cli import main
from fp8ref.errors import CheckpointError, SpecError
from fp8ref.patterns import Pattern
from fp8ref.spec import load_spec_string
from tests.support.checkpoint_builders import build_autoround, build_ct, write

EVIL = r"([\w.]+)+!"  # exponential in the name length under re's backtracking
NESTED = (EVIL, r"(a+)+$", r"(.*a){12}", r"(?:x*y*)*z", r"((ab)*c+)+d")


def _fast(fn, *args, limit: float = 3.0):
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        assert time.perf_counter() - start < limit


@pytest.mark.parametrize("text", NESTED)
def test_nested_quantifiers_are_refused_statically(text):
    with pytest.raises(SpecError, match="repeats a repeated subpattern"):
        Pattern(text, "x.yaml: ignore[0]")


@pytest.mark.parametrize("text", [r".*k_proj", r"model\.layers\.\d+\.mlp\.(gate|up)_proj", r"(q|k|v)_proj$",
                                  r".*lm_head", r"vision_tower.*", r"(ab)*c"])
def test_ordinary_selectors_still_match(text):
    import re

    p = Pattern(text, "x")
    for name in ("model.layers.3.mlp.up_proj", "model.layers.0.self_attn.k_proj", "lm_head", "abababc"):
        assert p.match(name) == (re.match(text, name) is not None)
        assert p.search(name) == (re.search(text, name) is not None)


def test_a_slow_pattern_the_static_check_lets_through_is_stopped_by_the_time_budget():
    p = Pattern(r"(a|aa)*c", "cfg.json: ignore[0]", error=CheckpointError)  # exponential, not nested
    with pytest.raises(CheckpointError, match=r"^cfg.json: ignore\[0\]: regular expression .* took more than 1 s"):
        _fast(p.match, "a" * 60)
    with pytest.raises(CheckpointError, match="took more than"):  # the budget is per pattern, in all
        _fast(p.match, "a" * 60, limit=0.5)


def test_off_the_main_thread_exponential_patterns_are_refused_when_matched():
    p = Pattern(r"(a|aa)*c", "x.yaml: ignore[0]")
    caught = []
    t = threading.Thread(target=lambda: caught.append(pytest.raises(SpecError, p.match, "a" * 60)))
    t.start()
    t.join(10)
    assert not t.is_alive() and "no time budget" in str(caught[0].value)
    assert Pattern(r".*a.*b", "x").match("xaxb")  # polynomial ones run anywhere


def test_names_and_patterns_are_length_bounded():
    with pytest.raises(SpecError, match="is longer than 1024 characters"):
        Pattern(r".*x", "x").match("a" * 5000)
    with pytest.raises(SpecError, match="regular expression of 2000 characters; at most 1024"):
        Pattern("a" * 2000, "x")


def test_the_budget_restores_a_callers_alarm_handler():
    import signal

    mine = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    try:
        Pattern(r".*a.*b", "x").match("a" * 50 + "b")
        assert signal.getsignal(signal.SIGALRM) is signal.SIG_IGN
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, mine)
    assert patterns.BUDGET_S <= 2


@pytest.mark.parametrize("where", ["ignore", "layer_config"])
def test_spec_validate_refuses_a_catastrophic_selector(where, capsys, tmp_path):
    body = f'ignore: ["re:{EVIL}"]' if where == "ignore" else f'layer_config:\n  "re:{EVIL}": BF16'
    path = tmp_path / "spec.yaml"
    path.write_text(f"scheme: FP8_DYNAMIC\n{body.replace(chr(92), chr(92) * 2)}\n")
    assert _fast(main, ["spec", "validate", str(path)]) == 1
    err = capsys.readouterr().err
    line = 2 if where == "ignore" else 3
    assert err.count("\n") == 1 and f"{path}:{line}: {where}" in err and "repeats a repeated subpattern" in err
    with pytest.raises(SpecError):
        load_spec_string(path.read_text(), source="x.yaml")


def _long_names(tensors):
    """Layer names long enough that the evil pattern would run for hours."""
    return {k.replace("model.layers.0.", "model.layers.0." + "a" * 40 + "."): v for k, v in tensors.items()}


@pytest.mark.parametrize("key", ["ignore", "targets"])
def test_compressed_tensors_catastrophic_ignore_or_target(tmp_path, key):
    tensors, cfg = build_ct("FP8")
    qc = cfg["quantization_config"]
    if key == "ignore":
        qc["ignore"] = ["lm_head", f"re:{EVIL}"]
    else:
        qc["config_groups"]["group_0"]["targets"] = ["Linear", f"re:{EVIL}"]
    folder = write(tmp_path / "ckpt", _long_names(tensors), cfg)
    with pytest.raises(CheckpointError) as exc:
        _fast(load_checkpoint, folder)
    where = "ignore[1]" if key == "ignore" else "config_groups.group_0.targets[1]"
    assert f"config.json: quantization_config.{where}: regular expression" in str(exc.value)


def test_autoround_catastrophic_extra_config_key(tmp_path):
    tensors, cfg = build_autoround()
    cfg["quantization_config"]["extra_config"] = {EVIL: {"bits": 16, "act_bits": 16}}
    with pytest.raises(CheckpointError, match=r"quantization_config.extra_config\[.*\]: regular expression"):
        _fast(load_checkpoint, write(tmp_path / "ckpt", _long_names(tensors), cfg))


def test_inspect_and_spec_show_return_quickly(tmp_path, capsys):
    tensors, cfg = build_ct("FP8")
    cfg["quantization_config"]["ignore"] = [f"re:{EVIL}"]
    folder = write(tmp_path / "ckpt", _long_names(tensors), cfg)
    assert _fast(main, ["inspect", str(folder)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error: ") and err.count("\n") == 1 and "ignore[0]" in err
    names = tmp_path / "names.txt"
    names.write_text("a" * 60 + "\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text('scheme: FP8_DYNAMIC\nlayer_config:\n  "re:(a|aa)*c": BF16\n')  # passes the static check
    assert _fast(main, ["spec", "show", str(spec), "--layers", str(names)]) == 1
    err = capsys.readouterr().err
    assert f"{spec}:3: selector 're:(a|aa)*c': regular expression" in err and "took more than" in err


def test_quantize_refuses_a_catastrophic_spec_before_reading_weights(tmp_path, capsys):
    import ml_dtypes

    from fp8ref.io.safetensors import write_safetensors

    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(src / "model.safetensors", {"model.layers.0.mlp.up_proj.weight":
                                                  ("BF16", np.ones((16, 16), ml_dtypes.bfloat16))})
    spec = tmp_path / "spec.yaml"
    spec.write_text(f'scheme: FP8_DYNAMIC\nignore: ["re:{EVIL}"]\n'.replace("\\", "\\\\"))
    assert _fast(main, ["quantize", str(src), str(tmp_path / "out"), "--spec", str(spec)]) == 1
    assert f"{spec}:2: ignore[0]" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_wildcard_prefix_is_re_match_of_the_pattern_with_stars_as_dot_star():
    """Every pattern of up to 4 characters over {a, b, *} against every name of up to 5 over {a, b}:
    the linear matcher answers as re.match of the escaped pattern with ``*`` -> ``.*`` does."""
    import itertools
    import re

    words = lambda alphabet, n: ("".join(w) for k in range(n + 1) for w in itertools.product(alphabet, repeat=k))
    names = list(words("ab", 5))
    for pattern in words("ab*", 4):
        rx = re.compile(".*".join(re.escape(p) for p in pattern.split("*")))
        for name in names:
            assert patterns.wildcard_prefix(pattern, name) == bool(rx.match(name)), (pattern, name)


def test_gpt_oss_not_convert_entries_cannot_backtrack():
    """``*a*a*...*`` as a regex took over 100 s on a 229-character name; the matcher answers at once."""
    from fp8ref.producers.gptoss import Config

    cfg = Config({"quant_method": "mxfp4", "modules_to_not_convert": ["*a" * 30 + "*"]}, "c", [])
    assert cfg.skipped("a" * 29 + "b" * 200) is None
    assert cfg.skipped("a" * 30) == "*a" * 30 + "*"
