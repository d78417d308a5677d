"""Verifiable task datasets: the built-in arithmetic generator, files (JSONL, Parquet, save_to_disk
directories) and reasoning-gym families, as tasks the builder renders and issues."""

from services.builder.datasets.arithmetic import demonstration, extract_answer, generate_split
from services.builder.datasets.config import Dataset, DatasetConfig
from services.builder.datasets.render import PromptEncoder
from services.builder.datasets.splits import shuffled_epochs
from services.builder.datasets.task import Task

__all__ = ["Dataset", "DatasetConfig", "PromptEncoder", "Task", "demonstration", "extract_answer",
           "generate_split", "shuffled_epochs"]
