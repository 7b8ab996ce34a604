"""Writing a checkpoint folder: streaming safetensors shards, the index and config files, the
other files of the source copied (regular files and folders only), and a progress bar. Shared by
export, conversion and the gpt-oss writer."""

from __future__ import annotations

import json
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CheckpointError
from ..io.atomic import atomic_write_text, is_inside
from ..io.safetensors import INDEX_NAME, SafetensorsWriter, TensorStore
from . import base


def prefetched(f):
    """(name, raw bytes) of every tensor of ``f`` in order, reading the next one in a background
    thread while the caller quantizes and writes the current one (at most two in memory)."""
    names = list(f.tensors)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(f.read_bytes, names[0]) if names else None
        for i, name in enumerate(names):
            raw = pending.result()
            pending = pool.submit(f.read_bytes, names[i + 1]) if i + 1 < len(names) else None
            yield name, raw
            del raw


def write_shard(folder: Path, fname: str, specs: list, metadata, items, weight_map: dict) -> int:
    """Stream ``items`` ((name, data) in ``specs`` order) into one safetensors file; a failure
    removes the partial file. Records the tensors in ``weight_map``; returns their data bytes."""
    writer = SafetensorsWriter(folder / fname, specs, metadata or {"format": "pt"})
    try:
        for name, data in items:
            writer.write(name, data)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    weight_map.update({spec.name: fname for spec in specs})
    return sum(spec.nbytes for spec in specs)


def metadata_names(sharded: bool, qc: dict, fmt: base.CheckpointFormat) -> set[str]:
    """The files ``write_metadata`` writes."""
    return ({INDEX_NAME} if sharded else set()) | {"config.json"} | set(fmt.extra_files(qc))


def refuse_collisions(store: TensorStore, qc: dict, fmt: base.CheckpointFormat) -> None:
    """Before anything is written: a shard named like a file the format writes beside it (an index
    naming a shard ``quantization_config.json``) would be overwritten by it."""
    for name in sorted(set(store.files) & metadata_names(store.index is not None, qc, fmt)):
        raise CheckpointError(f"{store.files[name].path}: a shard named {name!r}, but the {fmt.name} format writes "
                              f"its own {name!r} beside the shards; rename the shard (and its index entries)")


def write_metadata(tmp: Path, sharded: bool, weight_map: dict, total_size: int, config: dict, qc: dict,
                    fmt: base.CheckpointFormat) -> None:
    """The shard index (when the source had one), config.json with ``qc`` as its
    quantization_config, and the other files the format keeps its config in."""
    if sharded:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(tmp / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    config["quantization_config"] = qc
    atomic_write_text(tmp / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name, document in fmt.extra_files(qc).items():
        atomic_write_text(tmp / name, json.dumps(document, indent=2, sort_keys=True) + "\n")


def config_files() -> set[str]:
    """Files some format keeps its config in: written from the new config, never copied (a stale
    hf_quant_config.json beside a compressed-tensors config would misdescribe the tensors)."""
    return {f for name in base.names() for f in base.get(name).config_files}


def copy_others(src: Path, dst: Path, skip: set[str], *, symlinks_out: bool = False) -> None:
    """Copy every other file and folder of the source (tokenizer, generation config, ...)."""
    root = src.resolve()
    for entry in sorted(src.iterdir()):
        if entry.name in skip or entry.name.startswith("."):
            continue
        _copy_entry(entry, dst / entry.name, root, symlinks_out, ())


def _copy_entry(entry: Path, target: Path, root: Path, symlinks_out: bool, parents: tuple[Path, ...]) -> None:
    """Regular files and folders only. A symlink is copied as what it names when that lies inside
    the source folder (anywhere with ``symlinks_out``: a Hugging Face snapshot); a dangling link, a
    loop, a FIFO, a device or a socket is refused, never opened (a FIFO would block the copy)."""
    try:
        real = entry.resolve(strict=True)
        mode = real.stat().st_mode
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        why = getattr(exc, "strerror", None) or "symlink loop"
        raise CheckpointError(f"{entry}: cannot copy it into the output: {why} (a dangling symlink or a loop?)") \
            from None
    if entry.is_symlink() and not symlinks_out and not is_inside(real, root):
        raise CheckpointError(f"{entry}: a symlink to {real}, outside the source folder {root}; refusing to copy it "
                              "into the output (pass symlinks_out=True, CLI --symlinks-out, if you trust it)")
    if stat.S_ISDIR(mode):
        if real in parents:
            raise CheckpointError(f"{entry}: a symlink to its own parent folder {real} (a loop); refusing to copy it")
        target.mkdir()
        for child in sorted(entry.iterdir()):
            _copy_entry(child, target / child.name, root, symlinks_out, (*parents, real))
    elif stat.S_ISREG(mode):
        shutil.copy2(real, target)
    else:
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device file"
        raise CheckpointError(f"{entry}: {kind}, not a regular file or folder; refusing to copy it into the output")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, desc: str = "export", unit: str = "tensor"):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, leave=False)
