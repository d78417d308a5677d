"""Verifiable task datasets (procedurally generated, no I/O)."""

from services.builder.datasets.arithmetic import Task, demonstration, extract_answer, generate_split

__all__ = ["Task", "demonstration", "extract_answer", "generate_split"]
