"""A store's persisted counters while a process runs: checkpoints and the close add
each count exactly once (``tiers.checkpoints``)."""

from .small_pages import make_store, publish


def test_checkpoints_and_the_close_add_each_count_once(tmp_path):
    store = make_store(1, 1, tmp_path)
    publish(store, 0, 1)
    store.accounts.checkpoint_counters({"engine": {"requests": 1}})
    publish(store, 2)
    store.accounts.checkpoint_counters({"engine": {"requests": 2}})
    store.accounts.checkpoint_counters({"engine": {"requests": 2}})  # nothing new: nothing added
    publish(store, 3)
    store.close(extra_counters={"engine": {"requests": 3}})
    store.accounts.checkpoint_counters({"engine": {"requests": 9}})  # closed: ignored
    store = make_store(1, 1, tmp_path)
    saved = store.disk.tables.persistent_counters()
    assert saved["engine"]["requests"] == 3 and saved["tiers"]["L1"]["inserts"] == 4
    store.close()
