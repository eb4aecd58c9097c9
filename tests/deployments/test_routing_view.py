"""The routing view parses each replica's routing stats once when they arrive, not per request, and the
router takes the `ShapeKey` the ingress sends as it is. Fake replicas whose stats dict is replaced, never
changed, when new stats arrive, as Serve's RunningReplica does."""
from dataclasses import dataclass

from bcg.diffusers.shape_key import ShapeKey
from deployments import routing_view
from tests.deployments.test_router import FakeReplica, choose, make_router, uids


@dataclass
class PolledReplica(FakeReplica):
    """A FakeReplica whose routing stats are one dict until `poll` replaces it."""
    stats: dict = None

    def poll(self, warm, free_rows=None):
        self.stats = {"warm_keys": list(warm), "warm_batch_keys": [], "queue_len": self.queue_len,
                      "batch_free_rows": dict(free_rows or {})}

    @property
    def routing_stats(self):
        return self.stats


def test_each_replicas_stats_are_parsed_once_per_arrival_not_per_request(monkeypatch):
    parsed = []
    warm_set = routing_view.warm_set
    monkeypatch.setattr(routing_view, "warm_set", lambda stats: parsed.append(1) or warm_set(stats))
    a, b = PolledReplica("pa", queue_len=0), PolledReplica("pb", queue_len=1)
    a.poll(["64x64", "64x64.b2"], {"64x64": 2})
    b.poll(["64x64", "64x64.b2"])
    router = make_router([a, b])
    parsed.clear()
    for _ in range(5):
        ranks, _ = choose(router, [a, b], shape_key=ShapeKey.parse("64x64.b2"))
        assert [uids(r) for r in ranks] == [["pa"], ["pb"]]  # room for two rows in a's running batch
    assert len(parsed) == 2  # once per replica, for five requests
    b.poll(["32x32"])  # new stats from b: parsed once more, and routing follows them
    for _ in range(3):
        ranks, _ = choose(router, [a, b], shape_key=ShapeKey.parse("64x64"))
        assert [uids(r) for r in ranks] == [["pa"]]
    assert len(parsed) == 3


def test_a_shape_key_object_routes_like_its_string():
    warm, cold = FakeReplica("w", ("64x64.cfg",), 0), FakeReplica("c", ("16x16",), 0)
    router = make_router([warm, cold])
    for key in ("64x64.cfg", ShapeKey.parse("64x64.cfg")):
        ranks, _ = choose(router, [warm, cold], shape_key=key)
        assert [uids(r) for r in ranks] == [["w"]]
    assert routing_view.batch_group(ShapeKey.parse("64x64.b4.cfg")) == ("64x64.cfg", 4)
    assert routing_view.batch_group("not a key") == ("not a key", 1)
