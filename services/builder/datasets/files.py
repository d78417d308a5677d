"""Reading rows from files: JSONL, Parquet and directories written by ``datasets.save_to_disk``.

Each reader yields ``(where, row)`` pairs, ``where`` naming the file and line (or row) for error messages.
JSONL is read line by line with the standard library so a bad line is reported with its number;
Parquet through pyarrow and saved directories through ``datasets`` (both imported only when used).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

from services.common.errors import FieldError
from services.common.image_data import ImageDataError, check_size, decode_data_url

FILE_SOURCES = ("jsonl", "parquet", "disk")


def infer_source(path: str) -> str:
    """The file source a path names, from its suffix (a directory: ``disk``)."""
    p = pathlib.Path(path)
    if p.is_dir():
        return "disk"
    if p.suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if p.suffix in (".parquet", ".pq"):
        return "parquet"
    raise FieldError(f"{path}", "cannot tell the source from the name (.jsonl, .parquet or a save_to_disk "
                     "directory); set dataset.source")


def read_rows(source: str, path: str, *, split: str = "train") -> Iterator[tuple[str, Any]]:
    """The rows of the file at ``path``; ``split`` picks one split of a saved ``DatasetDict``."""
    if not pathlib.Path(path).exists():
        raise FieldError(f"{path}", "no such file or directory")
    if source == "jsonl":
        return _jsonl(path)
    if source == "parquet":
        return _parquet(path)
    if source == "disk":
        return _disk(path, split)
    raise FieldError("source", f"unknown {source!r} (known: {', '.join(FILE_SOURCES)})")


def _jsonl(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
            yield f"{path}:{n}", row


def _parquet(path: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for unreadable files
        raise FieldError(f"{path}", f"not a readable Parquet file ({exc})") from exc
    for n, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}:row {n}", row


def _disk(path: str, split: str) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError as exc:
        raise FieldError(f"{path}", f"not a directory written by datasets.save_to_disk ({exc})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise FieldError(f"{path}", f"has no split {split!r} (splits: {', '.join(loaded)})")
        loaded, path = loaded[split], f"{path}[{split}]"
    for n, row in enumerate(loaded, start=1):
        yield f"{path}:row {n}", row


def disk_splits(path: str) -> list[str]:
    """The split names of a saved ``DatasetDict`` (empty for a single saved ``Dataset``)."""
    index = pathlib.Path(path) / "dataset_dict.json"
    return list(json.loads(index.read_text()).get("splits", [])) if index.is_file() else []


def with_images(rows: Iterator[tuple[str, Any]], field: str, base_dir: pathlib.Path) -> Iterator[tuple[str, Any]]:
    """The rows with their ``field`` (a list of images) read into bytes. An image is a path (relative to the
    dataset file's directory), a ``data:image/...;base64,`` URL, raw bytes (a Parquet binary column) or a
    ``{"bytes": ..., "path": ...}`` mapping (the ``datasets`` Image feature)."""
    for where, row in rows:
        if isinstance(row, dict) and row.get(field) is not None:
            value = row[field]
            if not isinstance(value, list):
                raise FieldError(where, f"field {field!r} must be a list of images (paths, data URLs or bytes)")
            row = {**row, field: tuple(_image(item, base_dir, f"{where}: field {field}[{i}]")
                                       for i, item in enumerate(value))}
        yield where, row


def _image(item: Any, base_dir: pathlib.Path, where: str) -> bytes:
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    try:
        if isinstance(item, bytes | bytearray):
            return check_size(bytes(item))
        if isinstance(item, str) and item.startswith(("data:", "http://", "https://")):
            return decode_data_url(item)
        if isinstance(item, str) and item:
            path = pathlib.Path(item) if pathlib.Path(item).is_absolute() else base_dir / item
            try:
                return check_size(path.read_bytes())
            except OSError as exc:
                raise ValueError(f"{where}: cannot read {path} ({exc.strerror})") from exc
    except ImageDataError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    raise ValueError(f"{where}: expected a path, a data URL or bytes, got {type(item).__name__}")
