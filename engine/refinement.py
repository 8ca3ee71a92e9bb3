"""Online refinement: the cost model learns from what the engine really did.

Only clean observations are fed: a link's time when no throttle slowed it (a
throttled link times the throttle's sleep, not the link), and prefill time from
steps that only prefilled one request's chunk (a step that also decoded, or
finished a prompt and sampled its first token, times more than the chunk).

Observing only records: the models are refitted (``refit_after_first_tokens``) once no
running request waits for its first token. A refit is a robust fit over the window
(milliseconds of scipy on a loaded CPU), and between a request's prefill and its first
token it would add to that request's TTFT, on every request.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtier.costmodel.plan import READ_LINKS, Profile
from kvtier.tiers.counters import LinkStats
from kvtier.tiers.links import Link

from .request import Request


def observe_links(
    profile: Profile, throttle: Mapping[str, float], before: Mapping[Link, LinkStats], after: Mapping[Link, LinkStats]
) -> None:
    """Feed the link models with what one restore moved: ``before`` and ``after`` are the
    store's link counters (``stats().links``) around it."""
    throttled = {link for tier in throttle for link in READ_LINKS[tier]}
    for name, now in after.items():
        if name in profile.links and name not in throttled and now.bytes > before[name].bytes:
            moved, seconds = now.bytes - before[name].bytes, now.seconds - before[name].seconds
            profile.links[name].observe(moved, seconds=seconds, refit=False)


def observe_prefill(
    profile: Profile, running: Mapping[int, Request], prompt_responses: list, generation_responses: list, seconds: float
) -> None:
    """Advance each prefilling request's ``prefilled`` count by this step's chunk, and feed
    the compute model with the step if it only prefilled one request's chunk."""
    clean = (
        len(prompt_responses) == 1
        and not generation_responses
        and not prompt_responses[0].end_of_prompt
        and all(r.t_first_token is None for r in running.values())
    )
    for response in prompt_responses:
        request = running[response.uid]
        prefilled = request.resumed + response.progress[0]  # mlx-lm counts from the last insertion
        chunk, cached = prefilled - request.prefilled, request.prefix_tokens + request.prefilled
        request.prefilled = prefilled
        if clean and chunk > 0:
            profile.compute.observe(chunk, cached, seconds=seconds, refit=False)


def refit_after_first_tokens(profile: Profile, running: Mapping[int, Request]) -> None:
    """Refit the models observed since their last refit, unless a running request has
    not had its first token yet (it is refitted after that token instead)."""
    if all(request.t_first_token is not None for request in running.values()):
        profile.refit_stale()
