"""KubernetesDiscovery against the fake API server on loopback, with a fake pool."""

from __future__ import annotations

import asyncio

import pytest

from tests.discovery.fakekube import FakeKube, make_pod
from tests.discovery.harness import discovering, eventually, run, url


def test_initial_list_adds_ready_pods_only():
    terminating = make_pod("p-term", role="prefill", ip="10.0.0.5")
    terminating["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    pods = [
        make_pod("p-ok", role="prefill", ip="10.0.0.1",
                 annotations={"sglang.ai/bootstrap-port": "8998"}),
        make_pod("p-unready", role="prefill", ip="10.0.0.2", ready=False),
        make_pod("p-pending", role="prefill", ip="10.0.0.3", phase="Pending"),
        make_pod("p-noip", role="prefill", ip=None),
        terminating,
        make_pod("d-ok", role="decode", ip="10.0.1.1"),
        make_pod("other", role="router", ip="10.0.2.1"),
    ]

    async def go():
        async with discovering(*pods) as (fake, pool, discovery):
            assert pool.urls("prefill") == {url("10.0.0.1")}
            assert pool.urls("decode") == {url("10.0.1.1")}
            assert sorted(pool.added) == [(url("10.0.0.1"), "prefill", 8998),
                                          (url("10.0.1.1"), "decode", None)]
            assert set(discovery.members) == pool.urls()

    run(go())


def test_bootstrap_port_port_and_model_from_the_pod():
    pods = [
        make_pod("p0", role="prefill", ip="10.0.0.1", labels={"sglang.ai/model": "llama"},
                 annotations={"sglang.ai/bootstrap-port": "9100", "sglang.ai/port": "31000"}),
        make_pod("p1", role="prefill", ip="10.0.0.2",
                 ports=[{"name": "http", "containerPort": 30500}]),
        make_pod("d0", role="decode", ip="10.0.1.1", labels={"sglang.ai/model": "llama"},
                 annotations={"sglang.ai/bootstrap-port": "9100"}),
    ]

    async def go():
        async with discovering(*pods) as (fake, pool, discovery):
            assert sorted(pool.added) == [
                ("http://10.0.0.1:31000", "prefill", 9100),
                ("http://10.0.0.2:30500", "prefill", None),  # learnt from /server_info later
                ("http://10.0.1.1:30000", "decode", None),
            ]
            assert pool.servers["http://10.0.0.1:31000"].model == "llama"
            assert pool.servers["http://10.0.0.2:30500"].model is None

    run(go())


def test_events_add_ready_unready_delete():
    async def go():
        async with discovering() as (fake, pool, discovery):
            assert pool.urls() == set()
            fake.add(make_pod("d0", role="decode", ip="10.0.1.1", ready=False))
            fake.add(make_pod("p0", role="prefill", ip="10.0.0.1"))
            await eventually(lambda: pool.urls() == {url("10.0.0.1")}, what="ADDED ready pod")
            fake.set_ready("d0", True)
            await eventually(lambda: url("10.0.1.1") in pool.urls(), what="pod became ready")
            fake.set_ready("d0", False)
            await eventually(lambda: url("10.0.1.1") not in pool.urls(), what="unready removed")
            fake.set_ready("d0", True)
            await eventually(lambda: url("10.0.1.1") in pool.urls(), what="ready pod re-added")
            fake.terminate("p0")
            await eventually(lambda: url("10.0.0.1") not in pool.urls(), what="terminating")
            fake.delete("d0")
            await eventually(lambda: pool.urls() == set(), what="DELETED removed")
            assert pool.removed == [url("10.0.1.1"), url("10.0.0.1"), url("10.0.1.1")]
            assert len(fake.requests("LIST")) == 2  # one per role, never again

    run(go())


def test_model_label_change_updates_the_worker_in_place():
    changes = []

    async def go():
        async with discovering(make_pod("d0", role="decode", labels={"sglang.ai/model": "a"}),
                               on_change=lambda: changes.append(1)) as (fake, pool, discovery):
            server = pool.servers[url("10.0.0.1")]
            assert server.model == "a"  # given to on_add: set before the server's probe
            assert changes == []

            def relabel(pod):
                pod["metadata"]["labels"]["sglang.ai/model"] = "b"

            fake.modify("d0", relabel)
            await eventually(lambda: server.model == "b", what="model updated")
            assert pool.removed == [] and len(pool.added) == 1
            assert changes == [1]  # the gateway regroups its servers by model

    run(go())


def test_closed_watch_resumes_from_the_last_resource_version():
    async def go():
        async with discovering(make_pod("p0", role="prefill", ip="10.0.0.1"),
                               selectors={"prefill": "role=prefill"}) as (fake, pool, discovery):
            await eventually(lambda: fake.watching() == 1, what="watching")
            version = fake.add(make_pod("p1", role="prefill", ip="10.0.0.2"))
            await eventually(lambda: len(pool.urls()) == 2, what="second pod")
            fake.close_watches()
            await eventually(lambda: len(fake.requests("WATCH")) == 2, what="re-watch")
            rewatch = fake.requests("WATCH")[-1]
            assert rewatch.params["resourceVersion"] == version["metadata"]["resourceVersion"]
            bookmark = fake.bookmark()
            await eventually(lambda: discovery.watches["prefill"].resource_version
                             == str(bookmark), what="bookmark applied")
            fake.abort_watches()  # a torn connection: retried after a short backoff
            await eventually(lambda: len(fake.requests("WATCH")) == 3, what="re-watch after abort")
            assert fake.requests("WATCH")[-1].params["resourceVersion"] == str(bookmark)
            fake.delete("p0")
            await eventually(lambda: pool.urls() == {url("10.0.0.2")}, what="event after re-watch")
            assert len(fake.requests("LIST")) == 1

    run(go())


@pytest.mark.parametrize("gone_as", ["event", "status"])
def test_gone_relists_and_reconciles(gone_as):
    async def go():
        fake = FakeKube(gone_as=gone_as)
        async with discovering(make_pod("p0", role="prefill", ip="10.0.0.1"),
                               make_pod("p1", role="prefill", ip="10.0.0.2"),
                               make_pod("d0", role="decode", ip="10.0.1.1"),
                               fake=fake) as (fake, pool, discovery):
            await eventually(lambda: fake.watching() == 2, what="watching")
            # while the watches are down, the cluster changes and its history expires
            fake.delete("p0", quiet=True)
            fake.set_ready("p1", False, quiet=True)
            fake.add(make_pod("p2", role="prefill", ip="10.0.0.3"), quiet=True)
            fake.add(make_pod("d1", role="decode", ip="10.0.1.2"), quiet=True)
            fake.compact()
            fake.close_watches()
            want = {url("10.0.0.3"), url("10.0.1.1"), url("10.0.1.2")}
            await eventually(lambda: pool.urls() == want, what="reconciled after 410")
            assert sorted(pool.removed) == [url("10.0.0.1"), url("10.0.0.2")]
            gone = [s for s in fake.requests("WATCH") if s.status == 410]
            assert len(gone) == 2 and len(fake.requests("LIST")) == 4
            fake.delete("d0")  # and the new watches work
            await eventually(lambda: url("10.0.1.1") not in pool.urls(), what="watch after relist")

    run(go())


def test_removal_waits_for_in_flight_requests():
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               drain_timeout=30) as (fake, pool, discovery):
            server = pool.servers[url("10.0.1.1")]
            server.in_flight = 2
            fake.delete("d0")
            await eventually(lambda: server.draining, what="draining")
            await asyncio.sleep(0.3)
            assert url("10.0.1.1") in pool.urls(), "removed while requests were in flight"
            server.in_flight = 0
            await eventually(lambda: pool.urls() == set(), what="removed once idle")

    run(go())


def test_drain_timeout_removes_anyway():
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               drain_timeout=0.3) as (fake, pool, discovery):
            server = pool.servers[url("10.0.1.1")]
            server.in_flight = 1
            fake.set_ready("d0", False)
            await eventually(lambda: server.draining, what="draining")
            started = asyncio.get_running_loop().time()
            await eventually(lambda: pool.urls() == set(), what="removed after the grace")
            assert asyncio.get_running_loop().time() - started >= 0.2

    run(go())


def test_pod_ready_again_while_draining_is_kept():
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               drain_timeout=30) as (fake, pool, discovery):
            server = pool.servers[url("10.0.1.1")]
            server.in_flight = 1
            fake.set_ready("d0", False)
            await eventually(lambda: server.draining, what="draining")
            fake.set_ready("d0", True)
            await eventually(lambda: not server.draining, what="undrained")
            server.in_flight = 0
            await asyncio.sleep(0.2)
            assert pool.servers[url("10.0.1.1")] is server and pool.removed == []

    run(go())


def test_new_pod_at_a_reused_address_replaces_the_worker():
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               drain_timeout=30) as (fake, pool, discovery):
            old = pool.servers[url("10.0.1.1")]
            old.in_flight = 1
            fake.delete("d0", quiet=True)  # the DELETED event was missed...
            fake.add(make_pod("d1", role="decode", ip="10.0.1.1"))  # ...the IP is reused
            await eventually(lambda: old.draining, what="old server draining")
            assert pool.servers[url("10.0.1.1")] is old
            old.in_flight = 0
            await eventually(lambda: pool.servers.get(url("10.0.1.1")) not in (None, old),
                             what="new server")
            assert discovery.members[url("10.0.1.1")].target.pod == "d1"

    run(go())


def test_api_errors_are_retried_with_backoff():
    async def go():
        fake = FakeKube()
        fake.fail_next("LIST", 500, 3)
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"), fake=fake,
                               selectors={"decode": "role=decode"}, backoff_initial=0.1,
                               backoff_max=1.0) as (fake, pool, discovery):
            assert pool.urls() == {url("10.0.1.1")}
            lists = fake.requests("LIST")
            assert [s.status for s in lists] == [500, 500, 500, 200]
            gaps = [b.at - a.at for a, b in zip(lists, lists[1:], strict=False)]
            assert 0.05 <= gaps[0] < 0.3 and 0.1 <= gaps[1] and 0.2 <= gaps[2] < 1.0, gaps
            # a failing WATCH is retried from the same version, without a new LIST
            await eventually(lambda: fake.watching() == 1, what="watching")
            fake.fail_next("WATCH", 503, 2)
            fake.close_watches()
            fake.add(make_pod("d1", role="decode", ip="10.0.1.2"))
            await eventually(lambda: len(pool.urls()) == 2, timeout=5, what="after watch errors")
            assert [s.status for s in fake.requests("WATCH")][-3:] == [503, 503, 200]
            assert len(fake.requests("LIST")) == 4

    run(go())


def test_api_outage_keeps_the_servers():
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               selectors={"decode": "role=decode"}) as (fake, pool, discovery):
            fake.fail_next("WATCH", 500, 10)
            fake.close_watches()
            await eventually(lambda: len(fake.requests("WATCH")) >= 5, timeout=5,
                             what="retries")
            assert pool.urls() == {url("10.0.1.1")} and pool.removed == []

    run(go())


def test_token_is_sent(tmp_path):
    token = tmp_path / "token"
    token.write_text("wrong")

    async def go():
        fake = FakeKube(token="s3cret")
        async with discovering(make_pod("d0", role="decode"), fake=fake, sync=False,
                               selectors={"decode": "role=decode"},
                               token_file=str(token)) as (fake, pool, discovery):
            await eventually(lambda: len(fake.requests("LIST")) >= 2, what="401 retried")
            assert pool.urls() == set()
            token.write_text("s3cret")
            await eventually(lambda: pool.urls() == {url("10.0.0.1")}, what="authorized")
            assert fake.requests("LIST")[-1].headers["authorization"] == "Bearer s3cret"

    run(go())


def test_refused_server_is_skipped_until_its_pod_changes():
    async def go():
        async with discovering(sync=False) as (fake, pool, discovery):
            pool.refuse.add(url("10.0.0.1"))
            fake.add(make_pod("p0", role="prefill", ip="10.0.0.1"))
            fake.add(make_pod("d0", role="decode", ip="10.0.1.1"))
            await eventually(lambda: pool.urls() == {url("10.0.1.1")}, what="others added")
            fake.bookmark()
            fake.add(make_pod("d1", role="decode", ip="10.0.1.2"))
            await eventually(lambda: len(pool.urls()) == 2, what="later pods added")
            assert url("10.0.0.1") not in pool.urls()
            pool.refuse.clear()
            fake.delete("p0")
            fake.add(make_pod("p0", role="prefill", ip="10.0.0.1", uid="second-life"))
            await eventually(lambda: url("10.0.0.1") in pool.urls(), what="new pod added")

    run(go())


def test_pod_in_both_selectors_is_left_out():
    both = make_pod("x", ip="10.0.9.9", labels={"prefill": "1", "decode": "1"})

    async def go():
        async with discovering(both, make_pod("d0", role="decode", ip="10.0.1.1"),
                               selectors={"prefill": "prefill=1", "decode": "decode"}
                               ) as (fake, pool, discovery):
            assert pool.urls() == set()  # d0 lacks the label "decode"; x is claimed twice
            fake.modify("x", lambda pod: pod["metadata"]["labels"].pop("decode"))
            await eventually(lambda: pool.urls("prefill") == {url("10.0.9.9")},
                             what="x as prefill only")

    run(go())


def test_reconcile_is_idempotent():
    async def go():
        async with discovering(make_pod("p0", role="prefill", ip="10.0.0.1"),
                               make_pod("d0", role="decode", ip="10.0.1.1")
                               ) as (fake, pool, discovery):
            before = dict(pool.servers)
            await discovery.reconcile()
            await discovery.reconcile()
            assert pool.servers == before and len(pool.added) == 2 and pool.removed == []

    run(go())


def test_stop_cancels_every_task():
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               drain_timeout=30) as (fake, pool, discovery):
            server = pool.servers[url("10.0.1.1")]
            server.in_flight = 1
            fake.delete("d0")
            await eventually(lambda: server.draining, what="draining")
            mine = [t for t in asyncio.all_tasks() if t.get_name().startswith("discovery")]
            assert len(mine) == 4  # two watches, the reconcile, one drain
        await asyncio.sleep(0)
        assert all(t.done() for t in mine)
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("discovery")]
        assert url("10.0.1.1") in pool.urls()  # stopping is not removing

    run(go())


class AlwaysGone(FakeKube):
    """Every WATCH is older than the server's history (an API replica whose watch cache is
    behind the one that served the LIST)."""

    async def _answer(self, head, writer):
        if "watch=1" in head.split("\r\n")[0]:
            self.floor = self.version + 1
        return await super()._answer(head, writer)


def test_a_watch_gone_right_after_each_list_relists_with_backoff():
    """(Before: about 1,000 LISTs a second, each with its reconcile.)"""
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               fake=AlwaysGone(), selectors={"decode": "role=decode"},
                               backoff_initial=0.05, backoff_max=0.4) as (fake, pool, _):
            before = len(fake.requests("LIST"))
            await asyncio.sleep(2.0)
            lists = len(fake.requests("LIST")) - before
            assert 2 <= lists <= 20, lists  # with a 0.4 s cap: ~5 a second at most
            assert pool.urls() == {url("10.0.1.1")}  # the known servers stay

    run(go())


def test_an_api_server_restored_to_an_older_version_is_listed_again():
    """The API server comes back from a backup: the watch's version is ahead of its history
    (504 "Too large resource version"). Discovery lists again and follows the pods as they
    are now (before: it watched from its old version forever and never saw a change)."""
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               selectors={"decode": "role=decode"}) as (fake, pool, _):
            await eventually(lambda: fake.watching() == 1, what="watching")
            fake.delete("d0", quiet=True)
            fake.add(make_pod("d1", role="decode", ip="10.0.1.2"), quiet=True)
            fake.restore(10)
            await eventually(lambda: pool.urls() == {url("10.0.1.2")}, what="listed again")
            assert any(seen.status == 504 for seen in fake.requests("WATCH"))
            fake.add(make_pod("d2", role="decode", ip="10.0.1.3"))  # and the watch works
            await eventually(lambda: url("10.0.1.3") in pool.urls(), what="watched again")

    run(go())


def test_a_server_an_operator_put_at_a_pods_address_is_left_alone_when_the_pod_goes():
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               selectors={"decode": "role=decode"}) as (fake, pool, disc):
            ours = url("10.0.1.1")
            pool.remove(ours)  # the operator: DELETE, then POST the same URL as their own
            mine = await pool.add(ours, "decode", None)
            fake.delete("d0")
            await eventually(lambda: ours not in disc.members, what="the pod's member gone")
            assert pool.servers.get(ours) is mine  # not removed (before: it was)

    run(go())


def test_a_pod_whose_server_never_answers_holds_up_no_other_pods_change():
    """Adding a pod probes its server (up to 2 x --probe-timeout). One that never answers
    must not hold up the others: a deleted pod leaves, a new one comes (before: both waited
    for that probe, and the deleted decode kept taking requests for 19 s)."""
    async def go():
        async with discovering(make_pod("d0", role="decode", ip="10.0.1.1"),
                               selectors={"decode": "role=decode"}) as (fake, pool, disc):
            hung = url("10.0.1.9")
            probing = asyncio.Event()
            added = pool.add

            async def add(address, *args, **kwargs):
                if address == hung:
                    probing.set()
                    await asyncio.sleep(3600)  # its server accepts and never answers
                return await added(address, *args, **kwargs)
            disc._on_add = add
            fake.add(make_pod("stuck", role="decode", ip="10.0.1.9"))
            await asyncio.wait_for(probing.wait(), 3)
            fake.delete("d0")
            fake.add(make_pod("d1", role="decode", ip="10.0.1.2"))
            await eventually(lambda: pool.urls() == {url("10.0.1.2")}, timeout=2,
                             what="the other pods' changes applied")

    run(go())
