"""Images in a dataset's rows (JSONL paths or data URLs, Parquet bytes), and the built-in shapes generator: read into
the tasks, rendered through the model's processor (one placeholder per vision patch), refused naming the row and the
field when unreadable; the shapes splits are disjoint and deterministic."""

from __future__ import annotations

import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from transformers import AutoProcessor

from services.builder.datasets import shapes
from services.builder.datasets.config import DatasetConfig
from services.common.errors import FieldError


def test_shapes_splits_are_disjoint_deterministic_and_answered_by_their_count():
    train, again = shapes.generate_split("train", 200, seed=3), shapes.generate_split("train", 200, seed=3)
    held = shapes.generate_split("eval", 50, seed=3)
    assert [t.images for t in train] == [t.images for t in again]
    assert not {t.images for t in train} & {t.images for t in held}
    assert {t.answer for t in train} == {str(n) for n in range(1, shapes.MAX_SHAPES + 1)}
    image = Image.open(io.BytesIO(train[0].images[0]))
    assert image.size == (32, 32)
    colours = {c for _, c in image.convert("RGB").getcolors(4096)} - {(255, 255, 255)}
    assert colours, "the picture has shapes on it"
    with pytest.raises(FieldError, match="options.image_size"):
        DatasetConfig(source="shapes", options={"image_size": 8})
    with pytest.raises(FieldError, match="options.colour"):
        DatasetConfig(source="shapes", options={"colour": "red"})


def test_rows_name_their_images_by_path_data_url_or_bytes(tmp_path, vlm_dir, pictures):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(pictures[0])
    rows = [{"prompt": "<image>How many shapes?", "answer": "2", "images": ["pics/a.png"]},
            {"prompt": "<image>How many shapes?", "answer": "4",
             "images": ["data:image/png;base64," + base64.b64encode(pictures[1]).decode()]},
            {"prompt": "Two plus two?", "answer": "4"}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps(rows[0]))
    config = DatasetConfig(train=str(tmp_path / "train.jsonl"), eval=str(tmp_path / "eval.jsonl"), render="raw")
    data = config.build(seed=0, train_size=0, eval_size=0)
    assert [t.images for t in data.train] == [(pictures[0],), (pictures[1],), ()]
    encode = config.encoder(AutoProcessor.from_pretrained(vlm_dir).tokenizer, AutoProcessor.from_pretrained(vlm_dir))
    token = AutoProcessor.from_pretrained(vlm_dir).tokenizer.convert_tokens_to_ids("<image>")
    assert encode(data.train[0]).count(token) == 16 and token not in encode(data.train[2])
    text_only = config.encoder(AutoProcessor.from_pretrained(vlm_dir).tokenizer)
    with pytest.raises(FieldError, match="has images but the model takes none"):
        text_only(data.train[0])

    table = pa.table({"prompt": ["<image>How many shapes?"], "answer": ["3"], "images": [[pictures[2]]]})
    pq.write_table(table, tmp_path / "train.parquet")
    parquet = DatasetConfig(train=str(tmp_path / "train.parquet"), eval=str(tmp_path / "eval.jsonl"))
    assert parquet.build(seed=0, train_size=0, eval_size=0).train[0].images == (pictures[2],)

    (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "images": ["pics/missing.png"]}))
    bad = DatasetConfig(train=str(tmp_path / "bad.jsonl"), eval=str(tmp_path / "eval.jsonl"))
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field images\[0\]: cannot read .*missing.png"):
        bad.build(seed=0, train_size=0, eval_size=0)
    # data URLs are checked as the gateway checks them: a URL is never fetched, the media type must be an image's
    for image, why in (("https://example.com/a.png", "images are never fetched"),
                       ("data:text/plain;base64,aGk=", "media type 'text/plain' is not supported"),
                       ("data:image/png;base64,@@", "not valid base64")):
        (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "images": [image]}))
        with pytest.raises(ValueError, match=rf"bad.jsonl:1: field images\[0\]: {why}"):
            bad.build(seed=0, train_size=0, eval_size=0)
