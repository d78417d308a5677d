"""A verifier plugin for meshrl: the share of required keywords the response mentions (case-insensitive).

Task metadata: {"verifier": "keywords", "verifier_options": {"keywords": ["paris", "france"]}}.
No import of meshrl is needed: `score` returns (reward, detail) and `check` raises ValueError naming the field.
"""

from __future__ import annotations


class KeywordVerifier:
    def check(self, task: dict) -> None:
        keywords = (task.get("verifier_options") or {}).get("keywords")
        if not isinstance(keywords, list) or not keywords or not all(isinstance(k, str) and k for k in keywords):
            raise ValueError("grading.verifier_options.keywords: must be a non-empty list of strings")

    def score(self, response: str, task: dict) -> tuple[float, str]:
        keywords = task["verifier_options"]["keywords"]
        text = response.casefold()
        found = [k for k in keywords if k.casefold() in text]
        return len(found) / len(keywords), f"found {found} of {keywords}"
