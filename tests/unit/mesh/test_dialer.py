"""The dialer's decisions: who is dialed, in which address order, with what backoff."""

from __future__ import annotations

import asyncio

from mesh.dialer import Dialer
from mesh.membership.members import Member

ME, LOW, HIGH = "5" * 64, "1" * 64, "9" * 64


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _dialer(linked: set[str], calls: list, result: bool = False, clock=None) -> Dialer:
    members = [Member(node_id=n, public_key="00", addresses=[f"10.0.0.{n[0]}:9338"])
               for n in (ME, LOW, HIGH)]  # fmt: skip

    async def link(node_id: str, host: str, port: int) -> bool:
        calls.append((node_id, f"{host}:{port}"))
        return result

    return Dialer(ME, members=lambda: members, is_linked=linked.__contains__, link=link,
                  static_peers=["static:1"], redial_s=1.0, max_backoff_s=8.0,
                  clock=clock or Clock())  # fmt: skip


async def _round(dialer: Dialer, now: float) -> None:
    dialer.dial_due(now)
    await asyncio.gather(*dialer._dialing.values())


async def test_dials_every_unlinked_member_but_itself():
    calls: list = []
    await _round(_dialer({LOW}, calls), now=0.0)
    assert [c[0] for c in calls] == [HIGH, HIGH]  # its own address, then the static one
    assert calls == [(HIGH, "10.0.0.9:9338"), (HIGH, "static:1")]


async def test_lan_addresses_first_and_bad_addresses_skipped():
    calls: list = []
    dialer = _dialer({HIGH}, calls)
    dialer.on_found(LOW, ("192.168.1.7:9338", "junk"))
    await _round(dialer, now=0.0)
    assert calls == [(LOW, "192.168.1.7:9338"), (LOW, "10.0.0.1:9338"), (LOW, "static:1")]


async def test_a_stale_address_that_is_now_our_own_is_not_dialed():
    """A member's remembered address that this node now listens on (that node went, we took its
    port) would dial ourselves and look like a copied identity: it is skipped."""
    calls: list = []
    dialer = _dialer({HIGH}, calls)
    dialer.own_addresses = lambda: ["10.0.0.1:9338", "127.0.0.1:9338"]
    dialer.on_found(LOW, ("127.0.0.1:9338",))
    await _round(dialer, now=0.0)
    assert calls == [(LOW, "static:1")]


async def test_failures_back_off_exponentially():
    calls: list = []
    clock = Clock()
    dialer = _dialer({HIGH}, calls, clock=clock)
    dialed_at = []
    for t in range(40):
        clock.now = float(t)
        before = len(calls)
        await _round(dialer, now=clock.now)
        if len(calls) > before:
            dialed_at.append(t)
    assert dialed_at == [0, 1, 3, 7, 15, 23, 31, 39]  # 1, 2, 4, 8 s, then the 8 s cap


async def test_a_leaving_peer_is_left_alone_for_a_while():
    calls: list = []
    clock = Clock()
    dialer = _dialer({HIGH}, calls, clock=clock)
    dialer.on_left(LOW)
    await _round(dialer, now=7.0)
    assert calls == []
    clock.now = 8.0
    await _round(dialer, now=8.0)
    assert calls and calls[0][0] == LOW


async def test_a_lost_link_is_redialed_by_the_higher_id_only():
    calls: list = []
    linked: set[str] = set()
    dialer = _dialer(linked, calls, result=True)
    dialer.on_linked(LOW)
    dialer.on_linked(HIGH)  # both links existed, now both are gone
    await _round(dialer, now=0.0)
    assert {c[0] for c in calls} == {LOW}  # HIGH will dial us; we restore the link to LOW
    # Seen on the LAN (maybe at a new address): dial it regardless.
    dialer.on_found(HIGH, ("10.9.9.9:9338",))
    calls.clear()
    await _round(dialer, now=100.0)
    assert (HIGH, "10.9.9.9:9338") in calls
