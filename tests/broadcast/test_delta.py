"""Delta versions without the network: the codec is bit-exact, refuses what does not reproduce the signed
files, survives malformed payloads, and the manifest checks a delta's fields."""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
import torch
from bc_helpers import write_pieces
from delta_helpers import model_version
from safetensors.torch import save_file

from broadcast import delta
from broadcast.delta_publish import build_version, want_delta
from broadcast.manifest import ManifestError, TargetFile, decode_manifest, encode_manifest
from broadcast.store import Store
from swarm_common.keys import KeyPair


def _steps(tmp_path, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(700, 300, generator=g), "b": torch.randn(77, generator=g)}
    out = []
    for s in range(3):
        d = tmp_path / f"{dtype}".split(".")[-1] / f"v{s}"
        d.mkdir(parents=True)
        save_file({k: v.to(dtype) for k, v in w.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(f'{{"s": {s}}}')
        out.append(d)
        w = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in w.items()}  # an optimizer step
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    v = _steps(tmp_path, dtype)
    (v[2] / "added.txt").write_text("a file the base does not have")
    for base, new in ((v[0], v[1]), (v[1], v[2])):
        target, size = delta.encode(base, 1, new, tmp_path / "d")
        full = sum(t.size for t in target)
        assert size < full * (0.75 if dtype == torch.float32 else 0.5)
        out = tmp_path / "out" / new.name
        delta.apply(base, tmp_path / "d" / delta.PAYLOAD, target, 1, out)
        for t in target:
            assert (out / t.path).read_bytes() == (new / t.path).read_bytes()
    assert delta.element_width(v[0] / "model.safetensors") == (4 if dtype == torch.float32 else 2)


def test_wrong_base_is_refused(tmp_path):
    v = _steps(tmp_path, torch.bfloat16)
    target, _ = delta.encode(v[1], 1, v[2], tmp_path / "d")
    with pytest.raises(delta.DeltaError, match="does not match the signed sha256"):
        delta.apply(v[0], tmp_path / "d" / delta.PAYLOAD, target, 1, tmp_path / "out")
    with pytest.raises(delta.DeltaError, match="against v1"):
        delta.apply(v[1], tmp_path / "d" / delta.PAYLOAD, target, 4, tmp_path / "out2")


def test_malformed_payloads_fail_cleanly(tmp_path):
    v = _steps(tmp_path, torch.bfloat16)
    target, _ = delta.encode(v[0], 0, v[1], tmp_path / "d")
    payload = tmp_path / "d" / delta.PAYLOAD
    good = payload.read_bytes()
    (n,) = struct.unpack("<Q", good[8:16])
    bad = {
        "magic": b"XXXXXXXX" + good[8:],
        "huge index": good[:8] + struct.pack("<Q", 1 << 40) + good[16:],
        "index": good[:16] + b"{" * n + good[16 + n:],
        "truncated": good[: 16 + n + 10],
        "block": good[: 16 + n] + bytes(len(good) - 16 - n),
    }
    for what, data in bad.items():
        payload.write_bytes(data)
        with pytest.raises(delta.DeltaError):
            delta.apply(v[0], payload, target, 0, tmp_path / "out" / what.replace(" ", "_"))
    payload.write_bytes(good)
    with pytest.raises(delta.DeltaError, match="differ from the manifest"):
        delta.apply(v[0], payload, [msgspec.structs.replace(target[0], size=1), *target[1:]], 0,
                    tmp_path / "out3")


def test_manifest_signs_base_and_targets(tmp_path):
    kp = KeyPair.generate()
    a, b = model_version(tmp_path / "a", 0), model_version(tmp_path / "b", 1)
    m, served = build_version(b, 2, 1, kp, 64 << 10, a, tmp_path / "dd")
    assert m.base == 1 and served == tmp_path / "dd" and [f.path for f in m.files] == [delta.PAYLOAD]
    assert {t.path for t in m.target} == {"config.json", "model.safetensors"}
    assert m.total_size < sum(t.size for t in m.target) / 10
    assert decode_manifest(encode_manifest(m), kp.public_bytes) == m
    # Changing what it reconstructs or what it applies to breaks the signature.
    forged = msgspec.structs.replace(m, target=[TargetFile("config.json", 3, "0" * 64), *m.target[1:]])
    with pytest.raises(ManifestError, match="bad signature"):
        decode_manifest(encode_manifest(forged), kp.public_bytes)
    with pytest.raises(ManifestError, match="bad signature"):
        decode_manifest(encode_manifest(msgspec.structs.replace(m, base=0)), kp.public_bytes)
    for bad in (dict(base=2), dict(target=[]), dict(base=None),
                dict(target=[TargetFile("_delta/x", 1, "0" * 64)]),
                dict(target=[TargetFile("../x", 1, "0" * 64)])):
        with pytest.raises(ManifestError):
            decode_manifest(encode_manifest(msgspec.structs.replace(m, **bad)))
    # Random bytes do not get smaller as a delta: those go out whole.
    (b / "model.safetensors").write_bytes(np.random.default_rng(1).bytes(300_000))
    m2, served2 = build_version(b, 3, 2, kp, 64 << 10, a, tmp_path / "dd3")
    assert m2.base is None and served2 == b and not (tmp_path / "dd3").exists()


def test_full_every_rule():
    assert [want_delta(None, s, 4) for s in range(4)] == [True, True, True, False]
    assert not want_delta(None, 0, 1) and not want_delta(True, 0, 10) and want_delta(False, 9, 10)


def test_restart_drops_a_version_whose_rebuilt_file_is_damaged(tmp_path):
    kp = KeyPair.generate()
    a, b = model_version(tmp_path / "a", 0), model_version(tmp_path / "b", 1)
    m, served = build_version(b, 2, 1, kp, 64 << 10, a, tmp_path / "dd")
    for damage in (False, True):
        store = Store(tmp_path / f"peer{damage}")
        st = store.open_partial(m)
        write_pieces(st, served)
        delta.apply(a, st.dir / delta.PAYLOAD, m.target, 1, st.dir)
        path = store.finalize(st)
        if damage:
            with open(path / "model.safetensors", "r+b") as f:
                f.seek(1000)
                f.write(b"\x00\x01\x02")
        found = Store(tmp_path / f"peer{damage}").scan_complete(kp.public_bytes)
        assert (2 in found) is not damage and path.exists() is not damage
