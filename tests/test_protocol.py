"""Wire messages: round trips, and refusal of malformed, oversized and out-of-range input."""

import msgspec
import pytest

from swarm_common import protocol as P

K = "ab" * 32


def _sub(**kw):
    base = dict(node_id=K, version=3, gen_seconds=0.5,
                rollouts=[P.Rollout("a1", [P.Sample([5, 6, 0], [-0.1, -0.2, -0.3], "stop")])])
    base.update(kw)
    return P.RolloutSubmission(**base)


@pytest.mark.parametrize("msg", [
    P.Register(node_id=K, name="box", max_prompts=8),
    P.Heartbeat(node_id=K, version_loaded=2, tokens_per_s=10.5),
    P.WorkRequest(node_id=K, version_loaded=0, max_prompts=4),
    _sub(),
    P.Registered(node_id=K, weights=P.WeightsInfo(1, "http://x/m.json"),
                 sampling=P.SamplingSpec(8, 16, 1.0, 1.0), heartbeat_s=2.0, max_lag=2, tracker_url="http://t",
                 trainer_key="ab" * 32),
    P.WorkAssignment(weights=P.WeightsInfo(1, "u"), min_version=0, assignments=[P.Assignment("a", [1, 2])],
                     sampling=P.SamplingSpec(8, 16, 1.0, 1.0)),
    P.SubmissionResult(accepted=["a"], refused={"b": "stale"}),
    P.VersionNotice(weights=P.WeightsInfo(2, "u")),
    P.Error(code="x", message="y"),
])
def test_round_trip(msg):
    assert P.decode(P.encode(msg)) == msg


def _code(data, **kw):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(data, **kw)
    return e.value.code


def test_refuses_garbage_and_truncation():
    assert _code(b"\x00\x01garbage") == "malformed"
    assert _code(P.encode(_sub())[:-5]) == "malformed"
    assert _code(b"") == "malformed"


def test_refuses_oversized_before_decoding():
    assert _code(b"x" * 100, max_bytes=50) == "oversized"


def test_refuses_unknown_tags_fields_and_types():
    enc = msgspec.msgpack.encode
    assert _code(enc({"type": "nope"})) == "malformed"
    assert _code(enc({"type": "heartbeat", "node_id": "n", "version_loaded": "x"})) == "malformed"
    assert _code(enc({"type": "heartbeat", "node_id": "n", "version_loaded": 1, "evil": 1})) == "malformed"
    assert _code(enc({"type": "submission", "node_id": "n", "version": 1, "gen_seconds": 0.1,
                      "rollouts": [{"assignment_id": "a", "samples": [[[1], [-0.1], "maybe"]]}]})) == "malformed"


@pytest.mark.parametrize("msg,what", [
    (P.Register(node_id="", name="x"), "node_id"),
    (P.Register(node_id=K * 500, name="x"), "node_id"),
    (P.Register(node_id=K, name="x", max_prompts=0), "max_prompts"),
    (P.Heartbeat(node_id=K, version_loaded=0, tokens_per_s=float("nan")), "tokens_per_s"),
    (P.WorkRequest(node_id=K, version_loaded=0, max_prompts=10**6), "max_prompts"),
    (_sub(version=-1), "version"),
    (_sub(gen_seconds=float("inf")), "gen_seconds"),
    (_sub(rollouts=[]), "rollouts"),
    (_sub(rollouts=[P.Rollout("a", [P.Sample([1, 2], [-0.1], "stop")])]), "length"),
    (_sub(rollouts=[P.Rollout("a", [P.Sample([], [], "stop")])]), "no tokens"),
])
def test_refuses_out_of_range(msg, what):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(P.encode(msg))
    assert e.value.code == "invalid" and what in e.value.message


def test_signed_frames_round_trip_and_refusals():
    from swarm_common.keys import KeyPair

    kp, other = KeyPair.generate(), KeyPair.generate()
    msg = P.Heartbeat(node_id=kp.public_hex, version_loaded=1)
    frames = P.sign(msg, kp)
    assert P.decode_signed(frames) == msg
    with pytest.raises(P.ProtocolError) as e:
        P.decode_signed(P.sign(msg, other))  # signed by a key that is not node_id's
    assert e.value.code == "bad_signature"
    with pytest.raises(P.ProtocolError) as e:
        P.decode_signed([frames[0]])
    assert e.value.code == "unsigned"
    tampered = P.encode(P.Heartbeat(node_id=kp.public_hex, version_loaded=2))
    with pytest.raises(P.ProtocolError) as e:
        P.decode_signed([tampered, frames[1]])
    assert e.value.code == "bad_signature"
    with pytest.raises(P.ProtocolError) as e:  # trainer-to-node messages are never taken from a node
        P.decode_signed(P.sign(P.Error(code="x", message="y"), kp))
    assert e.value.code == "unexpected"


def test_node_id_must_be_a_key():
    with pytest.raises(P.ProtocolError):
        P.decode(P.encode(P.Heartbeat(node_id="not-a-key", version_loaded=0)))
