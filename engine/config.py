"""The engine's settings, shared by the step loop and the parts it delegates to."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.tiers.checkpoints import COUNTERS_EVERY_S
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.policy import DEFAULT_POLICY


@dataclass
class EngineConfig:
    page_size: int = 128
    offload: bool = True
    store: StoreConfig = field(default_factory=StoreConfig)
    prefill_step_size: int = 512
    cache_salt: str = ""
    single_flight: str = "prefix"  # or "after-prefill" | "at-completion" (exact inputs only) | "off"
    publish: str = "incremental"  # after every step, or "at-completion" only
    publish_answers: bool = False  # at the end, also the pages the answer filled (a server's next turn)
    snapshot_spacing: int = 0  # a hybrid model keeps its state every this many pages; 0: the cost model's choice
    max_running: int = 32  # requests in the BatchGenerator at once; the rest wait
    refresh_window: int = 128  # waiting requests whose L1 pages are touched before admission
    window_s: float = 30.0  # cached tokens per second are measured over this window
    policy: str = DEFAULT_POLICY  # eviction policy of the store's tiers (tiers.policy)
    counters_every_s: float = COUNTERS_EVERY_S  # a serving engine adds its counters to the store this often
    # with nothing running, requests whose L3 reads are done wait this long for the others' (engine.l3_wait)
    join_wait_s: float = 0.05
