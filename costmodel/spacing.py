"""Where a hybrid model's prefill keeps a snapshot of its recurrent state (DESIGN §3a).

First step, not yet the cost model's decision: a fixed spacing, every ``spacing``
pages, and always the last full page of the prompt (a restart resumes there; the state
at the prompt's very end stays in L1 with its partial page). The engine cuts prefill
chunks at these boundaries so that the state there exists.
"""

from __future__ import annotations


def snapshot_pages(prompt_tokens: int, page_size: int, spacing: int) -> list[int]:
    """The page counts after which a prefill of ``prompt_tokens`` tokens keeps a
    snapshot: multiples of ``spacing`` and the last full page before the prompt's last
    token, in order."""
    last = (prompt_tokens - 1) // page_size
    return sorted({*range(spacing, last + 1, spacing), last} - {0})


def prefill_segments(prompt: list[int], done: int, page_size: int, points: list[int]) -> list[list[int]]:
    """``prompt[done:]`` cut at each snapshot point after ``done`` (mlx-lm's
    ``BatchGenerator.insert_segments`` ends a prefill chunk at every cut)."""
    bounds = [done, *(p * page_size for p in points if p * page_size > done), len(prompt)]
    return [prompt[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
