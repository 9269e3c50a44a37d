"""LAN discovery's pure parts: the TXT record codec and the decision whether to dial."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.discovery import Advert, decode_txt, encode_txt, mesh_hash, should_dial

ME, OTHER = "a" * 64, "b" * 64


def test_txt_roundtrip_and_no_secret():
    txt = encode_txt(OTHER, "mesh-1")
    assert "mesh-1" not in "".join(txt.values())  # only a hash of the mesh id goes on the LAN
    raw = {k.encode(): v.encode() for k, v in txt.items()}  # zeroconf hands bytes back
    assert decode_txt(raw) == Advert(OTHER, mesh_hash("mesh-1"))


@pytest.mark.parametrize(
    "props",
    [
        {},
        {b"id": b"short", b"mh": b"0" * 16, b"v": b"1"},
        {b"id": b"z" * 64, b"mh": b"0" * 16, b"v": b"1"},
        {b"id": b"a" * 64, b"mh": b"0" * 16, b"v": b"2"},
        {b"id": b"a" * 64, b"mh": None, b"v": b"1"},
    ],
)
def test_decode_rejects_foreign_adverts(props):
    assert decode_txt(props) is None


@given(st.dictionaries(st.binary(max_size=8), st.one_of(st.none(), st.binary(max_size=80))))
def test_decode_never_crashes(props):
    decode_txt(props)


def _advert(node_id=OTHER, mesh="m", addresses=("10.0.0.2:9338",)) -> Advert:
    return Advert(node_id, mesh_hash(mesh), tuple(addresses))


@pytest.mark.parametrize(
    ("advert", "members", "connected", "expected"),
    [
        (_advert(), {OTHER}, set(), True),
        (_advert(mesh="other"), {OTHER}, set(), False),  # another mesh
        (_advert(node_id=ME), {ME}, set(), False),  # ourselves
        (_advert(), set(), set(), False),  # not a member: no pin to dial with
        (_advert(), {OTHER}, {OTHER}, False),  # already connected
        (_advert(addresses=()), {OTHER}, set(), False),  # nowhere to dial
    ],
)
def test_should_dial(advert, members, connected, expected):
    decision = should_dial(
        advert, self_id=ME, own_mesh_hash=mesh_hash("m"), members=members, connected=connected
    )
    assert decision is expected
