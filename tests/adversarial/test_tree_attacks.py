"""The relay tree under attack by many fresh identities (tests/adversarial/tree_attacks.py), over real HTTP
against an origin and six honest `swarm relay` processes: nothing the attackers do bans, evicts or demotes
an honest relay, every attempt is refused or contained, and every version still reaches every honest relay.
How long that takes against the same lab unattacked is bench/adversarial.py's figure (--tree)."""

from __future__ import annotations

import asyncio

import pytest

from tests.adversarial.tree_attacks import run_all

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    return {r["attack"]: r for r in asyncio.run(run_all(tmp_path_factory.mktemp("tree")))}


@pytest.mark.parametrize("attack", ["stalling_relays", "false_reports", "url_hijack", "join_flood"])
def test_no_honest_relay_is_harmed(rows, attack):
    r = rows[attack]
    assert (r["honest_banned"], r["honest_evicted"], r["honest_demoted"]) == (0, 0, 0), r
    assert r["honest_under_attacker"] == 0, r
    assert r["delivery_s"] is not None  # the version reached every honest relay during the attack
    if attack != "join_flood":  # a flood's first joins, within the address's burst, are accepted
        assert r["detected"] == r["attempts"], r


def test_what_each_attack_met(rows):
    stall = rows["stalling_relays"]
    assert stall["joined"] == 24  # they pass the connect-back: they do answer for their keys
    flood = rows["join_flood"]
    assert flood["accepted"] < 200 and flood["peers_held"] <= 1000
    assert rows["url_hijack"]["codes"].get("200", 0) == 0
    answers = rows["false_reports"]["answers"]
    assert set(answers) <= {"not confirmed", "inconclusive", "HTTP 429", "HTTP 403", "HTTP 404"}, answers
    assert answers.get("not confirmed", 0) >= 1
    refused = rows["join_flood"]["refused"]
    assert refused["connect_back_mismatch"] >= 1 and refused["rate_limited"] >= 1
    assert refused["unconfirmed_report"] >= 1


def test_stallers_that_join_first_do_not_keep_a_version_from_honest_relays(tmp_path):
    """Everyone fresh: the stallers sit above honest relays in the first version's layout. Every version
    still reaches every honest relay, none is harmed, and once the honest relays have shown they upload no
    staller is anyone's source."""
    from tests.adversarial.tree_attacks import stallers_first

    r = asyncio.run(stallers_first(tmp_path))
    assert (r["honest_banned"], r["honest_evicted"], r["honest_demoted"]) == (0, 0, 0), r
    assert r["honest_under_attacker"] == 0 and r["detected"] == r["attempts"], r
    assert r["first_version_s"] < 60 and r["delivery_s"] is not None, r
