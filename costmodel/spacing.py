"""Where a hybrid model's prefill keeps a snapshot of its recurrent state (DESIGN §3a).

Every ``spacing`` pages, and always at the last full page of the prompt (a restart
resumes there; the state at the prompt's very end stays in L1 with its partial page).
The engine cuts prefill chunks at these boundaries so that the state there exists,
and adds one at the end of the prefix a prompt shares with stored pages, and at the end
of a prefix that a follower waits for (prefix single flight).

``choose_spacing`` is the cost model's choice of ``spacing``. Its assumption: a later
prompt shares a prefix of this one that ends at a page boundary anywhere in it, each
equally likely. With a snapshot every ``s`` pages, such a restore recomputes on average
``s / 2`` pages past the snapshot before it, while each snapshot costs a prefill chunk
more (the compute model's constant), a copy out of the cache and one write to L3 (both
priced by the fitted links with the snapshot's bytes). The spacing minimises the sum for
this prompt: wide for a large state or a fast prefill, narrow for a small state.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.costmodel.profile import Profile


def snapshot_cost(profile: Profile, page_size: int, snapshot_bytes: int, context: int) -> float:
    """Predicted seconds one snapshot adds to a prefill: the chunk cut there (what two
    chunks cost beyond one), its copy out of the cache and its write down to L3."""
    compute = profile.compute.predict
    chunk = compute(page_size, context) + compute(page_size, context + page_size) - compute(2 * page_size, context)
    return (
        max(chunk, 0.0)
        + profile.links["L2->L1"].predict(snapshot_bytes)
        + profile.links["L3->L1"].predict(snapshot_bytes)
    )


def choose_spacing(profile: Profile, page_size: int, snapshot_bytes: int, prompt_tokens: int) -> int:
    """The snapshot spacing, in pages, with the least predicted cost for a prompt of
    ``prompt_tokens`` tokens (module docstring); at least 1, at most its full pages."""
    pages = max(1, (prompt_tokens - 1) // page_size)
    take = snapshot_cost(profile, page_size, snapshot_bytes, prompt_tokens // 2)

    def cost(spacing: int) -> float:
        lost = profile.compute.predict(spacing * page_size // 2, prompt_tokens // 2)
        return -(-pages // spacing) * take + lost

    return min(range(1, pages + 1), key=cost)


def snapshot_pages(prompt_tokens: int, page_size: int, spacing: int, shared: int = 0) -> list[int]:
    """The page counts after which a prefill of ``prompt_tokens`` tokens keeps a
    snapshot: multiples of ``spacing``, the last full page before the prompt's last
    token, and ``shared``, the pages it shares with stored ones (the end of a prefix two
    prompts share, such as a system prompt: the next prompt to share it restores all of
    it, not only up to the snapshot before its end), in order."""
    last = (prompt_tokens - 1) // page_size
    return sorted({*range(spacing, last + 1, spacing), last, min(shared, last)} - {0})


def prefill_segments(
    prompt: list[int], done: int, page_size: int, points: list[int], cuts: Sequence[int] = ()
) -> list[list[int]]:
    """``prompt[done:]`` cut at each snapshot point after ``done`` and at each token
    offset in ``cuts`` (mlx-lm's ``BatchGenerator.insert_segments`` ends a prefill chunk
    at every cut)."""
    inner = {p * page_size for p in points} | set(cuts)
    bounds = [done, *sorted(b for b in inner if done < b < len(prompt)), len(prompt)]
    return [prompt[a:b] for a, b in zip(bounds, bounds[1:])]
