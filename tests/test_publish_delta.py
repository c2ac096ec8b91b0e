"""The trainer's publishing path with delta versions, as the run loop takes it: fp32 master weights, a
version written in the published dtype by the Publisher, handed to the origin as (path, v, v - 1); a peer
fetches it over HTTP and what it loads is exactly what was published."""

from __future__ import annotations

import asyncio

import pytest
import torch

from broadcast.config import OriginConfig
from broadcast.origin import Origin
from broadcast.peer import Peer, PeerConfig
from model_builders.default_model import build_default_model
from swarm_common.keys import KeyPair
from trainer.learner import make_adamw
from trainer.policy import frozen_state, load_model
from trainer.publisher import Publisher

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_versions_go_out_as_deltas_and_load_as_published(tmp_path, dtype):
    base = build_default_model(tmp_path / "base", seed=0)
    model = load_model(base)
    opt = make_adamw(model, 1e-3, 0.0)
    pub = Publisher(tmp_path / "run", base, keep=3)
    kp = KeyPair.generate()

    async def scenario():
        origin = Origin(tmp_path / "run" / "broadcast", kp,
                        OriginConfig(full_every=3, heartbeat_s=0.3, piece_bytes=64 << 10), keep=3)
        await origin.start()
        peer = Peer(origin.url, tmp_path / "peer", kp.public_bytes, PeerConfig(stall_timeout=5), follow=False)
        await peer.start()
        try:
            kinds = []
            for v in range(5):
                if v:
                    opt.zero_grad()
                    ids = torch.randint(0, model.config.vocab_size, (2, 8))
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                weights = frozen_state(model, getattr(torch, dtype))
                path = await asyncio.to_thread(pub.publish, model, v, weights)
                m = await origin.publish(path, v, v - 1 if v else None)
                kinds.append(m.base)
                got = await peer.fetch(v, timeout=60)
                loaded = load_model(got, dtype=getattr(torch, dtype)).state_dict()
                assert all(torch.equal(loaded[k], weights[k]) for k in weights), f"v{v} differs"
                if m.base is not None:
                    assert m.total_size < sum(t.size for t in m.target)
            assert kinds == [None, 0, 1, None, 3]  # every 3rd whole
        finally:
            await peer.stop()
            await origin.stop()

    asyncio.run(scenario())
