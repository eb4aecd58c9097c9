"""bcg.runtime.entries: the entry cache keeps last-use order and the pool bytes of its entries."""
from bcg.runtime.entries import EntryCache


def test_entry_cache_orders_by_last_use():
    cache = EntryCache()

    class E:
        def __init__(self, name, size):
            self.signature, self.pool_bytes = name, size
    for name, size in (("a", 1), ("b", 2), ("c", 4)):
        cache.add(E(name, size))
    cache.touch("a")
    assert [e.signature for e in cache.entries()] == ["b", "c", "a"] and cache.pool_bytes == 7
    assert cache.pop_lru().signature == "b" and len(cache) == 2 and "b" not in cache
