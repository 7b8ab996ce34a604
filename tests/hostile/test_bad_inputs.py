"""Hostile inputs of issue #25 items 3, 4 and 7 (readers, values that reached torch or transformers,
reports that named nothing), in the default run (not marked ``hostile``).

Each refusal: exit code != 0, one ``fp8ref: error:`` line naming the file, key or tensor (an
option's range error is argparse's usage error, exit 2, naming the option), no traceback, no
"unexpected" last-resort line, nothing written. Special files are made here (``os.mkfifo``,
``os.mknod``), never taken from /dev; a command that reads one runs in a subprocess with a timeout,
so a reader that blocks fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fp8ref.cli import main
from tests.support.checkpoint_builders import snapshot

ROOT = Path(__file__).resolve().parents[2]
CKPTS = ROOT / "tests" / "fixtures" / "interop" / "checkpoints"
pytest.importorskip("transformers")


# --- helpers ------------------------------------------------------------------------------------

def copy_ckpt(tmp_path: Path, name: str = "llmc_fp8", edit_config=None) -> Path:
    ck = tmp_path / name
    shutil.copytree(CKPTS / name, ck)
    if edit_config is not None:
        cfg = json.loads((ck / "config.json").read_text())
        edit_config(cfg)
        (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def rewrite_tensors(path: Path, change) -> None:
    """Rewrite a safetensors file with ``change(header, blobs)`` applied (an independent writer:
    the header's JSON and raw byte blobs, offsets recomputed)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", None)
    data = raw[8 + n:]
    blobs = {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items()}
    change(header, blobs)
    body, offset = [], 0
    for k, v in header.items():
        v["data_offsets"] = [offset, offset + len(blobs[k])]
        offset += len(blobs[k])
        body.append(blobs[k])
    if meta is not None:
        header["__metadata__"] = meta
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(body))


def assert_refused(code: int, err: str, *names: str, usage: bool = False) -> None:
    """One error line naming every one of ``names``; no traceback, no last-resort line."""
    assert code != 0, err
    assert "Traceback" not in err and "unexpected" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    if usage:  # argparse: "usage: ..." lines, then "fp8ref CMD: error: argument --X: ..."
        assert code == 2 and lines[-1].startswith("fp8ref ") and ": error: argument " in lines[-1], err
        line = lines[-1]
    else:
        assert len(lines) == 1 and lines[0].startswith("fp8ref: error: "), err
        line = lines[0]
    for name in names:
        assert name in line, (name, line)


def run_in_process(capsys, *argv) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    cap = capsys.readouterr()
    return code, cap.err


def run_subprocess(*argv, timeout: float = 60, memory: int | None = None) -> tuple[int, str]:
    def limit():
        if memory is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "fp8ref", *map(str, argv)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT, env=env, preexec_fn=limit)
    return run.returncode, run.stderr


# --- item 3: readers ----------------------------------------------------------------------------

CASES = [("--text", "fifo", "a FIFO"), ("--tokens", "fifo", "a FIFO"), ("--text", "device", "a device"),
         ("--tokens", "folder", "a folder")]

# several in-process runs in one child (torch is imported once): a reader that blocks on a FIFO or
# reads a device without end makes the child time out, never the test session hang
BATCH = """
import contextlib, io, json, sys
from fp8ref.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def _special(folder: Path, kind: str) -> Path | None:
    path = folder / f"special-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":  # a private node with /dev/zero's numbers: reading it would never end
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
        except PermissionError:
            return None
    else:
        path.mkdir()
    return path


@pytest.fixture(scope="module")
def special_reads(tmp_path_factory):
    """(code, stderr, path) per CASES entry; path None where the node could not be made."""
    folder = tmp_path_factory.mktemp("specials")
    ck = copy_ckpt(folder)
    paths = []
    for option, kind, _ in CASES:
        (folder / option.strip("-")).mkdir(exist_ok=True)
        paths.append(_special(folder / option.strip("-"), kind))
    runs = [["eval", str(ck), option, str(p), "--quiet"] for (option, _, _), p in zip(CASES, paths) if p]
    before = snapshot(folder)
    child = subprocess.run([sys.executable, "-c", BATCH, json.dumps(runs)], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.returncode == 0, child.stderr[-2000:]
    assert snapshot(folder) == before
    results = iter(json.loads(child.stdout))
    return [(*next(results), p) if p else None for p in paths]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{o}-{k}" for o, k, _ in CASES])
def test_token_sources_are_read_as_regular_files_only(special_reads, case):
    if special_reads[case] is None:
        pytest.skip("making a device node needs root")
    code, err, path = special_reads[case]
    assert_refused(code, err, str(path), CASES[case][2])


def test_a_fifo_config_json_is_an_error_not_no_config(tmp_path):
    ck = copy_ckpt(tmp_path)
    (ck / "config.json").unlink()
    os.mkfifo(ck / "config.json")
    code, err = run_subprocess("inspect", ck, "--headers-only")
    assert_refused(code, err, str(ck / "config.json"), "a FIFO")


def test_text_is_one_byte_of_memory_per_byte(tmp_path):
    from fp8ref.nn.tokens import as_model_ids, text_tokens

    (tmp_path / "t.txt").write_bytes(bytes(range(256)) * 40)
    ids = text_tokens(tmp_path / "t.txt", 100, seq_len=128)
    assert ids.dtype.itemsize == 1 and ids.shape == (80, 128)
    assert as_model_ids(ids).tolist()[1][:3] == [(128 + i) % 100 for i in range(3)]
    big_vocab = text_tokens(tmp_path / "t.txt", 1000, seq_len=256)
    assert big_vocab[0].tolist() == list(range(256))  # b % vocab = b


# --- item 4: numeric options --------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ("eval", "CKPT", "--text", "T", "--batch", "-3"), ("eval", "CKPT", "--text", "T", "--batch", "0"),
    ("compare", "CKPT", "--seq-len", "0"), ("compare", "CKPT", "--seq-len", "-5"),
    ("compare", "CKPT", "--random", "100000x100000"), ("compare", "CKPT", "--random", "0x5"),
    ("compare", "CKPT", "--random", "1x100000"), ("compare", "CKPT", "--random", "9" * 400 + "x2"),
    ("golden", "check", "G", "--outputs", "O", "--max-errors", "-1"),
    ("conform", "--backend", "ml_dtypes", "--max-errors", "x"),
])
def test_numeric_options_are_range_checked_while_parsing(capsys, argv):
    option = next(a for a in argv if a.startswith("--") and a not in ("--text", "--outputs", "--backend"))
    code, err = run_in_process(capsys, *argv)
    assert_refused(code, err, f"argument {option}", usage=True)
    assert len(err.splitlines()[-1]) < 200


# --- item 4: config.json values -----------------------------------------------------------------

def _set(key, value):
    def edit(cfg):
        parts = key.split(".")
        for p in parts[:-1]:
            cfg = cfg[p]
        cfg[parts[-1]] = value
    return edit


@pytest.mark.parametrize(("key", "value", "says"), [
    ("hidden_size", 2**40, "hidden_size: expected an integer in 1..1048576"),
    ("vocab_size", -7, "vocab_size: expected an integer in 1..16777216"),
    ("num_attention_heads", 0, "num_attention_heads: expected an integer"),
    ("head_dim", 0, "head_dim: expected an integer"),
    ("num_key_value_heads", 3, "num_key_value_heads: expected a divisor of num_attention_heads (4)"),
    ("hidden_act", "attack_act", "hidden_act: expected an activation transformers knows"),
    ("dtype", "attackfloat", "dtype: expected a torch floating dtype name"),
    ("rope_parameters.rope_theta", -1, "rope_parameters.rope_theta: expected a finite number > 0"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps: expected a finite number >= 0"),
    ("num_hidden_layers", 10**9, "num_hidden_layers is 1000000000, so the checkpoint should hold"),
    ("num_hidden_layers", 3, "its tensors hold 2 of them (model.layers.0-1), none for block(s) 2:"),
    ("hidden_size", 128, "model.embed_tokens.weight of shape [128, 128], the checkpoint's is [128, 64]"),
    ("intermediate_size", 4096, "of shape [4096, 64], the checkpoint's is [128, 64]"),
])
def test_config_values_are_checked_before_transformers_builds(tmp_path, capsys, key, value, says):
    ck = copy_ckpt(tmp_path, edit_config=_set(key, value))
    before = snapshot(tmp_path)
    code, err = run_in_process(capsys, "compare", ck, "--random", "1x4", "--quiet")
    assert_refused(code, err, f"{ck / 'config.json'}: ", says)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(("value", "says"), [
    (10**9, "num_hidden_layers: expected an integer in 1..65536, got 1000000000"),
    (3, "num_hidden_layers: expected at most the 2 numbered blocks the checkpoint's tensors hold (model.layers.N)"),
])
def test_an_unquantized_checkpoint_bounds_its_layer_count_too(tmp_path, capsys, value, says):
    ck = copy_ckpt(tmp_path, "original_bf16", edit_config=_set("num_hidden_layers", value))
    code, err = run_in_process(capsys, "compare", ck, "--modes", "reference", "--random", "1x4", "--quiet")
    assert_refused(code, err, f"{ck / 'config.json'}: {says}")


def test_a_billion_layers_allocates_nothing_in_any_command(tmp_path):
    """``set(range(num_hidden_layers))`` grew to 9 GiB in every command, --headers-only included:
    run under a 1.5 GiB data limit, the check must still answer with its own line."""
    ck = copy_ckpt(tmp_path, edit_config=_set("num_hidden_layers", 10**9))
    code, err = run_subprocess("inspect", ck, "--headers-only", memory=3 << 29)
    assert_refused(code, err, "config.json: num_hidden_layers is 1000000000", "none for block(s) 2-999999999")


def test_non_finite_baseline_logits_are_refused_naming_the_mode(tmp_path, capsys):
    """A NaN norm weight passes every config check and makes every logit NaN: top-1 agreement was
    1.0 (argmax of NaN rows agrees); now compare and eval refuse, naming the mode."""
    ck = copy_ckpt(tmp_path)
    rewrite_tensors(ck / "model.safetensors", lambda h, b: b.update(
        {"model.norm.weight": np.full(64, np.nan, np.float32).astype("<f4").view(np.uint16)[1::2].tobytes()}))
    (tmp_path / "t.txt").write_bytes(bytes(range(40)))
    code, err = run_in_process(capsys, "compare", ck, "--random", "1x4", "--quiet")
    assert_refused(code, err, "compare: baseline mode reference: 512 of 512 logits are not finite")
    code, err = run_in_process(capsys, "eval", ck, "--text", tmp_path / "t.txt", "--byte-tokens", "--mode", "producer",
                               "--quiet")
    assert_refused(code, err, "eval: mode producer, sequences 0..0: ", "logits are not finite")


# --- item 4: checkpoint tensors -----------------------------------------------------------------

Q = "model.layers.0.self_attn.q_proj"


def _nvfp4(tmp_path, change) -> Path:
    ck = copy_ckpt(tmp_path, "llmc_nvfp4")
    rewrite_tensors(ck / "model.safetensors", change)
    return ck


def _packed_31(h, b):
    h[f"{Q}.weight_packed"]["shape"] = [64, 31]
    rows = np.frombuffer(b[f"{Q}.weight_packed"], np.uint8).reshape(64, 32)
    b[f"{Q}.weight_packed"] = rows[:, :31].tobytes()


def _global(value):
    def change(h, b):
        b[f"{Q}.weight_global_scale"] = np.array([value], "<f4").tobytes()
    return change


def _empty(h, b):
    for name, shape in ((f"{Q}.weight_packed", [64, 0]), (f"{Q}.weight_scale", [64, 0])):
        h[name]["shape"] = shape
        b[name] = b""


@pytest.mark.parametrize(("change", "tensor", "says"), [
    (_packed_31, "weight_packed", "packed shape [64, 31] holds K = 62 values per row"),
    (_global(1e-40), "weight_global_scale", "is a denormal float32"),
    (_global(0.0), "weight_global_scale", "(zero)"),
    (_global(float("inf")), "weight_global_scale", "(infinite)"),
    (_empty, "weight_packed", "shape [64, 0] holds no element"),
])
def test_bad_packed_fp4_tensors_are_refused_naming_the_tensor(tmp_path, capsys, change, tensor, says):
    ck = _nvfp4(tmp_path, change)
    code, err = run_in_process(capsys, "inspect", ck)
    assert_refused(code, err, f"{Q}.{tensor}", says)


def test_a_global_divisor_that_overflows_every_weight_is_refused(tmp_path, capsys):
    ck = _nvfp4(tmp_path, _global(2.0**-120))  # normal, but 2688 / 2**-120 is past float32 and bfloat16
    code, err = run_in_process(capsys, "inspect", ck)
    assert_refused(code, err, f"{Q}.weight_global_scale", "past bfloat16's")


# --- item 7: reports ----------------------------------------------------------------------------

def test_golden_check_with_the_wrong_outputs_file_caps_missing_lines(tmp_path, capsys):
    from fp8ref.io.safetensors import write_safetensors

    golden = tmp_path / "g"
    assert main(["golden", "generate", "formats", "-o", str(golden), "--level", "1", "--quiet"]) == 0
    wrong = tmp_path / "wrong.safetensors"
    write_safetensors(wrong, {"unrelated": ("F32", np.zeros(2, np.float32))})
    capsys.readouterr()
    assert main(["golden", "check", str(golden), "--outputs", str(wrong), "--max-errors", "3"]) == 1
    out = capsys.readouterr().out
    missing = [line for line in out.splitlines() if line.startswith("MISSING ")]
    total = json.loads((golden / "MANIFEST.json").read_text())["cases"]
    assert len(missing) == 3 and len(total) > 3
    assert f"... {len(total) - 3} more MISSING cases not shown (--max-errors)" in out
    assert f"note: none of the {len(total)} case(s) has outputs in {wrong}" in out


def test_inspect_text_lists_the_stored_kv_cache_scales(capsys):
    assert main(["inspect", str(CKPTS / "modelopt_fp8")]) == 0
    out = capsys.readouterr().out
    assert "KV-cache scales (2):" in out
    assert "model.layers.0.self_attn.k_proj.k_scale  F32[] " in out and ".v_proj.v_scale  F32[] " in out


def test_an_input_quantization_error_names_the_layer():
    from fp8ref.checkpoint import load_checkpoint
    from fp8ref.errors import ModelError
    from fp8ref.nn.modes import quantize_input

    layer = load_checkpoint(CKPTS / "llmc_fp8_dynamic")[Q]
    x = np.ones((2, 64), np.float32)
    x[1, 3] = np.nan
    layout = r"\(W float8_e4m3fn channel, input dynamic-token\)"
    with pytest.raises(ModelError, match=f"^{Q}: input quantization {layout}: "):
        quantize_input(layer, x)
    nv = load_checkpoint(CKPTS / "llmc_nvfp4")[Q]  # was "dynamic: expected 'tensor', ... got 'nvfp4'"
    codes, scale = quantize_input(nv, np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64))
    assert codes.shape == (2, 64) and scale.shape == (2, 4)


def test_a_backend_mode_on_an_nvfp4_layer_names_the_layer_and_why():
    """backend_forward broadcast a (M, K/16) block scale into a per-row one: 'unexpected ValueError'."""
    from fp8ref.checkpoint import load_checkpoint
    from fp8ref.conformance.backend import load_backend
    from fp8ref.errors import ModelError
    from fp8ref.nn.modes import backend_forward

    nv = load_checkpoint(CKPTS / "llmc_nvfp4")[Q]
    with pytest.raises(ModelError, match=f"^{Q}: backend 'torch' cannot run this layer "
                                         r"\(torch scaled_mm does not implement format='float4_e2m1fn'\)"):
        backend_forward(nv, np.ones((2, 64), np.float32), load_backend("torch"), "float32")
